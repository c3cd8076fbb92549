"""The process groups of one rank's mesh (training/mesh.py), as the engines use them.

Without sequence parallelism the mesh is one data-parallel axis and every group is the trainer
group the worker passed (or the world): nothing is created, so such a run communicates exactly
as before the mesh existed. With it, the data and sp groups are created with
`dist.new_group(..., use_local_synchronization=True)`: only the members of a group create it, so
ranks outside the trainer (a sync standalone world's rollout ranks) take no part. Groups are
made once per process and set of ranks, shared by the policy, reference and critic engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from polyrl.training.mesh import ParallelDims
from polyrl.training.ulysses import SequenceParallel

_made: dict[tuple[int, ...], Any] = {}
"""Groups already created in this process, by their global ranks."""


@dataclass
class MeshGroups:
    dims: ParallelDims
    rank: int
    """This rank's position in the mesh (its index among the trainer ranks)."""
    data: Any
    """Sums over samples (token counts, metrics): the data axes; None on one rank."""
    gradient: Any
    """Gradient sums and fsdp2's shards: the data and sp axes; None on one rank."""
    sequence: SequenceParallel | None
    """The Ulysses group; None without sequence parallelism."""


def mesh_groups(dims: ParallelDims, group: Any = None) -> MeshGroups:
    """This process's groups of `dims`, laid over `group` (the trainer ranks; None: the world)."""
    dims.validate()
    if not dims.sequence_parallel:  # one axis: the trainer group itself, as the worker passed it
        me = dist.get_group_rank(group or dist.group.WORLD, dist.get_rank()) if dims.world_size > 1 else 0
        return MeshGroups(dims, me, group, group, None)
    if not dist.is_initialized():
        raise RuntimeError(f"a mesh of {dims.describe()} but torch.distributed is not initialized")
    members = dist.get_process_group_ranks(group or dist.group.WORLD)
    if len(members) != dims.world_size:
        raise ValueError(f"the mesh ({dims.describe()}) does not match the {len(members)} trainer ranks")
    me = members.index(dist.get_rank())

    def of(mesh_ranks: tuple[int, ...]):
        ranks = tuple(members[r] for r in mesh_ranks)
        # a group of every trainer rank is the trainer group itself: torch (2.13, gloo) hangs
        # creating a locally synchronised group with the ranks of one created by every rank
        # (a sync standalone world's "trainer" group, polyrl/distributed/layout.py)
        return group if list(ranks) == members else _group(ranks)

    # the same order on every rank: data group, then sp group
    data = of(dims.data_group(me))
    sequence = SequenceParallel(of(dims.sequence_group(me)), dims.sp, dims.sequence_rank(me))
    return MeshGroups(dims, me, data, group, sequence)


def _group(ranks: tuple[int, ...]):
    key = (id(dist.group.WORLD), *ranks)
    if key not in _made:
        _made[key] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _made[key]
