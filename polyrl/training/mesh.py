"""The training ranks as a device mesh: named axes, computed without any process group.

Modelled on torchtitan's `ParallelDims`: the policy's `actor.world_size` ranks are laid out
row-major over the axes below (outermost first, the last axis varies fastest, so the ranks of a
sequence-parallel group are neighbours: on one node when ranks are packed by node):

    dp_replicate  data parallel, full replica per rank (actor.strategy=ddp)
    dp_shard      data parallel, parameters sharded over its ranks (actor.strategy=fsdp2)
    sp            sequence parallel (DeepSpeed-Ulysses, training/ulysses.py): the ranks of one
                  group hold the same samples, each a 1/sp slice of every packed row's tokens
    tp            tensor parallel (actor.tensor_parallel_size, actor.strategy=fsdp2;
                  training/tensor_parallel.py): the ranks of one group hold the same samples
                  and each a 1/tp slice of every projection, and of the vocabulary

`ep` (expert parallel, actor.expert_parallel_size; training/expert_parallel.py) is no axis of its
own: it subdivides dp_shard (torchtitan's and verl's layout). dp_shard index d = efsdp * ep + e:
the ep ranks of one expert group (same efsdp and sp, every e) train different samples and split
each MoE layer's experts; FSDP2 shards the non-expert parameters over all gradient ranks as before
and each rank's experts over its `expert_shard_group` (same e, every efsdp and sp).

Which ranks do what:

* The *data* axes (dp_replicate, dp_shard) shard the batch: the driver hands rank r the shard
  `data_rank(r)` of `data_parallel_size`, the same shard to every rank of one sp group
  (polyrl/topology/worker_group.py), and keeps one answer per sp group.
* Sums over samples (token counts, metrics) run over the data axes only: the ranks of one sp
  group already hold the same, gathered, values (`data_group`).
* Gradients are summed over the data *and* sp axes (`gradient_group`; torchtitan's
  dp_shard_cp): each rank of an sp group back-propagates only its own tokens' share.
* The tp axis is in neither: a tp group's ranks hold different slices of one parameter, whose
  gradients DTensor already completes inside the forward / backward (`tensor_group`). fsdp2
  shards each slice further over the gradient axes: a 2-D mesh (gradient axes x tp).
* sp and tp compose: the tp ranks of one (data, sp) coordinate hold the same samples and the
  same slice of tokens, and each one's Ulysses all-to-all (over its own sp group, the ranks with
  the same tp index) splits the H/tp heads that rank holds, so the heads must divide by sp x tp
  (training/ulysses.py `check_heads`).

The module is pure arithmetic, so the dry run shows the groups without starting anything; the
engines turn them into process groups (training/mesh_groups.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

AXES = ("dp_replicate", "dp_shard", "sp", "tp")
"""Mesh axes, outermost first (ranks are numbered row-major: `tp` varies fastest)."""
DATA_AXES = ("dp_replicate", "dp_shard")
"""The axes over which the batch is sharded."""


class MeshError(ValueError):
    """A mesh that does not fit the ranks or is not implemented; the message names the key."""


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    sp: int = 1
    tp: int = 1
    ep: int = 1
    """Expert parallel: a divisor of dp_shard (see the module doc), not a factor of the world."""

    def __post_init__(self):
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise MeshError(f"mesh axis {axis}={getattr(self, axis)}: every axis needs at least 1 rank")
        if self.ep < 1 or self.dp_shard % self.ep:
            raise MeshError(f"actor.expert_parallel_size={self.ep} does not divide the {self.dp_shard} data-sharding "
                            "ranks (it splits fsdp2's data-parallel ranks); set it to a divisor of "
                            "actor.world_size / (sequence x tensor parallel size)")

    @classmethod
    def from_actor(cls, actor) -> "ParallelDims":
        """The mesh of an `ActorConfig` (or a critic's copy of it): `world_size` ranks,
        `sequence_parallel_size` per sp group, the rest data parallel, replicated (ddp) or
        sharded (fsdp2)."""
        return cls.of(actor.strategy, actor.world_size, getattr(actor, "sequence_parallel_size", 1),
                      getattr(actor, "tensor_parallel_size", 1), getattr(actor, "expert_parallel_size", 1))

    @classmethod
    def of(cls, strategy: str, world_size: int, sequence_parallel_size: int = 1,
           tensor_parallel_size: int = 1, expert_parallel_size: int = 1) -> "ParallelDims":
        sp, tp, ep = sequence_parallel_size, tensor_parallel_size, expert_parallel_size
        if ep > 1 and strategy != "fsdp2":
            raise MeshError(f"actor.expert_parallel_size={ep} needs actor.strategy=fsdp2 ({strategy} keeps every "
                            "expert on every rank); set actor.strategy=fsdp2")
        if tp > 1 and strategy != "fsdp2":
            raise MeshError(f"actor.tensor_parallel_size={tp} needs actor.strategy=fsdp2 ({strategy} keeps whole "
                            "parameters on every rank); set actor.strategy=fsdp2")
        if world_size % sp:
            raise MeshError(f"actor.sequence_parallel_size={sp} does not divide actor.world_size={world_size}: "
                            f"set actor.world_size to a multiple of {sp}")
        if world_size % (sp * tp):
            raise MeshError(f"actor.tensor_parallel_size={tp} x actor.sequence_parallel_size={sp} does not divide "
                            f"actor.world_size={world_size}: set actor.world_size to a multiple of {sp * tp}")
        dp = world_size // (sp * tp)
        if strategy == "fsdp2":
            return cls(dp_shard=dp, sp=sp, tp=tp, ep=ep)
        return cls(dp_replicate=dp, sp=sp, tp=tp)

    # --- sizes ----------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, axis) for axis in AXES)

    @property
    def world_size(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def data_parallel_size(self) -> int:
        """Shards of the batch: ranks with different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def gradient_parallel_size(self) -> int:
        """Ranks whose gradients are summed (and over which fsdp2 shards): all but the tp axis."""
        return self.world_size // self.tp

    @property
    def sequence_parallel(self) -> bool:
        return self.sp > 1

    @property
    def tensor_parallel(self) -> bool:
        return self.tp > 1

    # --- coordinates and groups -----------------------------------------------------------------
    def coordinates(self, rank: int) -> dict[str, int]:
        """{axis: index} of `rank` (its position in the policy's ranks, 0-based)."""
        if not 0 <= rank < self.world_size:
            raise MeshError(f"rank {rank} is outside the mesh of {self.world_size} ranks ({self.describe()})")
        coords, rest = {}, rank
        for axis, size in reversed(list(zip(AXES, self.shape))):
            coords[axis] = rest % size
            rest //= size
        return {axis: coords[axis] for axis in AXES}

    def rank_of(self, coordinates: dict[str, int]) -> int:
        rank = 0
        for axis, size in zip(AXES, self.shape):
            rank = rank * size + coordinates.get(axis, 0)
        return rank

    def data_rank(self, rank: int) -> int:
        """Which batch shard `rank` trains on (0 .. data_parallel_size - 1)."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def sequence_rank(self, rank: int) -> int:
        """`rank`'s slice of each packed row's tokens (0 .. sp - 1)."""
        return self.coordinates(rank)["sp"]

    def first_of_shard(self, rank: int) -> bool:
        """Whether `rank` is the first of the ranks that train on its batch shard (the ranks of
        its sp and tp groups, which all answer with the same gathered result): the one answer
        the driver keeps."""
        c = self.coordinates(rank)
        return c["sp"] == 0 and c["tp"] == 0

    def group_of(self, rank: int, axes: tuple[str, ...]) -> tuple[int, ...]:
        """The ranks that differ from `rank` only along `axes` (`rank` included), ascending."""
        c = self.coordinates(rank)
        free = [range(getattr(self, a)) if a in axes else (c[a],) for a in AXES]
        return tuple(sorted(self.rank_of(dict(zip(AXES, point))) for point in product(*free)))

    def groups_along(self, axes: tuple[str, ...]) -> list[tuple[int, ...]]:
        """Every group along `axes`, in order of their lowest rank (each rank in exactly one)."""
        return sorted({self.group_of(r, axes) for r in range(self.world_size)})

    def data_group(self, rank: int) -> tuple[int, ...]:
        """Ranks whose samples differ and whose sums combine (metrics, token counts)."""
        return self.group_of(rank, DATA_AXES)

    def sequence_group(self, rank: int) -> tuple[int, ...]:
        """Ranks that split one row's tokens (the Ulysses all-to-all)."""
        return self.group_of(rank, ("sp",))

    def gradient_group(self, rank: int) -> tuple[int, ...]:
        """Ranks whose gradients are summed (and over which fsdp2 shards): data and sp axes."""
        return self.group_of(rank, (*DATA_AXES, "sp"))

    def tensor_group(self, rank: int) -> tuple[int, ...]:
        """Ranks that hold the slices of one parameter (neighbours: tp varies fastest)."""
        return self.group_of(rank, ("tp",))

    def expert_group(self, rank: int) -> tuple[int, ...]:
        """Ranks that split one MoE layer's experts (the all-to-all): the ep neighbours along dp_shard."""
        c = self.coordinates(rank)
        base = c["dp_shard"] - c["dp_shard"] % self.ep
        return tuple(self.rank_of({**c, "dp_shard": base + e}) for e in range(self.ep))

    def expert_shard_group(self, rank: int) -> tuple[int, ...]:
        """Ranks that hold the same experts, over which fsdp2 shards them: the same ep index, every
        efsdp index and every sp rank (an sp group's ranks route their own slices of the same
        rows, so the experts' gradients are summed over sp as every other parameter's)."""
        c = self.coordinates(rank)
        return tuple(sorted(self.rank_of({**c, "dp_shard": d, "sp": s})
                            for d in range(c["dp_shard"] % self.ep, self.dp_shard, self.ep) for s in range(self.sp)))

    def groups(self) -> list[tuple[str, tuple[int, ...]]]:
        """(axis, member ranks) of every group of every axis with more than one rank, outermost
        axis first: what the dry run shows."""
        out = []
        for axis, size in zip(AXES, self.shape):
            if size > 1:
                out.extend((axis, members) for members in self.groups_along((axis,)))
        if self.ep > 1:
            out.extend(("ep", members) for members in sorted({self.expert_group(r) for r in range(self.world_size)}))
        return out

    def validate(self) -> None:
        """Refuse what the engines do not implement, with the key to change."""
        if self.tp > 1 and self.dp_replicate > 1:
            raise MeshError(f"actor.tensor_parallel_size={self.tp} needs actor.strategy=fsdp2 (ddp replicates whole "
                            "parameters, tp slices them); set actor.strategy=fsdp2")
        if self.ep > 1 and self.tp > 1:
            raise MeshError(f"actor.expert_parallel_size={self.ep} with actor.tensor_parallel_size={self.tp} is not "
                            "implemented; set one of them to 1")
        if self.dp_replicate > 1 and self.dp_shard > 1:
            raise MeshError(f"hybrid sharding (dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard}) "
                            "is not implemented; use actor.strategy=ddp or fsdp2 over all data ranks")

    def describe(self) -> str:
        """One line: the axes with more than one rank, e.g. `4 ranks: dp_shard=2 x sp=2`."""
        axes = [f"{axis}={size}" for axis, size in zip(AXES, self.shape) if size > 1]
        if self.ep > 1:
            axes.append(f"ep={self.ep} (within dp_shard)")
        return f"{self.world_size} rank{'s' if self.world_size != 1 else ''}: " + (" x ".join(axes) or "single")


def check_actor(actor) -> None:
    """The mesh's checks on an `ActorConfig` (divisibility, what the engines implement), run by
    the job schema's validation so a layout that cannot be built is one line before Ray starts;
    the planner lays the run's mesh out with the same rule (polyrl/topology/run_plan.py)."""
    ParallelDims.from_actor(actor).validate()


def unplanned_mesh(actor, world_size: int) -> ParallelDims:
    """The mesh of a training engine built outside a run (`polyrl sft`, a test, a benchmark):
    `world_size` ranks laid out by the config's rule. A run's engines never come here: the
    workers hand them the plan's (`RolePlan.mesh`). Expert parallelism splits a group of ranks,
    so one rank alone holds every expert (ep is 1 there)."""
    ep = getattr(actor, "expert_parallel_size", 1) if world_size > 1 else 1
    return ParallelDims.of(actor.strategy, world_size, getattr(actor, "sequence_parallel_size", 1),
                           getattr(actor, "tensor_parallel_size", 1), ep)
