"""The run's plan (polyrl/topology/run_plan.py): computed once, pure and frozen, before Ray; the
dry run prints it and `Trainer.start` launches it."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import yaml

from polyrl.cli.train import EMBEDDED_DEFAULT
from polyrl.config import load_config, to_yaml
from polyrl.job import JobConfig
from polyrl.platform import get_platform
from polyrl.topology.run_plan import RunData, resolve
from polyrl.training.mesh import ParallelDims


def job(*overrides: str) -> JobConfig:
    return load_config(JobConfig, overrides=["actor.num_cpus_per_worker=1", *overrides])


def test_resolve_fills_the_config_in_and_every_policy_rank_carries_the_one_mesh():
    cfg = job("actor.strategy=fsdp2", "actor.world_size=4", "actor.sequence_parallel_size=2",
              "rollout.response_length=6", "trainer.total_epochs=3")
    assert cfg.rollout.max_model_len is None and cfg.trainer.total_steps is None
    plan = resolve(cfg, RunData(longest_prompt=10, batches_per_epoch=5), get_platform("cpu"))
    # what Trainer.setup once changed after validation is in the plan: the engine launches with it
    assert plan.cfg.rollout.max_model_len == 16 and plan.total_steps == 15
    engines = [a.engine for a in plan.launch.actors if a.engine is not None]
    assert engines and all(e.args["max_model_len"] == 16 for e in engines)
    assert not any("max_model_len is unset" in n for n in plan.launch.notes)
    assert plan.mesh == ParallelDims(dp_shard=2, sp=2)
    policy = plan.roles("policy")
    assert [r.mesh for r in policy] == [plan.mesh] * 4  # the same object, not rebuilt per rank
    assert all(r.mesh is plan.mesh for r in policy)
    assert [r.mesh_coordinates["sp"] for r in policy] == [0, 1, 0, 1]
    assert [r.mesh_coordinates["dp_shard"] for r in policy] == [0, 0, 1, 1]
    assert [r.as_dict()["mesh_coordinates"] for r in policy] == [plan.mesh.coordinates(i) for i in range(4)]
    assert {g.ranks for g in plan.launch.world.groups if g.kind == "mesh_sp"} == {(0, 1), (2, 3)}
    # frozen: nothing downstream edits the plan it was handed
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.total_steps = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.launch.actors = ()
    # pure: the same input gives the same plan, and the input config is not changed
    assert resolve(cfg, RunData(10, 5), get_platform("cpu")).as_dict() == plan.as_dict()
    assert cfg.rollout.max_model_len is None


def test_a_standalone_teachers_ranks_carry_their_own_mesh():
    plan = resolve(job("distill.teacher=builtin:tiny-arith", "distill.placement=standalone",
                       "distill.world_size=2", "distill.strategy=fsdp2", "rollout.max_model_len=64"),
                   None, get_platform("cpu"))
    teacher = plan.roles("teacher")
    assert [r.mesh for r in teacher] == [ParallelDims(dp_shard=2)] * 2 and teacher[0].mesh is teacher[1].mesh
    assert [r.mesh_coordinates["dp_shard"] for r in teacher] == [0, 1]
    assert plan.mesh == ParallelDims() and all(r.mesh is None for r in plan.roles("rollout"))
    # where the teacher is held is part of each actor's plan (distill.placement is read once)
    assert all(r.holds_teacher for r in teacher) and not any(r.holds_teacher for r in plan.roles("policy"))
    colocated = resolve(job("distill.teacher=builtin:tiny-arith", "actor.world_size=2",
                            "rollout.max_model_len=64"), None, get_platform("cpu"))
    assert [r.holds_teacher for r in colocated.roles("policy")] == [True, True]
    assert not colocated.roles("teacher")
    assert not any(r.holds_teacher for r in resolve(job("rollout.max_model_len=64"), None).roles("policy"))


def test_without_data_an_unset_max_model_len_stays_unset_and_the_notes_say_so():
    plan = resolve(job("trainer.total_steps=2"), None, get_platform("cpu"))
    assert plan.cfg.rollout.max_model_len is None and plan.total_steps == 2
    assert any("max_model_len is unset" in n for n in plan.launch.notes)
    filled = resolve(job("trainer.total_steps=2", "rollout.max_model_len=64"), RunData(500, 1))
    assert filled.cfg.rollout.max_model_len == 64  # a set value is the user's


@pytest.mark.slow  # loads the bundled model and starts its engine (in this process, no Ray)
def test_the_dry_run_prints_the_in_process_plan_that_start_runs(tmp_path, capsys, monkeypatch):
    """ray.enabled=false: what `--dry-run --json` prints is the in-process plan (polyrl/topology/
    local_plan.py) `Trainer.start` runs, and the run does what it says: the worker object built
    from its role plan, the threads, the device, the variables set in this process."""
    import torch

    from polyrl.cli.main import main
    from polyrl.trainer.loop import Trainer
    from polyrl.workers.policy import PolicyWorker

    overrides = ["ray.enabled=false", f"trainer.output_dir={tmp_path}", "trainer.total_steps=1",
                 "actor.num_cpus_per_worker=1"]
    assert main(["train", "--dry-run", "--json", *overrides]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed.pop("dry_run") is True
    # the dry run loaded the bundled data as the run does: max_model_len is filled in
    assert printed["config"]["rollout"]["max_model_len"] is not None
    assert printed["in_process"] is True and "job" not in printed and "actors" not in printed

    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)  # set by the plan, for the run only
    threads = torch.get_num_threads()
    trainer = Trainer(load_config(JobConfig, files=[EMBEDDED_DEFAULT], overrides=overrides))
    try:
        trainer.setup()
        plan, local = trainer.plan, trainer.topology.launch.local
        assert local.run is plan  # the start ran the in-process plan of the run's plan
        assert json.loads(json.dumps(local.as_dict(), default=str)) == printed
        # start launched exactly that plan: its worker, role plan, mesh, config and environment
        assert trainer.topology.launch.actors == list(plan.launch.actors)
        (worker,) = trainer.policy.workers
        (planned,) = local.workers
        assert type(worker.worker).__name__ == planned.cls == PolicyWorker.__name__
        assert worker.worker.role is planned.plan is plan.roles("policy")[0]
        assert str(worker.worker.device) == planned.device
        assert torch.get_num_threads() == planned.num_threads  # set for the whole process
        assert {k: os.environ.get(k) for k in planned.env.values()} == planned.env.values()
        assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
        assert worker.worker.cfg is plan.cfg and trainer.cfg is plan.cfg
        assert trainer.policy.mesh is plan.mesh  # the driver shards over the plan's mesh
        assert worker.worker.engine.mesh.dims is plan.mesh  # and the rank's engine is laid out by it
        assert worker.worker.transport is not None and local.weights.transport == plan.cfg.weight_transport
        assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == yaml.safe_load(to_yaml(plan.cfg))
    finally:
        trainer.shutdown()
        torch.set_num_threads(threads)
    assert "TOKENIZERS_PARALLELISM" not in os.environ  # the caller's environment is back


def test_a_ray_runs_dry_run_prints_its_plan_and_weight_handoff(capsys):
    """With Ray (the default) `--dry-run --json` prints `RunPlan.as_dict()` of the plan `resolve`
    gives the run, plus the weight hand-off planned from it (`plan_weights`)."""
    from polyrl.cli.main import main
    from polyrl.topology.weights_plan import plan_weights

    overrides = ["actor.num_cpus_per_worker=1", "rollout.max_model_len=64", "trainer.total_steps=2",
                 "rollout.placement=disaggregated"]
    assert main(["train", "--dry-run", "--json", *overrides]) == 0
    printed = json.loads(capsys.readouterr().out)
    plan = resolve(load_config(JobConfig, files=[EMBEDDED_DEFAULT], overrides=overrides), None)
    weights = plan_weights(plan.launch, plan.cfg.weights.shared_memory).as_dict()
    expected = {"dry_run": True, **plan.as_dict(), "weights": weights}
    assert printed == json.loads(json.dumps(expected, default=str))
    assert printed["weights"]["transport"] == "broadcast"
