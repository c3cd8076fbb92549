"""Pre-flight from the model directories themselves (polyrl/trainer/preflight.py), before Ray: a
vision-language model's context length and head counts (kept in its text_config), sequence
parallelism against them and against the batch-invariant forward, weights that are missing or
damaged (student or teacher, named by their key), and distillation weights out of range."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from cli_runs import train_here  # noqa: F401  (a fixture)
from transformers import AutoConfig

from polyrl.builtin import resolve
from polyrl.config import ConfigError, load_config
from polyrl.job import JobConfig
from polyrl.trainer.preflight import check_model_context, check_sequence_parallel, check_weights, model_context_length

VL = Path(resolve("builtin:tiny-vl"))
ARITH = Path(resolve("builtin:tiny-arith"))


def job(*overrides: str) -> JobConfig:
    return load_config(JobConfig, overrides=list(overrides))


def sp_job(k: int, *overrides: str) -> JobConfig:
    """k ranks, all one sequence-parallel group."""
    return job("actor.strategy=fsdp2", f"actor.world_size={k}", f"actor.sequence_parallel_size={k}",
               f"data.train_batch_size={8 * k}", *overrides)


def one_line(fn) -> str:
    with pytest.raises(ConfigError) as info:
        fn()
    (line,) = info.value.problems
    return line


def test_a_vlms_context_length_is_its_text_configs():
    config = AutoConfig.from_pretrained(VL)
    assert getattr(config, "max_position_embeddings", None) is None  # Qwen2-VL keeps it in text_config
    assert model_context_length(config) == 128
    line = one_line(lambda: check_model_context(job("rollout.response_length=100"), 40, config))
    assert "exceeds the model's context of 128" in line and "at most 88" in line


def test_polyrl_train_refuses_a_vlm_run_longer_than_its_context_before_ray(train_here):
    import ray

    ray_before = ray.is_initialized()
    out = train_here("model.path=builtin:tiny-vl", "data.train_files=[builtin:shapes_val]", "data.val_files=[]",
                     "rollout.response_length=1800")
    assert out.returncode == 2 and "context of 128" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert ray.is_initialized() == ray_before


def test_sequence_parallel_is_checked_against_the_heads_and_batch_invariance():
    vl, arith = AutoConfig.from_pretrained(VL), AutoConfig.from_pretrained(ARITH)
    line = one_line(lambda: check_sequence_parallel(sp_job(2, "rollout.batch_invariant=true"), arith))
    assert line.startswith("actor.sequence_parallel_size=2") and "rollout.batch_invariant=false" in line
    heads = arith.num_attention_heads
    kv = getattr(arith, "num_key_value_heads", None) or heads
    bad = next(k for k in (3, 4, 5, 6, 7, 8) if heads % k or kv % k)
    line = one_line(lambda: check_sequence_parallel(sp_job(bad), arith))
    assert line.startswith(f"actor.sequence_parallel_size={bad}") and f"{heads} attention heads" in line
    # a VLM's heads are in its text_config
    text = vl.get_text_config()
    vl_bad = next(k for k in (3, 4, 5, 6, 7, 8) if text.num_attention_heads % k or
                  (text.num_key_value_heads or text.num_attention_heads) % k)
    line = one_line(lambda: check_sequence_parallel(sp_job(vl_bad), vl))
    assert f"{text.num_attention_heads} attention heads" in line
    check_sequence_parallel(sp_job(2), arith)  # 2 divides tiny-arith's heads


@pytest.fixture
def copies(tmp_path):
    """Two copies of tiny-arith: a student and a teacher to damage."""
    return [Path(shutil.copytree(ARITH, tmp_path / name)) for name in ("student", "teacher")]


def test_missing_or_damaged_weights_are_named_by_their_key(copies):
    student, teacher = copies
    check_weights(job(f"model.path={student}", f"distill.teacher={teacher}"))
    weights = teacher / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # a copy cut short
    line = one_line(lambda: check_weights(job(f"model.path={student}", f"distill.teacher={teacher}")))
    assert line.startswith(f"distill.teacher: {weights} is damaged")
    weights.unlink()  # no weights at all: distill.teacher, not model.path
    line = one_line(lambda: check_weights(job(f"model.path={student}", f"distill.teacher={teacher}")))
    assert line.startswith(f"distill.teacher: {teacher} holds no weights")
    (student / "model.safetensors").write_bytes(b"\xff" * 64)  # garbage
    line = one_line(lambda: check_weights(job(f"model.path={student}")))
    assert line.startswith(f"model.path: {student / 'model.safetensors'} is damaged")


def test_polyrl_train_reports_a_corrupt_teacher_before_ray(train_here, copies):
    student, teacher = copies
    (teacher / "model.safetensors").write_bytes(b"garbage" * 10)
    out = train_here(f"model.path={student}", f"distill.teacher={teacher}")
    assert out.returncode == 2 and "distill.teacher:" in out.stderr and "is damaged" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("value", ["inf", "1e30", "nan", "-1"])
def test_distill_coef_out_of_range_is_refused(value):
    with pytest.raises(ConfigError) as info:
        job("distill.teacher=builtin:tiny-arith", f"distill.coef={value}")
    assert info.value.problems[0].startswith("distill.coef")
    job("distill.teacher=builtin:tiny-arith", "distill.coef=10")


def test_standalone_teacher_ranks_count_against_the_ranks_per_core_cap():
    import os

    from polyrl.trainer.preflight import MAX_RANKS_PER_CORE, check_placement

    limit = MAX_RANKS_PER_CORE * (os.cpu_count() or 1)
    teacher = ["distill.teacher=builtin:tiny-arith", "distill.placement=standalone"]
    check_placement(job(*teacher, f"distill.world_size={limit - 1}"))  # 1 policy rank + limit - 1
    line = one_line(lambda: check_placement(job(*teacher, f"distill.world_size={limit}")))
    assert f"1 policy ranks + {limit} teacher ranks (distill.world_size={limit})" in line
    assert "lower actor.world_size or distill.world_size" in line


def test_non_finite_updates_of_a_distillation_run_name_distill_coef():
    """The rank's message (training/ddp.py) names actor.lr and the rewards; polyrl.train adds
    distill.coef when distillation is on (polyrl/api.py `with_distill_hint`)."""
    from polyrl.api import with_distill_hint
    from polyrl.training.base import NonFiniteUpdate

    rank = NonFiniteUpdate("3 updates in a row had a NaN/inf loss or gradient (each was skipped); stopping. "
                           "Lower actor.lr, enable actor.grad_clip, or check the rewards.")
    hinted = with_distill_hint(rank, job("distill.teacher=builtin:tiny-arith", "distill.coef=500"))
    assert isinstance(hinted, NonFiniteUpdate) and "lower distill.coef (now 500" in str(hinted)
    assert with_distill_hint(rank, job()) is rank  # no distillation: the rank's message as it is
