"""The pure placement planner: gangs first-fit on nodes, ids in order, errors that say what fits."""

from __future__ import annotations

import pytest

from polyrl.placement import Gang, Member, PlacementError, plan_placement


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
