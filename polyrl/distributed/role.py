"""The typed plan each policy, rollout or teacher actor is handed: what it does in its run.

The launch plan (polyrl/topology/launch_plan.py:plan_launch) builds one `RolePlan` per policy
rank, rollout actor and disaggregated distillation teacher rank from the run's topology
(polyrl/distributed/topologies.py) and starts the actor with it; the workers
(polyrl/workers/policy.py, rollout_worker.py, streaming_replica.py, teacher.py) act on it and
never read `rollout.placement` or `trainer.mode`. A policy rank's plan carries its training mesh
(`mesh`, `mesh_coordinates`). `polyrl train --dry-run` prints the same plans. Pure data: it pickles into a Ray actor and is compared in tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polyrl.distributed.layout import RankLayout


@dataclass(frozen=True)
class EngineLaunch:
    """The rollout engine an actor starts: its arguments, or why they cannot be built."""

    backend: str
    args: dict[str, Any] | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": self.backend}
        out.update({"error": self.error} if self.error else {"args": self.args})
        return out


@dataclass(frozen=True)
class RolePlan:
    topology: str
    """colocated, disaggregated or streaming (what the actor's run is)."""
    role: str
    """policy (a training rank), rollout (a replica's rank, or a whole streaming replica) or
    teacher (a rank of a distillation teacher on its own actors, polyrl/workers/teacher.py)."""
    index: int
    """The policy rank (0 .. actor.world_size - 1), the rollout replica or the teacher rank."""
    num_threads: int
    """torch threads (equal to the actor's CPU reservation)."""
    rank: int | None
    """Global torch.distributed rank (None: the actor joins no process group); a teacher
    rank's is in the teacher ranks' own world."""
    world_size: int
    """Ranks of the world it joins (1: none forms)."""
    layout: RankLayout | None
    """The world's layout when rollout ranks share it (disaggregated: trainer ranks, then every
    replica's); None: the world is the policy ranks alone (or none)."""
    groups: tuple[str, ...]
    """Kinds of the layout's groups this rank is a member of (`RankLayout.all_groups`); every
    rank of a world still takes part in creating every group."""
    hosts_engine: bool
    """Builds a rollout engine in its process (a colocated policy rank, a replica leader, a
    streaming replica)."""
    colocated_engine: bool
    """That engine shares the policy rank's device and weights: filled from the trainer's
    model in place, asleep while training (engine launch arguments follow: sleep mode)."""
    engine_seed: int | None
    """The engine's sampling seed (None: hosts no engine)."""
    transport: str
    """The run's weight transport, resolved (in_place, broadcast, object_store)."""
    sends_weights: bool
    """(policy) this rank sends each version over the transport: every colocated rank into its
    own engine, else the weight-sync leader (R5) or, without a shared world, policy rank 0."""
    background_publish: bool
    """The object-store sender publishes off the trainer's path (streaming only)."""
    on_policy: bool
    """Every batch comes from the trainer's current weights (False: bounded staleness)."""
    max_staleness: int
    """Most versions a trained sample may lag (0 when on-policy)."""
    engine: EngineLaunch | None = None
    """The engine's launch arguments as the dry run shows them (None: hosts no engine)."""
    holds_teacher: bool = False
    """The distillation teacher is loaded in this actor: a policy rank under
    distill.placement=colocated (beside the policy, frozen), or a teacher rank
    (`polyrl.distributed.topologies.teacher_placement_of`)."""
    mesh: Any = None
    """(policy, teacher) the mesh of the ranks it trains or scores with (a `ParallelDims`,
    polyrl/training/mesh.py), planned once (polyrl/topology/run_plan.py): the driver shards each
    batch over it and the rank's training engines are laid out by it; None for rollout actors."""

    @property
    def mesh_coordinates(self) -> dict[str, int] | None:
        """(policy, teacher) {axis: index} of this rank in its mesh (None: no mesh)."""
        return self.mesh.coordinates(self.index) if self.mesh is not None else None

    def weights_config(self, weights: Any) -> Any:
        """`weights` (a WeightSyncConfig) with this plan's transport and publish mode."""
        return weights.model_copy(update={"transport": self.transport,
                                          "background_publish": self.background_publish})

    def as_dict(self) -> dict[str, Any]:
        return {"topology": self.topology, "role": self.role, "index": self.index, "rank": self.rank,
                "world_size": self.world_size, "groups": list(self.groups),
                "hosts_engine": self.hosts_engine, "colocated_engine": self.colocated_engine,
                "engine_seed": self.engine_seed, "transport": self.transport,
                "sends_weights": self.sends_weights, "background_publish": self.background_publish,
                "on_policy": self.on_policy, "max_staleness": self.max_staleness,
                "holds_teacher": self.holds_teacher,
                "mesh": self.mesh.describe() if self.mesh is not None else None,
                "mesh_coordinates": self.mesh_coordinates}
