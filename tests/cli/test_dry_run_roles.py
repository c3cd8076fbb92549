"""`polyrl train --dry-run` shows what the launch decides: the topology, each actor's role plan
(the `RolePlan` it is started with) and the training mesh's groups."""

from __future__ import annotations

import json

from polyrl.cli.main import main


def plan(capsys, *args: str) -> dict:
    assert main(["train", "--dry-run", "--json", "actor.num_cpus_per_worker=1", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_shows_the_topology_and_each_actors_plan(capsys):
    p = plan(capsys, "rollout.placement=standalone", "trainer.mode=async", "rollout.num_replicas=2",
             "async.max_staleness=3")
    assert p["topology"] == {"name": "streaming", "colocated_engine": False, "rollout_actors": "replicas",
                             "transports": ["object_store"], "on_policy": False}
    assert p["placement"]["topology"] == "streaming" and p["placement"]["mode"] == "async"
    policy, replica0, replica1, mailbox = p["actors"]
    assert policy["plan"]["sends_weights"] and policy["plan"]["transport"] == "object_store"
    assert [r["plan"]["max_staleness"] for r in (replica0, replica1)] == [3, 3]
    assert replica1["plan"]["rank"] is None and replica1["plan"]["engine_seed"] == 1000
    assert mailbox["plan"] is None


def test_the_training_mesh_groups_are_shown_with_sequence_parallelism(capsys):
    p = plan(capsys, "actor.world_size=4", "actor.sequence_parallel_size=2", "actor.strategy=fsdp2",
             "data.train_batch_size=8")
    assert p["placement"]["training_mesh"] == "4 ranks: dp_shard=2 x sp=2"
    groups = [(g["kind"], g["ranks"]) for g in p["process_groups"]["groups"]]
    assert groups == [("trainer", [0, 1, 2, 3]), ("mesh_data", [0, 2]), ("mesh_data", [1, 3]),
                      ("mesh_sp", [0, 1]), ("mesh_sp", [2, 3])]
    assert main(["train", "--dry-run", "actor.world_size=4", "actor.sequence_parallel_size=2",
                 "actor.strategy=fsdp2", "data.train_batch_size=8", "actor.num_cpus_per_worker=1"]) == 0
    text = capsys.readouterr().out
    assert "training mesh 4 ranks: dp_shard=2 x sp=2" in text and "mesh_sp: ranks 2, 3" in text


def test_the_tree_says_what_each_actor_does(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # one tree line per entry
    assert main(["train", "--dry-run", "rollout.placement=standalone", "actor.world_size=2",
                 "actor.num_cpus_per_worker=1"]) == 0
    text = capsys.readouterr().out
    assert "topology: disaggregated, on-policy (generate, then train); weights travel broadcast" in text
    assert "does: trains; sends each weight version (broadcast); in a world of 3 ranks" in text
    assert "does: trains; in a world of 3 ranks" in text  # rank 1: not the weight-sync leader
    assert "does: hosts its replica's rollout engine; receives each weight version (broadcast)" in text


def test_tensor_and_expert_parallel_groups_are_the_ones_the_engines_create(capsys):
    """Under tp the engines create the data and tp groups (polyrl/training/mesh_groups.py), under
    ep the expert and expert-shard groups (polyrl/training/expert_parallel.py): the dry run lists
    each set of ranks once, the whole trainer set being the trainer group itself."""
    from polyrl.topology.process_groups import mesh_groups
    from polyrl.training.mesh import ParallelDims

    p = plan(capsys, "actor.world_size=4", "actor.tensor_parallel_size=2", "actor.strategy=fsdp2",
             "data.train_batch_size=8")
    assert p["placement"]["training_mesh"] == "4 ranks: dp_shard=2 x tp=2"
    groups = [(g["kind"], g["ranks"]) for g in p["process_groups"]["groups"]]
    # dp_shard x tp: each data group is also its gradient group (one process group)
    assert groups == [("trainer", [0, 1, 2, 3]), ("mesh_data", [0, 2]), ("mesh_data", [1, 3]),
                      ("mesh_tp", [0, 1]), ("mesh_tp", [2, 3])]

    def kinds(dims):
        return [(kind, ranks) for kind, ranks, _ in mesh_groups(dims)]

    assert kinds(ParallelDims.of("fsdp2", 8, 2, 2)) == [
        ("mesh_data", (0, 4)), ("mesh_data", (1, 5)), ("mesh_data", (2, 6)), ("mesh_data", (3, 7)),
        ("mesh_sp", (0, 2)), ("mesh_sp", (1, 3)), ("mesh_sp", (4, 6)), ("mesh_sp", (5, 7)),
        ("mesh_gradient", (0, 2, 4, 6)), ("mesh_gradient", (1, 3, 5, 7)),
        ("mesh_tp", (0, 1)), ("mesh_tp", (2, 3)), ("mesh_tp", (4, 5)), ("mesh_tp", (6, 7))]
    assert kinds(ParallelDims.of("fsdp2", 4, expert_parallel_size=2)) == [
        ("mesh_ep", (0, 1)), ("mesh_ep", (2, 3)), ("mesh_expert_shard", (0, 2)), ("mesh_expert_shard", (1, 3))]
    assert kinds(ParallelDims.of("fsdp2", 2, expert_parallel_size=2)) == []  # the trainer group itself
    assert kinds(ParallelDims.of("fsdp2", 4)) == []  # one axis: the trainer group alone
