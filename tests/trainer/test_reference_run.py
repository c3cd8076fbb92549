"""One 2-step GRPO run with one policy rank in hybrid placement, on real Ray actors with a tiny
random model, trained once for the module (`one_rank_hybrid`): the metrics, summary and config
it writes, and the layouts that must train exactly like it, compared step by step (two gloo
ranks; two standalone rollout replicas fed over the weight-sync broadcast). Per-prompt seeds
make their rollouts identical, so only float summation order may differ."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from len_reward_job import job, read
from polyrl.trainer.loop import Trainer

COMPARED = ("reward/score_mean", "response/length_mean", "actor/loss", "actor/grad_norm",
            "actor/entropy", "val/acc", "val/response_length")


@dataclass
class Run:
    out: Path
    summary: dict
    rows: list[dict]


@pytest.fixture(scope="module")
def one_rank_hybrid(ray_session, tiny_model, arith_files, tmp_path_factory) -> Run:
    out = tmp_path_factory.mktemp("one-rank-hybrid") / "out"
    summary = Trainer(job(tiny_model, arith_files, out)).fit()
    return Run(out, summary, read(out))


def test_two_steps_write_metrics_and_summary(one_rank_hybrid):
    summary, out = one_rank_hybrid.summary, one_rank_hybrid.out
    assert summary["steps"] == 2
    assert set(summary) >= {"initial_accuracy", "final_accuracy", "steps", "wall_seconds"}
    assert json.loads((out / "summary.json").read_text()) == summary
    records = one_rank_hybrid.rows
    assert [r["step"] for r in records] == [0, 1, 2]
    step = records[1]
    for key in ("reward/score_mean", "reward/acc_mean", "response/length_mean",
                "response/clip_frac", "actor/grad_norm", "actor/lr", "actor/entropy",
                "actor/pg_clipfrac", "adv/tied_groups", "timing/generate", "timing/update",
                "timing/sync_weights", "perf/samples_per_s", "val/acc"):
        assert key in step, key
    assert (out / "config.yaml").is_file()


def assert_same_run(reference: Run, other: list[dict], rel: float, abs: float) -> None:
    assert [r["step"] for r in other] == [r["step"] for r in reference.rows] == [0, 1, 2]
    assert all(r["actor/grad_norm"] > 0 for r in reference.rows[1:])  # not a comparison of no-ops
    for a, b in zip(reference.rows, other):
        for key in COMPARED:
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=rel, abs=abs), (a["step"], key)


def test_two_ranks_train_like_one(one_rank_hybrid, tiny_model, arith_files, tmp_path):
    """gloo, 2 ranks: the same rollouts and a globally normalised loss."""
    Trainer(job(tiny_model, arith_files, tmp_path / "two", "actor.world_size=2")).fit()
    assert_same_run(one_rank_hybrid, read(tmp_path / "two"), rel=1e-4, abs=1e-5)


def test_two_replicas_reproduce_hybrid(one_rank_hybrid, tiny_model, arith_files, tmp_path):
    """Standalone: rollout replicas on their own Ray actors, weights broadcast each step from the
    weight-sync group's leader, exact fp32 transfers."""
    Trainer(job(tiny_model, arith_files, tmp_path / "standalone", "rollout.placement=standalone",
                "rollout.num_replicas=2")).fit()
    standalone = read(tmp_path / "standalone")
    assert_same_run(one_rank_hybrid, standalone, rel=1e-5, abs=1e-6)
    # weights went over the collective, version-stamped, with their bandwidth reported
    step = standalone[2]
    assert step["weight_sync/version"] == 2 and step["weight_sync/bytes"] > 0
    assert step["weight_sync/bytes_per_s"] > 0
