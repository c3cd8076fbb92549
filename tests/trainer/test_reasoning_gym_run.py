"""reasoning-gym data trains end to end (docs/recipes.md): configs/reasoning_gym_arith.yaml,
shortened, lifts held-out accuracy (its full 40-step curve is in docs/recipes.md), and a task no
recipe uses trains through the same data form."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polyrl.config import load_config
from polyrl.job import JobConfig
from polyrl.trainer.loop import Trainer

pytest.importorskip("reasoning_gym")
pytestmark = pytest.mark.slow

RECIPE = Path(__file__).parents[2] / "configs" / "reasoning_gym_arith.yaml"


def fit(tmp_path, *overrides):
    cfg = load_config(JobConfig, files=[RECIPE], overrides=[
        "trainer.val_every=0", "trainer.progress_bar=false", "logging.plot_at_end=false",
        f"trainer.output_dir={tmp_path}", *overrides])
    summary = Trainer(cfg).fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return summary, [r for r in rows if "actor/loss" in r]


def test_the_recipe_learns_held_out_problems(ray_session, tmp_path):
    summary, rows = fit(tmp_path, "trainer.total_steps=10")
    assert summary["final_accuracy"] - summary["initial_accuracy"] >= 0.2, summary
    assert len(rows) == 10 and all(r["reward/errors"] == 0 for r in rows)


def test_a_task_no_recipe_uses_trains(ray_session, tmp_path):
    spec = "reasoning_gym:number_sequence?size={size}&seed={seed}"
    summary, rows = fit(tmp_path, "trainer.total_steps=2", "data.max_prompt_length=48",
                        f"data.train_files=[{spec.format(size=64, seed=0)}]",
                        f"data.val_files=[{spec.format(size=16, seed=100000)}]")
    assert len(rows) == 2 and all(r["reward/errors"] == 0 for r in rows)
    assert "initial_accuracy" in summary and "final_accuracy" in summary
