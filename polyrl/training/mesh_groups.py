"""The process groups of one rank's mesh (training/mesh.py), as the engines use them.

Without sequence or tensor parallelism the mesh is one data-parallel axis and every group is the
trainer group the worker passed (or the world): nothing is created, so such a run communicates
exactly as before the mesh existed. With either, the data, sp, gradient and tp groups are created with
`dist.new_group(..., use_local_synchronization=True)`: only the members of a group create it, so
ranks outside the trainer (a sync disaggregated world's rollout ranks) take no part. Groups are
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
    tensor: Any = None
    """The tensor-parallel group (training/tensor_parallel.py); None without tensor parallelism."""
    members: tuple[int, ...] = ()
    """The trainer ranks' global ranks, in mesh order (empty on one rank)."""

    def device_mesh(self, device_type: str):
        """fsdp2's mesh: 1-D over the gradient group, or 2-D (gradient axes x tp) under tensor
        parallelism, its dims named `shard` and `tp`. tp is the fastest axis and every other axis
        is a gradient axis, so the trainer ranks in order, `tp` to a row, are that 2-D layout."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        if self.tensor is None:
            return DeviceMesh.from_group(self.gradient, device_type)
        layout = torch.tensor(self.members, dtype=torch.int).view(-1, self.dims.tp)
        return DeviceMesh.from_group([self.gradient, self.tensor], device_type, mesh=layout,
                                     mesh_dim_names=("shard", "tp"))


def mesh_groups(dims: ParallelDims, group: Any = None) -> MeshGroups:
    """This process's groups of `dims`, laid over `group` (the trainer ranks; None: the world)."""
    dims.validate()
    if not dims.sequence_parallel and not dims.tensor_parallel:
        # one axis: the trainer group itself, as the worker passed it
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
        # (a sync disaggregated world's "trainer" group, polyrl/distributed/layout.py)
        return group if list(ranks) == members else _group(ranks)

    # the same order on every rank: data group, sp group, gradient group, tp group
    data = of(dims.data_group(me))
    sequence = (SequenceParallel(of(dims.sequence_group(me)), dims.sp, dims.sequence_rank(me))
                if dims.sequence_parallel else None)
    gradient = of(dims.gradient_group(me))
    tensor = of(dims.tensor_group(me)) if dims.tensor_parallel else None
    return MeshGroups(dims, me, data, gradient, sequence, tensor, tuple(members))


def _group(ranks: tuple[int, ...]):
    key = (id(dist.group.WORLD), *ranks)
    if key not in _made:
        _made[key] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _made[key]
