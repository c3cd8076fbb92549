"""On-policy distillation end to end: bad distill settings fail before Ray starts (one line, exit
2); a teacher that differs from the bundled student pulls it towards itself (distill/reverse_kl
falls); the teacher's held-out accuracy is logged once, before step 1; a standalone teacher on
its own fsdp2 ranks scores like the colocated one; a LoRA student and an fsdp2-sharded colocated
teacher work; multi-turn samples are distilled only on the tokens the student sampled.

The teacher is the bundled model with seeded noise on its weights (`noisy_teacher`): made in a
second, it differs from the student as a trained teacher does (a reverse KL well above 0, another
held-out accuracy), which is all these tests need; training one took minutes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from polyrl.batch import Ragged, RolloutBatch
from polyrl.builtin import resolve
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


def test_standalone_teacher_is_checked_before_ray_too(train_here, tmp_path):
    out = train_here(f"distill.teacher={tmp_path / 'nowhere'}", "distill.placement=standalone")
    assert_one_line_before_ray(out, "distill.teacher:", "nowhere", "polyrl export")


def test_teacher_ranks_with_a_colocated_teacher_are_refused(train_here):
    out = train_here("distill.teacher=builtin:tiny-arith", "distill.world_size=2")
    assert_one_line_before_ray(out, "distill.world_size", "distill.placement=disaggregated")


def test_recipe_distils_the_bundled_model_purely():
    cfg = load_config(JobConfig, files=[Path(__file__).resolve().parents[2] / "configs" / "distill_arith.yaml"])
    assert cfg.distill.enabled and cfg.distill.reward_weight == 0 and cfg.distill.coef == 1
    assert cfg.model.path == "builtin:tiny-arith" and cfg.trainer.total_steps == 20


def embedded(out: Path, steps: int, *overrides: str) -> JobConfig:
    """The embedded default (bundled model and task) for `steps` steps on the first 64 rows of
    each split, validated before training only."""
    return load_config(JobConfig, files=[EMBEDDED_DEFAULT], overrides=[
        f"trainer.total_steps={steps}", "trainer.val_every=0", "trainer.val_before_train=true",
        "trainer.progress_bar=false", "logging.plot_at_end=false", "logging.samples_every=0",
        "data.max_samples=64", f"trainer.output_dir={out}", *overrides])


def metric(out: Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of every logged row that has `key`."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r[key]) for r in rows if key in r]


def values(out: Path, key: str) -> list[float]:
    return [v for _, v in metric(out, key)]


@pytest.fixture(scope="module")
def noisy_teacher(tmp_path_factory) -> str:
    """The bundled model plus seeded noise (0.1 of each tensor's std), saved as `polyrl export`
    saves a model: a teacher of the same tokenizer that samples differently."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, out = resolve("builtin:tiny-arith"), tmp_path_factory.mktemp("teacher")
    model = AutoModelForCausalLM.from_pretrained(source)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1 * p.float().std().clamp_min(1e-3))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def colocated(ray_session, noisy_teacher, tmp_path_factory) -> Path:
    """6 steps of pure distillation, the teacher on the policy rank (the default placement)."""
    out = tmp_path_factory.mktemp("colocated")
    Trainer(embedded(out, 6, f"distill.teacher={noisy_teacher}", "distill.reward_weight=0")).fit()
    return out


@pytest.fixture(scope="module")
def swapped(ray_session, noisy_teacher, tmp_path_factory) -> Path:
    """Roles swapped: the noisy model is a LoRA student, the bundled model its teacher."""
    out = tmp_path_factory.mktemp("swapped")
    Trainer(embedded(out, 2, f"model.path={noisy_teacher}", "distill.teacher=builtin:tiny-arith",
                     "model.lora_rank=8")).fit()
    return out


@pytest.mark.slow
def test_distilled_student_moves_towards_the_teacher(colocated):
    kl = values(colocated, "distill/reverse_kl")
    assert len(kl) == 6 and all(math.isfinite(x) for x in kl), kl
    # the student differs from the teacher: KL(student || teacher) on its own samples is well
    # above 0, and pure distillation brings it down
    assert kl[0] > 0.05, kl
    assert sum(kl[-2:]) / 2 < 0.6 * sum(kl[:2]) / 2, kl
    assert values(colocated, "distill/reward_weight") == [0.0] * 6


@pytest.mark.slow
def test_teacher_held_out_accuracy_is_logged_once_before_step_1(colocated, swapped):
    teacher_acc = metric(colocated, "distill/teacher_val_acc")
    assert len(teacher_acc) == 1 and teacher_acc[0][0] == 0, teacher_acc
    assert values(colocated, "distill/teacher_val_response_length")
    summary = json.loads((colocated / "summary.json").read_text())
    assert summary["teacher_accuracy"] == teacher_acc[0][1]
    # the teacher's accuracy is the teacher's, not the student's: it is the held-out accuracy
    # of the teacher trained as the student (the swapped run's step 0), and the other way round
    student_acc = metric(colocated, "val/acc")[0]
    assert student_acc[0] == 0 and teacher_acc[0][1] != student_acc[1]
    assert metric(swapped, "val/acc")[0] == teacher_acc[0]
    assert metric(swapped, "distill/teacher_val_acc")[0] == student_acc


@pytest.mark.slow
def test_lora_student_distils_from_its_own_frozen_teacher(swapped):
    kl = values(swapped, "distill/reverse_kl")
    assert len(kl) == 2 and kl[0] > 0.05, kl  # the teacher, not the LoRA base (which is the student)
    assert all(g > 0 for g in values(swapped, "actor/grad_norm")), "no update reached the adapters"


@pytest.mark.slow
def test_standalone_teacher_on_its_own_fsdp2_ranks_scores_like_the_colocated_one(colocated, noisy_teacher,
                                                                                 tmp_path):
    # the same seeded run, its teacher sharded over two ranks of its own: the same reverse KL at
    # step 1 (the same samples) and step 2 (after an update driven by the teacher's log-probs),
    # and the same teacher accuracy, sampled on those ranks
    Trainer(embedded(tmp_path, 2, f"distill.teacher={noisy_teacher}", "distill.reward_weight=0",
                     "distill.placement=standalone", "distill.world_size=2", "distill.strategy=fsdp2",
                     "trainer.val_before_train=false")).fit()
    standalone, reference = values(tmp_path, "distill/reverse_kl"), values(colocated, "distill/reverse_kl")
    assert standalone == pytest.approx(reference[:2], rel=1e-4), (standalone, reference)
    assert metric(tmp_path, "distill/teacher_val_acc") == metric(colocated, "distill/teacher_val_acc")


@pytest.mark.slow
def test_fsdp2_shards_the_colocated_teacher_and_scores_like_one_rank(colocated, noisy_teacher, tmp_path):
    # the same seeded first batch, scored by the whole teacher on one rank (`colocated`) and by a
    # teacher sharded over two fsdp2 policy ranks: the same reverse KL
    Trainer(embedded(tmp_path, 1, f"distill.teacher={noisy_teacher}", "distill.reward_weight=0",
                     "actor.strategy=fsdp2", "actor.world_size=2", "trainer.val_before_train=false",
                     "distill.validate_teacher=false")).fit()
    kl = values(tmp_path, "distill/reverse_kl")
    assert kl == pytest.approx(values(colocated, "distill/reverse_kl")[:1], rel=1e-4), kl
    assert not metric(tmp_path, "distill/teacher_val_acc")  # distill.validate_teacher=false


def test_multi_turn_samples_are_distilled_only_on_the_tokens_the_student_sampled(tmp_path):
    # two samples of one prompt; the first is a multi-turn trajectory whose tokens 1-2 are tool
    # output (out of the loss mask, as polyrl/agents/runner.py builds it), where student and
    # teacher disagree wildly: the advantages the update trains on must be 0 there
    trainer = Trainer(embedded(tmp_path, 1, "distill.teacher=builtin:tiny-arith", "distill.reward_weight=0"))
    mask = Ragged.from_rows([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0]], torch.float32)
    student = Ragged.from_rows([[-0.5, -9.0, -9.0, -1.0], [-0.2, -0.3, -0.4]], torch.float32)
    teacher = Ragged.from_rows([[-0.1, -0.01, -0.01, -2.0], [-0.2, -0.1, -0.9]], torch.float32)
    ids = Ragged.from_rows([[5, 6, 7, 8], [5, 6, 7]], torch.long)
    n = torch.zeros(2, dtype=torch.long)
    batch = RolloutBatch(prompt_ids=Ragged.from_rows([[1, 2], [1, 2]], torch.long), response_ids=ids,
                         loss_mask=mask, group=n, stop_reason=n, finished_with_eos=n.bool(), weight_version=n,
                         min_version=n, max_version=n, continuations=n, rollout_logprobs=student,
                         rewards=torch.tensor([1.0, 0.0]))
    metrics, _ = trainer.advantages(batch, teacher)
    adv = batch.token_advantages.padded(4)
    expected = torch.tensor([[0.4, 0.0, 0.0, -1.0], [0.0, 0.2, -0.5, 0.0]])  # -(student - teacher)
    torch.testing.assert_close(adv, expected)
    # the reverse KL is over sampled tokens only: (0.4 - 1.0 + 0 + 0.2 - 0.5) / -5
    assert metrics["distill/reverse_kl"] == pytest.approx(0.9 / 5)
