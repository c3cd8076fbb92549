"""Standalone placement: rollout replicas on their own Ray actors, weights broadcast each step
from the weight-sync group's leader. (That a standalone run reproduces the hybrid run step by
step: tests/trainer/test_reference_run.py.)"""

from __future__ import annotations

import pytest

import len_reward_job
from len_reward_job import read
from polyrl.config import load_config
from polyrl.job import JobConfig
from polyrl.trainer.loop import Trainer


def job(tiny_model, arith_files, out, *overrides):
    return len_reward_job.job(tiny_model, arith_files, out, *overrides, steps=3, val_every=3)


def test_standalone_embedded_default_learns(ray_session, tmp_path):
    from polyrl.cli.train import EMBEDDED_DEFAULT

    cfg = load_config(JobConfig, files=[EMBEDDED_DEFAULT], overrides=[
        "rollout.placement=standalone", "trainer.progress_bar=false", "trainer.save_at_end=false",
        "actor.num_cpus_per_worker=1", f"trainer.output_dir={tmp_path}"])
    summary = Trainer(cfg).fit()
    assert summary["final_accuracy"] - summary["initial_accuracy"] >= 0.30, summary


def test_tensor_parallel_native_is_refused(ray_session, tiny_model, arith_files, tmp_path):
    from polyrl.trainer.loop import TrainingError

    with pytest.raises(TrainingError, match="tensor_parallel_size > 1 needs a GPU engine"):
        Trainer(job(tiny_model, arith_files, tmp_path / "o", "rollout.placement=standalone",
                    "rollout.tensor_parallel_size=2")).fit()


def test_sync_standalone_over_the_object_store(ray_session, tiny_model, arith_files, tmp_path):
    # the transport async mode uses, in a synchronous run: every replica gets every version
    Trainer(job(tiny_model, arith_files, tmp_path / "store", "rollout.placement=standalone",
                "weights.transport=object_store", "trainer.total_steps=2", "data.val_files=[]",
                "trainer.val_before_train=false")).fit()
    steps = [r for r in read(tmp_path / "store") if "actor/loss" in r]
    assert [r["weight_sync/version"] for r in steps] == [1, 2]
    assert all(r["weight_sync/bytes"] > 0 for r in steps)


@pytest.mark.slow
def test_a_two_rank_replica_generates_on_its_leader_and_takes_weights_through_it(
        ray_session, tiny_model, arith_files, tmp_path):
    """The production launch of a TP-2 standalone replica (DisaggregatedTopology, real Ray actors,
    the built-in engine standing in for a TP engine, which `polyrl train` refuses for it): only the
    replica leader generates, and a published version reaches its engine from both ranks."""
    from polyrl.data.dataset import PromptSample
    from polyrl.platform import get_platform
    from polyrl.rollout.base import SamplingParams
    from polyrl.topology import TopologyContext, build_topology
    from polyrl.topology.run_plan import resolve

    cfg = job(tiny_model, arith_files, tmp_path / "o", "rollout.placement=standalone",
              "rollout.tensor_parallel_size=2", "rollout.max_model_len=64")
    topology = build_topology(TopologyContext(resolve(cfg, None, get_platform(cfg.platform)), None, None, None))
    try:
        topology.start()
        assert topology.engines.names == ["rollout replica 0 (rank 1)"]
        assert topology.rollout.names == ["rollout replica 0 (rank 1)", "rollout replica 0 (rank 2)"]
        topology.publish(bump=True)
        leader, other = topology.rollout.call("push_stats", phase="stats")
        assert leader["rounds"] >= 1 and other["rounds"] == 0 and leader["partial"]
        assert leader["tensors"] > 0 and other["tensors"] > 0  # each rank sends its share
        rows = [PromptSample(i, "arith", [5, 6, 7 + i], "x", "x", "1") for i in range(2)]
        batch = topology.generate(rows, SamplingParams(temperature=0.0, max_tokens=3), [0, 1], "validate")
        assert batch.weight_version.tolist() == [1, 1]
        assert topology.rollout.call("health", phase="health")[1]["weight_version"] == 1
    finally:
        topology.shutdown()
