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
    with pytest.raises(MeshError, match="actor.tensor_parallel_size=2 with actor.sequence_parallel_size=2"):
        ParallelDims(sp=2, tp=2).validate()
    with pytest.raises(MeshError, match="hybrid sharding"):
        ParallelDims(dp_replicate=2, dp_shard=2).validate()
    ParallelDims(dp_shard=2, sp=2).validate()
