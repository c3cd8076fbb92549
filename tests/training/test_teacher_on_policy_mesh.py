"""A distillation teacher held on the policy ranks (distill.placement=colocated) is built with the
policy's mesh: pre-flight refuses a teacher the policy's tp or ep cannot split (one line naming
the keys and the fix, polyrl/trainer/preflight.py `check_colocated_teacher`), and a dense teacher
under expert parallelism keeps its MLPs whole (training/fsdp2.py: a frozen model without experts
is not split), giving the log-probs of one rank."""

from __future__ import annotations

import pytest
import torch

import engine_ranks
from gloo_world import run_world_ok
from moe_models import build_moe_model
from polyrl.config import ConfigError, load_config
from polyrl.job import JobConfig
from polyrl.trainer.preflight import check_colocated_teacher
from tiny_models import build_tiny_model


def problem(teacher: str, *overrides: str) -> str | None:
    cfg = load_config(JobConfig, overrides=["actor.strategy=fsdp2", "actor.world_size=2",
                                            f"distill.teacher={teacher}", *overrides])
    try:
        check_colocated_teacher(cfg)
    except ConfigError as exc:
        (line,) = exc.problems
        assert "\n" not in line
        return line
    return None


@pytest.fixture(scope="module")
def teachers(tmp_path_factory) -> dict[str, str]:
    # tiny-model shapes: the dense one 4 heads, 2 key-value heads (tests/tiny_models.py); the
    # MoE ones 6 and 5 experts (tests/moe_models.py)
    root = tmp_path_factory.mktemp("teachers")
    return {"dense": build_tiny_model(root / "dense"), "moe6": build_moe_model(root / "moe6"),
            "moe5": build_moe_model(root / "moe5", experts=5)}


def test_preflight_refuses_a_colocated_teacher_the_policy_mesh_cannot_split(teachers):
    # the tiny dense model's 2 key-value heads do not divide by tp=4
    line = problem(teachers["dense"], "actor.world_size=4", "actor.tensor_parallel_size=4")
    assert line == (f"distill.teacher={teachers['dense']} (distill.placement=colocated: on the policy's mesh): "
                    "actor.tensor_parallel_size=4 does not divide the model's num_key_value_heads=2; set "
                    "actor.tensor_parallel_size to a divisor of 2, or set distill.placement=disaggregated")
    line = problem(teachers["moe5"], "actor.expert_parallel_size=2")
    assert line is not None and "actor.expert_parallel_size=2 does not divide the teacher's num_experts=5" in line
    assert "distill.placement=disaggregated" in line
    # what the policy's mesh can split, and a teacher on its own ranks, pass
    assert problem(teachers["moe6"], "actor.expert_parallel_size=2") is None
    assert problem(teachers["dense"], "actor.expert_parallel_size=2") is None  # its MLPs stay whole
    assert problem(teachers["dense"], "actor.tensor_parallel_size=2") is None
    assert problem(teachers["moe5"], "actor.expert_parallel_size=2", "distill.placement=disaggregated") is None


def frozen_logprobs(rank: int, world_size: int, model_path: str, ep: int, horizon: int | None) -> torch.Tensor:
    """The log-probs of one batch by a frozen (horizon None) fsdp2 engine on an ep mesh."""
    cfg = engine_ranks.actor_config("fsdp2" if world_size > 1 else "ddp", world_size=world_size,
                                    expert_parallel_size=ep)
    engine, _ = engine_ranks.build(model_path, cfg, rank, world_size, horizon=horizon)
    return engine.logprobs(engine_ranks.make_batch(9, 5)).values


def trained_dense_refusal(rank: int, world_size: int, model_path: str) -> str:
    try:
        frozen_logprobs(rank, world_size, model_path, 2, horizon=8)
    except ValueError as exc:
        return str(exc)
    return ""


@pytest.mark.slow
def test_a_dense_teacher_under_ep2_keeps_its_mlps_and_equals_one_rank(teachers, tmp_path):
    one = frozen_logprobs(0, 1, teachers["dense"], 1, None)
    (tmp_path / "frozen").mkdir()
    (tmp_path / "trained").mkdir()
    two = run_world_ok(frozen_logprobs, 2, tmp_path / "frozen", args=(teachers["dense"], 2, None), timeout_s=120)
    for rank in (0, 1):
        torch.testing.assert_close(two[rank], one, rtol=0, atol=1e-5)
    # a trained model without experts is still refused: ep would silently do nothing
    refused = run_world_ok(trained_dense_refusal, 2, tmp_path / "trained", args=(teachers["dense"],), timeout_s=120)
    assert all("has no Qwen3-MoE / Qwen2-MoE expert layers to split" in r for r in refused.values()), refused
