"""The torch.distributed groups a run forms, planned without starting anything (for the dry run).

Mirrors what the processes build from their `RolePlan`: `PolicyWorker._join_process_groups`
(polyrl/workers/policy.py) and `RolloutWorker.setup` (polyrl/workers/rollout_worker.py) join one
world; where the topology shares it with rollout ranks (disaggregated) it holds the trainer ranks
and every rollout rank (`RankLayout`) and `build_groups` creates every group of the layout;
otherwise the world is the policy ranks alone. The training
engine works on the trainer group: FSDP2 (polyrl/training/fsdp2.py) shards every parameter,
gradient and optimizer state over it as a 1-D `DeviceMesh.from_group` (no replication across
nodes), DDP (polyrl/training/ddp.py) all-reduces its gradients over it. FSDP2 on a device adds a
host (gloo) group over the same ranks for its announce / drain handshake.

Groups of one member are left out: they carry no traffic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from polyrl.platform import Platform
from polyrl.training.mesh import DATA_AXES, ParallelDims



def library_of(platform: Platform, backend: str) -> str:
    """The communication library behind torch's backend name: RCCL on ROCm (reached through
    torch's NCCL backend name), else the backend itself (NCCL, HCCL, GLOO)."""
    if backend == platform.dist_backend() and platform.name == "rocm":
        return "RCCL"
    return backend.upper()


@dataclass(frozen=True)
class GroupPlan:
    kind: str
    """trainer, fsdp2_control, replica, tp, pp, dp, weight_sync (`RankLayout.all_groups` kinds),
    mesh_data, mesh_sp (the training mesh's groups with sequence parallelism)."""
    ranks: tuple[int, ...]
    backend: str
    """torch.distributed backend name (nccl, hccl, gloo)."""
    library: str
    purpose: str
    nodes: tuple[int, ...] = ()
    """Planned nodes of the members, in order (empty without devices)."""

    @property
    def leader(self) -> int:
        """The group's local rank 0 as a global rank (R5: never a literal rank 0)."""
        return self.ranks[0]

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "ranks": list(self.ranks), "leader": self.leader,
                "backend": self.backend, "library": self.library, "nodes": list(self.nodes),
                "purpose": self.purpose}


@dataclass(frozen=True)
class WorldPlan:
    size: int
    backend: str
    library: str
    groups: list[GroupPlan]

    def of_rank(self, rank: int) -> list[GroupPlan]:
        return [g for g in self.groups if rank in g.ranks]

    def as_dict(self) -> dict[str, Any]:
        return {"world_size": self.size, "backend": self.backend, "library": self.library,
                "rendezvous": "policy rank 0's address (torch.distributed init_method)",
                "groups": [g.as_dict() for g in self.groups]}


def plan_world(cfg: Any, platform: Platform, actors: Sequence[Any], mesh: ParallelDims) -> WorldPlan | None:
    """The run's world and groups (None: no process group forms: one policy rank and no
    rollout ranks in its world). `actors`: the launch plan's, for each rank's planned node;
    `mesh`: the policy ranks' training mesh (the plan's, polyrl/topology/run_plan.py)."""
    device = bool(platform.ray_resource)
    backend = platform.dist_backend() if device else platform.cpu_dist_backend()
    library = library_of(platform, backend)
    node_of = {a.rank: a.devices.node for a in actors if a.rank is not None and a.devices}
    layout = next((a.plan.layout for a in actors if a.plan is not None and a.plan.layout is not None), None)
    if layout is not None:  # the topology shares the world with rollout ranks (`RolePlan.layout`)
        kinds, size = layout.all_groups(), layout.world_size
    else:
        size = cfg.actor.world_size
        kinds = [("trainer", tuple(range(size)))]
    if size < 2:
        return None

    def group(kind: str, ranks: tuple[int, ...], purpose: str, on_host: bool = False) -> GroupPlan:
        host = platform.cpu_dist_backend()
        return GroupPlan(kind, ranks, host if on_host else backend, host.upper() if on_host else library,
                         purpose, tuple(node_of[r] for r in ranks if r in node_of))

    groups: list[GroupPlan] = []
    for kind, ranks in kinds:
        if len(ranks) < 2:
            continue
        groups.append(group(kind, ranks, _purpose(kind, cfg, ranks, mesh)))
        if kind == "trainer" and cfg.actor.strategy == "fsdp2" and device:
            groups.append(group("fsdp2_control", ranks, "FSDP2's announce / drain handshake before "
                                "each forward, on the host: no device sync per micro-batch",
                                on_host=True))
        if kind == "trainer":
            groups += [group(k, r, p) for k, r, p in mesh_groups(mesh)]
    return WorldPlan(size, backend, library, groups)


def mesh_groups(dims: ParallelDims) -> list[tuple[str, tuple[int, ...], str]]:
    """(kind, ranks, purpose) of the training mesh's own groups beside the trainer group, exactly
    the ones the engines create: the data, sp, gradient and tp groups with sequence or tensor
    parallelism (polyrl/training/mesh_groups.py), the expert and expert-shard groups with expert
    parallelism (polyrl/training/expert_parallel.py). A group of every trainer rank is the
    trainer group itself, a set of ranks already listed is that same group, and one rank forms
    none, so none of these is listed again. The trainer ranks are
    the world's first ranks in every topology, so a mesh rank is its global rank."""
    seen = {tuple(range(dims.world_size))}

    def listed(kind: str, groups: list[tuple[int, ...]], purpose: str) -> list[tuple[str, tuple[int, ...], str]]:
        # one process group per set of ranks (made once, shared: `_group`): a set already listed
        # under another axis (dp_shard x tp's data and gradient groups) is that same group
        new = [ranks for ranks in groups if len(ranks) > 1 and ranks not in seen]
        seen.update(new)
        return [(kind, ranks, purpose) for ranks in new]

    out = []
    if dims.sequence_parallel or dims.tensor_parallel:
        out += listed("mesh_data", dims.groups_along(DATA_AXES),
                      f"the data axes of the mesh ({dims.describe()}): ranks with different samples, "
                      "whose token counts and metrics are summed")
        out += listed("mesh_sp", dims.groups_along(("sp",)),
                      f"one sequence-parallel group of {dims.sp} ranks: each holds 1/{dims.sp} of every "
                      "packed row's tokens (DeepSpeed-Ulysses all-to-all of heads around attention)")
        out += listed("mesh_gradient", dims.groups_along((*DATA_AXES, "sp")),
                      "every axis but tp: gradients summed and parameters sharded (FSDP2) over it")
        out += listed("mesh_tp", dims.groups_along(("tp",)),
                      f"one tensor-parallel group of {dims.tp} ranks: each holds 1/{dims.tp} of every "
                      "sliced projection and of the vocabulary (DTensor collectives in forward and backward)")
    if dims.ep > 1:
        ranks = range(dims.world_size)
        out += listed("mesh_ep", sorted({dims.expert_group(r) for r in ranks}),
                      f"one expert-parallel group of {dims.ep} ranks: each holds 1/{dims.ep} of every MoE "
                      "layer's experts; tokens go to their experts' rank by all-to-all")
        out += listed("mesh_expert_shard", sorted({dims.expert_shard_group(r) for r in ranks}),
                      "the ranks holding the same experts: FSDP2 shards them and sums their gradients here")
    return out


def _purpose(kind: str, cfg: Any, ranks: tuple[int, ...], dims: ParallelDims) -> str:
    n = len(ranks)
    if kind == "trainer":
        if dims.sequence_parallel:
            return (f"the training mesh ({dims.describe()}): gradients summed over its data and sp "
                    f"axes{' and parameters sharded over them (FSDP2)' if cfg.actor.strategy == 'fsdp2' else ''}")
        if cfg.actor.strategy == "fsdp2":
            return (f"FSDP2 shard group: a 1-D DeviceMesh over the {n} policy ranks; each holds 1/{n} "
                    "of every parameter, gradient and optimizer state; all-gather per layer in "
                    "forward and backward, reduce-scatter of gradients; the reference policy is "
                    "sharded the same way")
        return (f"DDP over the {n} policy ranks: a full model copy each, one flat all-reduce of "
                "the gradients per optimizer step")
    return {
        "replica": f"one rollout replica ({n} ranks): each version reaches its one engine through "
                   f"the replica leader, rank {ranks[0]}",
        "tp": "one tensor-parallel group of a replica",
        "pp": "one pipeline of a replica",
        "dp": "the same position in every replica",
        "weight_sync": f"the trainer's weight-sync leader (rank {ranks[0]}) broadcasts each "
                       f"version to the {n - 1} rollout ranks (shared memory on one host, else "
                       "this backend)",
    }[kind]
