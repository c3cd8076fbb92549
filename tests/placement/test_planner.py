"""The pure placement planner: gangs first-fit on nodes, ids in order, errors that say what fits."""

from __future__ import annotations

import pytest

from polyrl.placement import Devices, Gang, Member, PlacementError, plan_placement


def replica(i: int, tp: int, per_rank: bool = True) -> Gang:
    members = (tuple(Member(f"r{i}.{t}", 1) for t in range(tp)) if per_rank
               else (Member(f"r{i}", tp),))
    return Gang(f"rollout replica {i}", members, "rollout.tensor_parallel_size")


def test_gangs_never_straddle_nodes_and_later_gangs_fill_gaps():
    gangs = [Gang("policy rank 0", (Member("p0", 1),)), replica(0, 4), replica(1, 4),
             Gang("policy rank 1", (Member("p1", 1),))]
    plan = plan_placement(gangs, devices_per_node=8)
    assert {a: (d.node, d.ids) for a, d in plan.assignments.items()} == {
        "p0": (0, (0,)), "r0.0": (0, (1,)), "r0.1": (0, (2,)), "r0.2": (0, (3,)), "r0.3": (0, (4,)),
        "r1.0": (1, (0,)), "r1.1": (1, (1,)), "r1.2": (1, (2,)), "r1.3": (1, (3,)),
        "p1": (0, (5,))}  # first fit: back into node 0's gap
    assert plan.node_actors(0) == ["p0", "r0.0", "r0.1", "r0.2", "r0.3", "p1"]
    assert plan.nodes_used == 2 and plan.devices_needed == 10


def test_actors_without_devices_get_no_place():
    plan = plan_placement([Gang("mailbox", (Member("m", 0),)), replica(0, 2, per_rank=False)], 8)
    assert list(plan.assignments) == ["r0"] and plan.assignments["r0"].ids == (0, 1)


def test_a_gang_larger_than_a_node_names_the_field_and_the_limit():
    with pytest.raises(PlacementError, match=r"rollout replica 0 needs 8 devices on one node "
                                             r"\(rollout.tensor_parallel_size=8\), but a node has 4: "
                                             r"set rollout.tensor_parallel_size to at most 4"):
        plan_placement([replica(0, 8)], devices_per_node=4)


def test_more_devices_than_the_cluster_says_how_many_nodes():
    with pytest.raises(PlacementError, match=r"needs 12 devices on 3 node\(s\) of 4 \(3 rollout "
                                             r"replica x 4\), but the cluster has 2 node\(s\), 8 "
                                             r"devices: use 3 nodes"):
        plan_placement([replica(i, 4) for i in range(3)], devices_per_node=4, nodes=2)
    assert plan_placement([replica(i, 4) for i in range(3)], 4, nodes=3).nodes_used == 3


# --- the reward-model worker (reward.model) in a job's plan ---------------------------------------

def reward_job(*overrides: str):
    from polyrl.config import load_config
    from polyrl.job import JobConfig

    return load_config(JobConfig, overrides=[
        "reward.model.path=/models/rm", "reward.model.num_cpus=3", "actor.world_size=6",
        "data.train_batch_size=12", "actor.num_cpus_per_worker=1", "rollout.max_model_len=64",
        *overrides])


def h100():
    from polyrl.platform import SIMULATED_PROBES, get_platform

    return get_platform("cuda", SIMULATED_PROBES["h100"])


def test_the_reward_worker_gets_its_own_devices_and_counts_in_the_cpus():
    from polyrl.topology.launch_plan import plan_launch
    from polyrl.topology.resources import cpus_needed

    cfg = reward_job("reward.model.num_devices=2")
    plan = plan_launch(cfg, h100(), nodes=1)
    assert plan.errors == []
    reward = plan.actors[-1]
    assert (reward.name, reward.role, reward.rank) == ("reward model worker", "reward", None)
    assert reward.resources == {"num_cpus": 3, "num_gpus": 2} and reward.num_threads == 3
    assert reward.devices == Devices(0, (6, 7))  # beside the 6 policy ranks, never on theirs
    assert {i for a in plan.actors[:-1] for i in a.devices.ids} == set(range(6))
    assert cpus_needed(cfg) == (1, 6 + 3)
    assert cpus_needed(reward_job("reward.model.in_process=true")) == (1, 6)


def test_a_reward_worker_that_does_not_fit_says_what_would():
    from polyrl.topology.launch_plan import plan_launch

    plan = plan_launch(reward_job("reward.model.num_devices=4"), h100(), nodes=1)
    assert plan.errors == [
        "placement: the job needs 10 devices on 2 node(s) of 8 (6 policy rank x 1, 1 reward model "
        "worker x 4), but the cluster has 1 node(s), 8 devices: use 2 nodes (--nodes 2, or a Ray "
        "cluster that large) or shrink the job by 2 device(s) at least (actor.world_size, "
        "rollout.num_replicas, rollout.tensor_parallel_size, reward.model.num_devices)"]
    too_big = plan_launch(reward_job("reward.model.num_devices=16"), h100())
    assert "reward model worker needs 16 devices on one node (reward.model.num_devices=16), but " \
           "a node has 8: set reward.model.num_devices to at most 8" in too_big.placement_error
    half = plan_launch(reward_job("reward.model.num_devices=0.5"), h100())
    assert "reward.model.num_devices=0.5: the placement planner places whole devices" in half.placement_error
    on_cpu = plan_launch(reward_job(), h100(), nodes=1)  # num_devices=0: CPUs only, no place
    assert on_cpu.errors == [] and on_cpu.actors[-1].devices is None
