"""Expert parallelism (`actor.expert_parallel_size`, training/expert_parallel.py; docs/moe.md):
the ep groups of the mesh, the one-line refusals, and on two real gloo ranks (fsdp2 x ep=2,
routing replay R3 on) the same log-probs, loss, gradient norm and weights as one rank, with the
weights streamed one expert at a time."""

from __future__ import annotations

import pytest
import torch

import engine_ranks
from gloo_world import run_world_ok
from moe_models import build_moe_model
from polyrl.batch import shard
from polyrl.batch.routes import not_routed
from polyrl.training.config import ActorConfig
from polyrl.training.mesh import MeshError, ParallelDims

EXPERTS, TOP_K, MOE_LAYERS = 6, 2, 2  # tests/moe_models.py: 3 layers, the middle one dense


def test_ep_groups_subdivide_the_data_sharding_ranks():
    dims = ParallelDims.of("fsdp2", 4, expert_parallel_size=2)
    assert (dims.world_size, dims.data_parallel_size, dims.gradient_parallel_size) == (4, 4, 4)
    assert [dims.expert_group(r) for r in range(4)] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [dims.expert_shard_group(r) for r in range(4)] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert ("ep", (2, 3)) in dims.groups() and "ep=2" in dims.describe()
    two = ParallelDims.of("fsdp2", 2, expert_parallel_size=2)
    assert [two.expert_shard_group(r) for r in range(2)] == [(0,), (1,)]


@pytest.mark.parametrize("fields, key", [
    (dict(strategy="ddp", world_size=2, expert_parallel_size=2), "needs actor.strategy=fsdp2"),
    (dict(strategy="fsdp2", world_size=3, expert_parallel_size=2), "does not divide"),
    (dict(strategy="fsdp2", world_size=4, tensor_parallel_size=2, expert_parallel_size=2), "not implemented"),
])
def test_refusals_name_the_key(fields, key):
    with pytest.raises(ValueError, match=key) as info:
        ActorConfig(**fields)
    assert "actor.expert_parallel_size=2" in str(info.value)
    with pytest.raises(MeshError):
        ParallelDims(dp_shard=3, ep=2)


def test_preflight_refuses_a_model_ep_cannot_split():
    from transformers import Qwen2Config

    from moe_models import moe_config
    from polyrl.config import ConfigError, load_config
    from polyrl.job import JobConfig
    from polyrl.trainer.preflight import check_expert_parallel

    def problem(ep: int, model_config):
        cfg = load_config(JobConfig, overrides=["actor.strategy=fsdp2", f"actor.world_size={ep}",
                                                f"actor.expert_parallel_size={ep}"])
        with pytest.raises(ConfigError) as err:
            check_expert_parallel(cfg, model_config)
        (line,) = err.value.problems
        assert "\n" not in line and f"actor.expert_parallel_size={ep}" in line
        return line

    assert "num_experts=6" in problem(4, moe_config("qwen3_moe", experts=6))
    assert "not a Qwen3-MoE" in problem(2, Qwen2Config())
    cfg = load_config(JobConfig, overrides=["actor.strategy=fsdp2", "actor.world_size=2",
                                            "actor.expert_parallel_size=2"])
    check_expert_parallel(cfg, moe_config("qwen3_moe", experts=6))  # 2 divides 6: fine


def with_routes(batch, seed: int):
    """The batch with engine routes (R3): k distinct random experts per fed response token of
    each MoE layer, some tokens unmarked (routed by the trainer)."""
    g = torch.Generator().manual_seed(seed)
    n = len(batch.response_ids.values)
    ids = torch.rand(n, MOE_LAYERS, EXPERTS, generator=g).argsort(-1)[..., :TOP_K].to(torch.uint8)
    ids[torch.rand(n, generator=g) < 0.2] = not_routed(torch.uint8)
    return batch.replace(routes=batch.response_ids.with_values(ids))


BATCHES = ((1, 7), (2, 7), (3, 1))
"""(seed, samples): 7 samples split 4 / 3 over two ranks, then 1 (rank 1 idle: it mirrors the
other's forwards, all-to-alls included)."""


def ep_rank(rank: int, world_size: int, model_path: str, ep: int, replay: str, ckpt: str | None = None,
            sp: int = 1) -> dict:
    """One rank: log-probs of a whole batch (the same on every rank), then a PPO update per
    batch of BATCHES on this rank's shard (the same for the ranks of an sp group); the
    metrics, the streamed weights and what the stream announced."""
    strategy = "fsdp2" if world_size > 1 else "ddp"
    cfg = engine_ranks.actor_config(strategy, world_size=world_size, expert_parallel_size=ep, router_replay=replay,
                                    gradient_checkpointing=True, sequence_parallel_size=sp)
    dims = ParallelDims.from_actor(cfg)
    routed = with_routes if replay != "off" else (lambda batch, seed: batch)
    engine, actor = engine_ranks.build(model_path, cfg, rank, world_size)
    out = {"logprobs": engine.logprobs(routed(engine_ranks.make_batch(9, 5), 9)).values, "metrics": []}
    for seed, n in BATCHES:
        mine = shard(routed(engine_ranks.make_batch(seed, n), seed), dims.data_parallel_size)[dims.data_rank(rank)]
        m = actor.update(mine, num_mini_batches=1, use_rollout_logprobs=False)
        out["metrics"].append({k: m[k] for k in ("actor/loss", "actor/grad_norm")})
    out["weights"] = engine_ranks.full_weights(engine)
    if world_size == 1:
        return out
    out["pieces"] = {s.name: s.pieces for s in engine.stream_specs()}
    # what a bucketed sender gets: the experts one at a time, each [1, ...] (checked against the specs)
    out["expert_items"] = [tuple(t.shape) for name, t in engine.weight_stream().pieces()
                           if name == "model.layers.2.mlp.experts.gate_up_proj"]
    if ckpt is not None:  # DCP shards of the (efsdp, ep) DTensors, and the Hugging Face policy/
        from pathlib import Path

        Path(ckpt).mkdir(parents=True, exist_ok=True)
        engine.save(Path(ckpt))
        fresh, _ = engine_ranks.build(model_path, cfg, rank, world_size)
        fresh.load(Path(ckpt))
        out["resumed"] = engine_ranks.full_weights(fresh)
    out["experts_held"] = {n: tuple(p.to_local().shape) for n, p in engine.model.named_parameters()
                           if n.endswith("experts.gate_up_proj")}
    return out


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    return build_moe_model(tmp_path_factory.mktemp("moe"), "qwen3_moe")


@pytest.mark.slow
def test_ep2_equals_one_rank_with_r3(moe_path, tmp_path):
    path = moe_path
    one = ep_rank(0, 1, path, 1, "R3")
    ckpt = tmp_path / "ckpt"
    two = run_world_ok(ep_rank, 2, tmp_path, args=(path, 2, "R3", str(ckpt)), timeout_s=300)
    for rank in (0, 1):
        got = two[rank]
        torch.testing.assert_close(got["logprobs"], one["logprobs"], rtol=0, atol=1e-5)
        for a, b in zip(one["metrics"], got["metrics"]):
            for key in ("actor/loss", "actor/grad_norm"):
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
        assert got["weights"].keys() == one["weights"].keys()
        for name, w in one["weights"].items():
            torch.testing.assert_close(got["weights"][name], w, rtol=0, atol=1e-5)
        # each rank holds 3 of the 6 experts; the stream sends one expert per piece
        assert got["experts_held"] == {"model.layers.0.mlp.experts.gate_up_proj": (3, 32, 32),
                                       "model.layers.2.mlp.experts.gate_up_proj": (3, 32, 32)}
        assert got["pieces"]["model.layers.0.mlp.experts.down_proj"] == tuple(range(EXPERTS + 1))
        assert got["expert_items"] == [(1, 32, 32)] * EXPERTS
        for name, w in got["weights"].items():  # a checkpoint resumes to the same experts on each rank
            assert torch.equal(got["resumed"][name], w), name
    from transformers import AutoModelForCausalLM

    saved = dict(AutoModelForCausalLM.from_pretrained(str(ckpt / "policy"), dtype=torch.float32).named_parameters())
    for name, w in two[0]["weights"].items():
        assert torch.equal(saved[name], w), name


@pytest.mark.slow
def test_ep2_composes_with_sequence_parallelism(moe_path, tmp_path):
    """4 ranks: dp_shard=2 (the ep group) x sp=2; each rank's 3 experts are sharded by FSDP2 over
    its sp group (2 rows and 1), and each rank dispatches its own slice of the packed rows,
    replaying (R3) its slice of the routes."""
    one = ep_rank(0, 1, moe_path, 1, "R3")
    four = run_world_ok(ep_rank, 4, tmp_path, args=(moe_path, 2, "R3", None, 2), timeout_s=400)
    for rank, got in four.items():
        torch.testing.assert_close(got["logprobs"], one["logprobs"], rtol=0, atol=1e-5)
        for a, b in zip(one["metrics"], got["metrics"]):
            for key in ("actor/loss", "actor/grad_norm"):
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
        for name, w in one["weights"].items():  # six AdamW steps amplify ~1e-9 gradient noise (measured 1.2e-5)
            torch.testing.assert_close(got["weights"][name], w, rtol=0, atol=2e-5)
        rows = 2 if rank % 2 == 0 else 1  # torch.chunk of 3 experts over the 2 ranks of an sp group
        assert got["experts_held"]["model.layers.0.mlp.experts.gate_up_proj"] == (rows, 32, 32)
