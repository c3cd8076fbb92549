"""On-policy distillation end to end: bad distill settings fail before Ray starts (one line, exit
2); a teacher made by `polyrl train` + `polyrl export` on the embedded task pulls a fresh student
towards it (distill/reverse_kl falls), with a full-weight and a LoRA student."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from polyrl.cli.main import main
from polyrl.cli.train import EMBEDDED_DEFAULT
from polyrl.config import load_config
from polyrl.job import JobConfig
from polyrl.trainer.loop import Trainer
from cli_runs import train_here  # noqa: F401  (a fixture)


def assert_one_line_before_ray(out, *needles):
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and "starting Ray" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if needles[0] in line]
    assert len(lines) == 1, out.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_teacher_with_another_vocabulary_fails_naming_both_tokenizers(train_here, tiny_model):
    # the student is the bundled model (byte-level, 259 tokens), the teacher a char-level one
    out = train_here("distill.teacher=" + tiny_model, "trainer.total_steps=1")
    assert_one_line_before_ray(out, "distill.teacher:", tiny_model, "builtin:tiny-arith", "differs")


def test_teacher_that_is_not_a_model_directory(train_here, tmp_path):
    out = train_here(f"distill.teacher={tmp_path / 'nowhere'}", "trainer.total_steps=1")
    assert_one_line_before_ray(out, "distill.teacher:", "nowhere", "polyrl export")


def test_standalone_teacher_is_refused_as_not_built(train_here, tmp_path):
    out = train_here(f"distill.teacher={tmp_path}", "distill.placement=standalone")
    assert_one_line_before_ray(out, "distill.placement=standalone", "not built yet")


def test_recipe_distils_the_bundled_model_purely():
    cfg = load_config(JobConfig, files=[Path(__file__).resolve().parents[2] / "configs" / "distill_arith.yaml"])
    assert cfg.distill.enabled and cfg.distill.reward_weight == 0 and cfg.distill.coef == 1
    assert cfg.model.path == "builtin:tiny-arith" and cfg.trainer.total_steps == 20


def embedded(out: Path, steps: int, *overrides: str) -> JobConfig:
    """The embedded default (bundled model and task) for `steps` steps, no validation."""
    return load_config(JobConfig, files=[EMBEDDED_DEFAULT], overrides=[
        f"trainer.total_steps={steps}", "trainer.val_every=0", "trainer.val_before_train=false",
        "trainer.progress_bar=false", "logging.plot_at_end=false", "logging.samples_every=0",
        f"trainer.output_dir={out}", *overrides])


def metric(out: Path, key: str) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]


@pytest.fixture(scope="module")
def teacher(ray_session, tmp_path_factory) -> str:
    """A teacher as a user makes one: 10 GRPO steps on the embedded task, then `polyrl export`."""
    root = tmp_path_factory.mktemp("teacher")
    Trainer(embedded(root / "run", 10)).fit()
    exported = root / "model"
    assert main(["export", str(root / "run" / "checkpoints" / "step_000010"), "--output", str(exported)]) == 0
    return str(exported)


@pytest.mark.slow
def test_distilled_student_moves_towards_the_teacher(teacher, tmp_path):
    out = tmp_path / "student"
    Trainer(embedded(out, 6, f"distill.teacher={teacher}", "distill.reward_weight=0")).fit()
    kl = metric(out, "distill/reverse_kl")
    assert len(kl) == 6 and all(math.isfinite(x) for x in kl), kl
    # the fresh student (the warm start, 37% held out) differs from the teacher: KL(student ||
    # teacher) on its own samples is well above 0, and pure distillation brings it down
    assert kl[0] > 0.3, kl
    assert sum(kl[-2:]) / 2 < 0.6 * sum(kl[:2]) / 2, kl
    assert metric(out, "distill/reward_weight") == [0.0] * 6


@pytest.mark.slow
def test_lora_student_distils_from_its_own_frozen_teacher(teacher, tmp_path):
    out = tmp_path / "lora"
    Trainer(embedded(out, 2, f"distill.teacher={teacher}", "model.lora_rank=8")).fit()
    kl = metric(out, "distill/reverse_kl")
    assert len(kl) == 2 and kl[0] > 0.3, kl  # the teacher, not the LoRA base (which is the student)
    assert all(g > 0 for g in metric(out, "actor/grad_norm")), "no update reached the adapters"


@pytest.mark.slow
def test_fsdp2_shards_the_teacher_and_scores_like_one_rank(teacher, tmp_path):
    # the same seeded first batch, scored by a whole teacher on one rank and by a teacher
    # sharded over two fsdp2 ranks: the same reverse KL
    kl = {}
    for name, layout in (("ddp", ()), ("fsdp2", ("actor.strategy=fsdp2", "actor.world_size=2"))):
        out = tmp_path / name
        Trainer(embedded(out, 1, f"distill.teacher={teacher}", "distill.reward_weight=0", *layout)).fit()
        kl[name] = metric(out, "distill/reverse_kl")
    assert kl["ddp"][0] > 0.3 and kl["fsdp2"][0] == pytest.approx(kl["ddp"][0], rel=1e-4), kl
