"""Rank layout for disaggregated placement: trainer ranks, then N rollout replicas of TP x PP ranks.

Everything a rank needs to know about where it sits is computed here, as plain data, so the
layout can be checked without processes: its replica, its rank inside the replica, the member
lists of each of its groups and each group's leader.

The leader of a group is the group's local rank 0 mapped to a global rank. Never "rank 0": with
several replicas, global rank 0 leads only the first one, and a broadcast from it hangs every
other replica (R5 in docs/architecture.md, verl PR 5701). `torch.distributed.new_group` sorts its members,
so local rank 0 is the smallest member; `build_groups` checks that against
`dist.get_global_rank(group, 0)` on the real groups.

Global rank order (trainer_world_size=T, ranks_per_replica=R = TP x PP):

    0 .. T-1                        trainer
    T + r*R + pp*TP + tp            rollout replica r, pipeline stage pp, tensor rank tp

Group kinds:

    trainer      every trainer rank
    replica      the ranks of one rollout replica (verl's "exclude-DP" group)
    tp           one replica, one pipeline stage
    pp           one replica, one tensor rank
    dp           the same (tp, pp) position in every replica
    weight_sync  the trainer leader plus every rollout rank (weights flow leader -> replicas)
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Literal

import torch.distributed as dist

GROUP_KINDS = ("trainer", "replica", "tp", "pp", "dp", "weight_sync")


class LayoutError(ValueError):
    """A layout that cannot exist (bad sizes, a rank outside the world)."""


@dataclass(frozen=True)
class RankInfo:
    """Where one global rank sits. Rollout-only fields are None on trainer ranks."""

    rank: int
    role: Literal["trainer", "rollout"]
    replica: int | None
    """Rollout replica index."""
    local_rank: int | None
    """Rank inside the replica (0 .. TP*PP-1)."""
    tp_rank: int | None
    pp_rank: int | None
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Member global ranks of each group this rank belongs to, by kind."""

    @property
    def leaders(self) -> dict[str, int]:
        """Each group's leader as a global rank: its local rank 0, the smallest member."""
        return {kind: members[0] for kind, members in self.groups.items()}

    @property
    def is_replica_leader(self) -> bool:
        return self.role == "rollout" and self.local_rank == 0


@dataclass(frozen=True)
class RankLayout:
    num_replicas: int
    """Rollout replicas (data-parallel copies of the rollout engine)."""
    tensor_parallel_size: int = 1
    """Tensor-parallel ranks per pipeline stage of one replica."""
    pipeline_parallel_size: int = 1
    """Pipeline stages per replica."""
    trainer_world_size: int = 0
    """Trainer ranks, placed first in the global order (0 when the trainer is not in the world)."""

    def __post_init__(self) -> None:
        for name in ("num_replicas", "tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.trainer_world_size < 0:
            raise LayoutError(f"trainer_world_size must be >= 0, got {self.trainer_world_size}")

    # --- sizes -------------------------------------------------------------------------------
    @property
    def ranks_per_replica(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def num_rollout_ranks(self) -> int:
        return self.num_replicas * self.ranks_per_replica

    @property
    def world_size(self) -> int:
        return self.trainer_world_size + self.num_rollout_ranks

    # --- rank arithmetic ---------------------------------------------------------------------
    def trainer_ranks(self) -> list[int]:
        return list(range(self.trainer_world_size))

    def rollout_ranks(self) -> list[int]:
        return list(range(self.trainer_world_size, self.world_size))

    def rollout_rank(self, replica: int, tp_rank: int = 0, pp_rank: int = 0) -> int:
        """Global rank of (replica, pp stage, tensor rank)."""
        if not (0 <= replica < self.num_replicas and 0 <= tp_rank < self.tensor_parallel_size
                and 0 <= pp_rank < self.pipeline_parallel_size):
            raise LayoutError(f"no rollout rank (replica={replica}, tp={tp_rank}, pp={pp_rank}) in {self}")
        return (self.trainer_world_size + replica * self.ranks_per_replica
                + pp_rank * self.tensor_parallel_size + tp_rank)

    def replica_ranks(self, replica: int) -> list[int]:
        first = self.rollout_rank(replica)
        return list(range(first, first + self.ranks_per_replica))

    def replica_leader(self, replica: int) -> int:
        return self.replica_ranks(replica)[0]

    def weight_sync_ranks(self) -> list[int]:
        """Trainer leader + every rollout rank (empty without trainer ranks in the world)."""
        if self.trainer_world_size == 0:
            return []
        return [0, *self.rollout_ranks()]

    # --- groups ------------------------------------------------------------------------------
    def all_groups(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every group of the layout as (kind, sorted members), in one fixed order.

        `dist.new_group` must be called by every rank for every group in the same order; this
        list is that order.
        """
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        out: list[tuple[str, tuple[int, ...]]] = []
        if self.trainer_world_size:
            out.append(("trainer", tuple(self.trainer_ranks())))
        for r in range(self.num_replicas):
            out.append(("replica", tuple(self.replica_ranks(r))))
        for r in range(self.num_replicas):
            for p in range(pp):
                out.append(("tp", tuple(self.rollout_rank(r, t, p) for t in range(tp))))
        for r in range(self.num_replicas):
            for t in range(tp):
                out.append(("pp", tuple(self.rollout_rank(r, t, p) for p in range(pp))))
        for p in range(pp):
            for t in range(tp):
                out.append(("dp", tuple(self.rollout_rank(r, t, p) for r in range(self.num_replicas))))
        if self.trainer_world_size:
            out.append(("weight_sync", tuple(self.weight_sync_ranks())))
        return out

    def rank_info(self, rank: int) -> RankInfo:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside the world of {self.world_size} ranks ({self})")
        groups = {kind: members for kind, members in self.all_groups() if rank in members}
        if rank < self.trainer_world_size:
            return RankInfo(rank, "trainer", None, None, None, None, groups)
        offset = rank - self.trainer_world_size
        replica, local = divmod(offset, self.ranks_per_replica)
        pp_rank, tp_rank = divmod(local, self.tensor_parallel_size)
        return RankInfo(rank, "rollout", replica, local, tp_rank, pp_rank, groups)

    def describe(self) -> str:
        lines = [f"{self.world_size} ranks: {self.trainer_world_size} trainer + {self.num_replicas} "
                 f"replica(s) x TP {self.tensor_parallel_size} x PP {self.pipeline_parallel_size}"]
        for kind, members in self.all_groups():
            lines.append(f"  {kind:<11} leader {members[0]:>3}  members {list(members)}")
        return "\n".join(lines)


@dataclass
class RankGroups:
    """The live process groups of one rank, with leaders read from torch."""

    info: RankInfo
    groups: dict[str, Any]
    """Kind -> torch ProcessGroup, for the groups this rank belongs to."""
    leaders: dict[str, int]
    """Kind -> leader global rank, from `dist.get_global_rank(group, 0)`."""

    def group(self, kind: str) -> Any:
        if kind not in self.groups:
            raise LayoutError(f"rank {self.info.rank} ({self.info.role}) is in no '{kind}' group; "
                              f"its groups: {', '.join(self.groups) or 'none'}")
        return self.groups[kind]

    def leader(self, kind: str) -> int:
        self.group(kind)
        return self.leaders[kind]


def group_leader(group: Any) -> int:
    """Global rank of the group's local rank 0: the only correct source for a group broadcast."""
    return dist.get_global_rank(group, 0)


def build_groups(layout: RankLayout, rank: int | None = None, *, backend: str,
                 timeout_s: float | None = None) -> RankGroups:
    """Create every group of `layout` (collective: all ranks call it) and keep this rank's.

    `backend` comes from the platform (`get_platform(...).dist_backend()`); `timeout_s` is the
    backend's own deadline per collective, a backstop behind the watchdog's named timeouts.
    """
    rank = dist.get_rank() if rank is None else rank
    if dist.get_world_size() != layout.world_size:
        raise LayoutError(f"the process group has {dist.get_world_size()} ranks but the layout needs "
                          f"{layout.world_size}: {layout.describe().splitlines()[0]}")
    info = layout.rank_info(rank)
    kwargs: dict[str, Any] = {"backend": backend}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    groups: dict[str, Any] = {}
    for kind, members in layout.all_groups():
        group = dist.new_group(list(members), **kwargs)  # every rank, same order
        if rank in members:
            groups[kind] = group
    leaders = {kind: group_leader(g) for kind, g in groups.items()}
    for kind, leader in leaders.items():
        if leader != info.leaders[kind]:  # torch changed its member ordering: fail loudly
            raise LayoutError(f"group '{kind}' of rank {rank}: torch says leader {leader}, "
                              f"layout says {info.leaders[kind]}")
    return RankGroups(info, groups, leaders)
