"""The training mesh (polyrl/training/mesh.py): sizes, coordinates and groups, no process group."""

from __future__ import annotations

import pytest

from polyrl.training.config import ActorConfig
from polyrl.training.mesh import MeshError, ParallelDims


def test_data_parallel_only_is_one_group_of_every_rank():
    dims = ParallelDims.from_actor(ActorConfig(world_size=4))
    assert (dims.dp_replicate, dims.dp_shard, dims.sp) == (4, 1, 1)
    assert dims.world_size == dims.data_parallel_size == 4
    assert dims.groups() == [("dp_replicate", (0, 1, 2, 3))]
    assert [dims.data_rank(r) for r in range(4)] == [0, 1, 2, 3]
    assert dims.describe() == "4 ranks: dp_replicate=4"


def test_fsdp2_with_sequence_parallel_lays_sp_groups_on_neighbouring_ranks():
    dims = ParallelDims.from_actor(ActorConfig(world_size=4, strategy="fsdp2", sequence_parallel_size=2))
    assert (dims.dp_replicate, dims.dp_shard, dims.sp, dims.tp) == (1, 2, 2, 1)
    assert dims.data_parallel_size == 2 and dims.world_size == 4
    assert dims.coordinates(3) == {"dp_replicate": 0, "dp_shard": 1, "sp": 1, "tp": 0}
    assert dims.groups() == [("dp_shard", (0, 2)), ("dp_shard", (1, 3)), ("sp", (0, 1)), ("sp", (2, 3))]
    # the batch is sharded over the data axes: both ranks of an sp group train on one shard
    assert [dims.data_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [dims.sequence_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert dims.data_group(1) == (1, 3) and dims.sequence_group(1) == (0, 1)
    assert dims.gradient_group(1) == (0, 1, 2, 3)
    assert dims.describe() == "4 ranks: dp_shard=2 x sp=2"


def test_sequence_and_tensor_parallel_groups_on_four_ranks():
    """dp_shard=1 x sp=2 x tp=2: tp varies fastest, so ranks 0-1 are one tp group (the same
    token slice, different heads), 0 and 2 one sp group (the same tp index: the same heads'
    slices, different tokens), and the gradient groups are the sp groups."""
    import torch
    from engine_ranks import make_batch

    from polyrl.topology.worker_group import PolicyGroup

    dims = ParallelDims.from_actor(ActorConfig(world_size=4, strategy="fsdp2", sequence_parallel_size=2,
                                               tensor_parallel_size=2))
    dims.validate()
    assert (dims.dp_replicate, dims.dp_shard, dims.sp, dims.tp) == (1, 1, 2, 2)
    assert dims.describe() == "4 ranks: sp=2 x tp=2"
    assert dims.groups() == [("sp", (0, 2)), ("sp", (1, 3)), ("tp", (0, 1)), ("tp", (2, 3))]
    assert [dims.sequence_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [dims.data_rank(r) for r in range(4)] == [0, 0, 0, 0] and dims.data_parallel_size == 1
    assert [dims.data_group(r) for r in range(4)] == [(0,), (1,), (2,), (3,)]  # nothing to sum over samples
    # gradients summed over sp (each rank back-propagates its tokens), never over tp (different slices)
    assert [dims.gradient_group(r) for r in range(4)] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [dims.tensor_group(r) for r in range(4)] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert dims.gradient_parallel_size == 2
    # fsdp2's 2-D mesh (training/mesh_groups.py device_mesh): the ranks in order, tp to a row;
    # its columns are the gradient groups, its rows the tp groups
    layout = torch.arange(4).view(-1, dims.tp)
    assert [tuple(c.tolist()) for c in layout.t()] == sorted(set(dims.gradient_group(r) for r in range(4)))
    assert [tuple(row.tolist()) for row in layout] == sorted(set(dims.tensor_group(r) for r in range(4)))
    assert [dims.first_of_shard(r) for r in range(4)] == [True, False, False, False]  # one answer kept

    # with two data shards (8 ranks) the driver hands one shard to the 4 ranks of each data coordinate
    dims8 = ParallelDims.of("fsdp2", 8, sequence_parallel_size=2, tensor_parallel_size=2)
    group = PolicyGroup([object()] * 8, [f"policy-{r}" for r in range(8)], timeout_s=1, mesh=dims8)
    batch = make_batch(1, n=7).replace(group=torch.arange(7))
    shards = [b.group.tolist() for b in group._per_rank(batch)]
    assert shards == [[0, 1, 2, 3]] * 4 + [[4, 5, 6]] * 4
    assert [r for r in range(8) if dims8.first_of_shard(r)] == [0, 4]


def test_coordinates_and_ranks_round_trip_on_every_axis():
    dims = ParallelDims(dp_replicate=2, dp_shard=3, sp=2, tp=2)
    seen = set()
    for r in range(dims.world_size):
        c = dims.coordinates(r)
        assert dims.rank_of(c) == r
        seen.add(tuple(c.values()))
    assert len(seen) == 24
    for axis in ("dp_replicate", "dp_shard", "sp", "tp"):
        groups = dims.groups_along((axis,))
        assert sorted(r for g in groups for r in g) == list(range(24))  # a partition of the ranks
        assert all(len(g) == getattr(dims, axis) for g in groups)
    assert dims.sequence_group(0) == (0, 2)  # tp varies fastest, then sp


def test_a_mesh_that_does_not_fit_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="actor.sequence_parallel_size=3 does not divide actor.world_size=4"):
        ActorConfig(world_size=4, sequence_parallel_size=3)
    with pytest.raises(ValueError, match="actor.packing=auto or on"):
        ActorConfig(world_size=2, sequence_parallel_size=2, packing="off")
    with pytest.raises(MeshError, match="outside the mesh of 2 ranks"):
        ParallelDims(dp_shard=2).coordinates(2)
    ParallelDims(sp=2, tp=2).validate()  # they compose (tests/training/test_tensor_parallel.py)
    with pytest.raises(MeshError, match="hybrid sharding"):
        ParallelDims(dp_replicate=2, dp_shard=2).validate()
    ParallelDims(dp_shard=2, sp=2).validate()
