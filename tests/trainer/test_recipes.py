"""Each algorithm and training mode a user picks by config learns the embedded task end to end
(the bundled tiny model on the bundled arithmetic task, a few steps): PPO with a critic (GAE),
GSPO, DAPO's dynamic sampling with overlong shaping, LoRA. The numbers each reaches in a full run
are in docs/algorithms.md."""

from __future__ import annotations

import json

import pytest

from polyrl.cli.train import EMBEDDED_DEFAULT
from polyrl.config import load_config
from polyrl.job import JobConfig
from polyrl.trainer.loop import Trainer

pytestmark = pytest.mark.slow


def run(tmp_path, *overrides, steps=4):
    cfg = load_config(JobConfig, files=[EMBEDDED_DEFAULT], overrides=[
        f"trainer.total_steps={steps}", "trainer.val_every=0", "trainer.progress_bar=false",
        "logging.plot_at_end=false", f"trainer.output_dir={tmp_path}", *overrides])
    summary = Trainer(cfg).fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return summary, [r for r in rows if "actor/loss" in r or "critic/value_loss" in r]


def test_ppo_with_a_critic_learns(ray_session, tmp_path):
    summary, rows = run(tmp_path, "algorithm.adv_estimator=gae", "critic.enable=true",
                        "critic.lr=1e-3", "algorithm.lam=0.95")
    assert summary["final_accuracy"] - summary["initial_accuracy"] >= 0.2, summary
    for key in ("critic/value_loss", "critic/explained_variance", "critic/vf_clipfrac"):
        assert key in rows[0], key
    assert rows[-1]["critic/value_loss"] < rows[0]["critic/value_loss"]
    assert (tmp_path / "checkpoints" / "step_000004" / "critic" / "policy").is_dir()


def test_critic_warm_up_freezes_the_policy(ray_session, tmp_path):
    _, rows = run(tmp_path, "algorithm.adv_estimator=gae", "critic.enable=true",
                  "critic.warmup_steps=1", steps=2)
    assert rows[0].get("critic/warmup") == 1.0 and "actor/loss" not in rows[0]
    assert "actor/loss" in rows[1]


def test_gspo_learns(ray_session, tmp_path):
    summary, rows = run(tmp_path, "algorithm.policy_loss=gspo", "algorithm.loss_agg_mode=seq-mean-token-mean")
    assert summary["final_accuracy"] - summary["initial_accuracy"] >= 0.2, summary


def test_dapo_fills_every_batch_with_informative_groups(ray_session, tmp_path):
    summary, rows = run(tmp_path, "algorithm.dynamic_sampling=true", "algorithm.clip_ratio_high=0.28",
                        "algorithm.overlong.shaping=true", "algorithm.overlong.buffer_length=2",
                        "rollout.response_length=6")
    for r in rows:
        assert r["adv/informative_groups"] + r["dynamic_sampling/shortfall_groups"] == 16
        assert r["dynamic_sampling/rounds"] >= 1
        assert "reward/overlong_penalty_mean" in r
    assert summary["final_accuracy"] - summary["initial_accuracy"] >= 0.2, summary


def test_lora_learns_with_its_defaults(ray_session, tmp_path):
    summary, _ = run(tmp_path, "model.lora_rank=8")
    assert summary["final_accuracy"] - summary["initial_accuracy"] >= 0.2, summary
    assert (tmp_path / "checkpoints" / "step_000004" / "policy_adapter").is_dir()
