"""The GRPO loop end to end on real Ray actors with a tiny random model (seconds per run). The
plain 2-step run, its metrics and summary: tests/trainer/test_reference_run.py."""

from __future__ import annotations

import json

import pytest

from polyrl.config import load_config
from polyrl.job import JobConfig
from polyrl.trainer.loop import Trainer


def job(tiny_model, arith_files, out, *overrides):
    return load_config(JobConfig, overrides=[
        f"model.path={tiny_model}",
        f"data.train_files=[{arith_files['train']}]",
        f"data.val_files=[{arith_files['val']}]",
        "data.train_batch_size=4", "rollout.n=4", "rollout.response_length=6",
        "trainer.total_steps=2", "trainer.val_every=1", "trainer.progress_bar=false",
        f"trainer.output_dir={out}", *overrides])


def length_reward(tmp_path):
    """A user reward function (path.py:function) that varies within groups, so GRPO has signal."""
    path = tmp_path / "my_reward.py"
    path.write_text("def score(solution_str, ground_truth, extra_info=None):\n"
                    "    return len(solution_str) / 10\n")
    return f"reward.custom_function={path}:score"


def test_kl_loss_uses_reference_and_reports_kl(ray_session, tiny_model, arith_files, tmp_path):
    Trainer(job(tiny_model, arith_files, tmp_path, "algorithm.use_kl_loss=true",
                "algorithm.kl_coef=0.1", "actor.lr=0.01", length_reward(tmp_path))).fit()
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[1]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # step 1: policy == ref
    assert records[2]["actor/kl_loss"] > 0  # after one update the policy has moved
    assert "timing/reference" in records[1]


def test_async_mode_needs_disaggregated_placement(tiny_model, arith_files, tmp_path):
    from polyrl.config import ConfigError

    with pytest.raises(ConfigError, match="trainer.mode=async needs rollout.placement=disaggregated"):
        job(tiny_model, arith_files, tmp_path, "trainer.mode=async")


def test_tensor_parallelism_is_refused_by_what_the_engine_declares(tiny_model, arith_files, tmp_path, monkeypatch):
    """A plugin engine that declares no tensor_parallel is refused as the built-in engine is, by
    Trainer.setup before anything starts (was: by the name `native` only, so a plugin reached
    the pre-flight, which refuses it as a ConfigError). One that declares it passes here (and in
    the launch arguments: tests/rollout/test_engine_capabilities.py, pending)."""
    from polyrl.trainer.loop import TrainingError

    (tmp_path / "tp_plugin_engines.py").write_text(
        "from polyrl.backends import EngineCapabilities\n"
        "from polyrl.rollout.native.engine import NativeEngine\n\n"
        "class OneRank(NativeEngine):\n    pass\n\n"
        "class Sharded(NativeEngine):\n    capabilities = EngineCapabilities(tensor_parallel=True)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    tp = ("rollout.placement=standalone", "rollout.tensor_parallel_size=2")
    with pytest.raises(TrainingError, match="the tp_plugin_engines:OneRank engine runs one rank per replica"):
        Trainer(job(tiny_model, arith_files, tmp_path / "a", "rollout.backend=tp_plugin_engines:OneRank", *tp)).setup()
