"""Rank layout as plain data: replicas, ranks inside replicas, groups and their leaders."""

from __future__ import annotations

import pytest

from polyrl.distributed.layout import GROUP_KINDS, LayoutError, RankLayout


def test_two_replicas_of_two_ranks_with_a_trainer():
    layout = RankLayout(num_replicas=2, tensor_parallel_size=2, trainer_world_size=1)
    assert layout.world_size == 5 and layout.ranks_per_replica == 2
    assert layout.replica_ranks(0) == [1, 2] and layout.replica_ranks(1) == [3, 4]
    info = layout.rank_info(4)
    assert (info.role, info.replica, info.local_rank, info.tp_rank, info.pp_rank) == ("rollout", 1, 1, 1, 0)
    assert info.groups["replica"] == (3, 4)
    # The replica (exclude-DP) leader of replica 1 is global rank 3, not 0 (R5).
    assert info.leaders["replica"] == 3 and not info.is_replica_leader
    assert layout.rank_info(3).is_replica_leader
    assert info.groups["dp"] == (2, 4) and info.leaders["dp"] == 2
    assert info.groups["weight_sync"] == (0, 1, 2, 3, 4) and info.leaders["weight_sync"] == 0
    trainer = layout.rank_info(0)
    assert trainer.role == "trainer" and trainer.replica is None
    assert set(trainer.groups) == {"trainer", "weight_sync"}


def test_tp_and_pp_groups():
    layout = RankLayout(num_replicas=2, tensor_parallel_size=2, pipeline_parallel_size=2, trainer_world_size=2)
    # replica 1 starts at 2 + 4; stage 1, tensor rank 1 is its last rank.
    assert layout.rollout_rank(1, tp_rank=1, pp_rank=1) == 9
    info = layout.rank_info(9)
    assert info.groups["tp"] == (8, 9) and info.groups["pp"] == (7, 9)
    assert info.groups["replica"] == (6, 7, 8, 9) and info.leaders["replica"] == 6
    assert info.groups["dp"] == (5, 9)
    assert layout.weight_sync_ranks() == [0, *range(2, 10)]


def test_every_rank_is_in_exactly_one_group_of_each_kind():
    layout = RankLayout(num_replicas=3, tensor_parallel_size=2, pipeline_parallel_size=2, trainer_world_size=2)
    for kind in GROUP_KINDS:
        members = [r for k, group in layout.all_groups() if k == kind for r in group]
        assert len(members) == len(set(members)), kind
    rollout = set(layout.rollout_ranks())
    for kind in ("replica", "tp", "pp", "dp"):
        assert {r for k, g in layout.all_groups() if k == kind for r in g} == rollout
    for kind, group in layout.all_groups():
        assert list(group) == sorted(group)  # torch sorts members: local rank 0 = smallest


def test_no_trainer_in_the_world_means_no_sync_group():
    layout = RankLayout(num_replicas=2, tensor_parallel_size=2)
    assert layout.weight_sync_ranks() == []
    assert "weight_sync" not in layout.rank_info(0).groups
    assert layout.rank_info(2).leaders["replica"] == 2


def test_bad_layouts_name_the_problem():
    with pytest.raises(LayoutError, match="num_replicas"):
        RankLayout(num_replicas=0)
    with pytest.raises(LayoutError, match="outside the world"):
        RankLayout(num_replicas=1).rank_info(1)
    with pytest.raises(LayoutError, match="no rollout rank"):
        RankLayout(num_replicas=1).rollout_rank(1)
