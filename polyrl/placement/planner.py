"""Where every device-holding actor of a job goes: a node and device ids, planned as pure data.

The job is a list of gangs. A gang is actors that must share one node: a tensor-parallel rollout
replica (its engine's TP workers talk over the node's NVLink / xGMI / HCCS), or the policy ranks
whose colocated engines form one TP group in colocated placement. A lone actor is a gang of one.
Gangs are placed first-fit, in job order, on nodes of `devices_per_node` devices; device ids on a
node are handed out in placement order. So the policy ranks fill node 0 from device 0, replicas
follow, and a gang never straddles two nodes.

Ray enforces the plan (`polyrl/placement/ray_groups.py`): one STRICT_PACK placement group per
planned node, one bundle per actor in plan order. Ray fixes each bundle's devices when it
reserves the group, lowest free ids first in bundle order, so on a node nobody else uses the ids
Ray hands out are the planned ones (`tests/placement/test_simulated_cluster.py` checks this).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence


class PlacementError(ValueError):
    """A layout that cannot exist on the cluster; the message says what fits."""


@dataclass(frozen=True)
class Member:
    actor: str
    """The actor's name as the run names it ("policy rank 0", "rollout replica 1 (rank 3)")."""
    devices: int
    """Devices the actor reserves (0: none; it gets no place in the plan)."""


@dataclass(frozen=True)
class Gang:
    """Actors that must sit on one node."""

    name: str
    members: tuple[Member, ...]
    size_field: str = ""
    """The config field that sets the gang's size, named in errors ("rollout.tensor_parallel_size")."""

    @property
    def devices(self) -> int:
        return sum(m.devices for m in self.members)


@dataclass(frozen=True)
class Devices:
    """One actor's place: a planned node and the device ids it holds there."""

    node: int
    ids: tuple[int, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"node": self.node, "ids": list(self.ids)}


@dataclass
class PlacementPlan:
    devices_per_node: int
    nodes_available: int | None
    """Nodes of the cluster (None: as many as the job needs)."""
    gangs: list[Gang]
    assignments: dict[str, Devices] = field(default_factory=dict)
    """Actor name -> its place, for every actor that reserves devices."""

    @property
    def nodes_used(self) -> int:
        return 1 + max((d.node for d in self.assignments.values()), default=0)

    @property
    def devices_needed(self) -> int:
        return sum(g.devices for g in self.gangs)

    def node_actors(self, node: int) -> list[str]:
        """The actors planned on `node`, in device order (= bundle order of its placement group)."""
        on_node = [(d.ids[0], name) for name, d in self.assignments.items() if d.node == node]
        return [name for _, name in sorted(on_node)]

    def as_dict(self) -> dict[str, Any]:
        return {"devices_per_node": self.devices_per_node, "nodes": self.nodes_used,
                "nodes_available": self.nodes_available, "needed": self.devices_needed,
                "gangs": [{"name": g.name, "node": self._gang_node(g),
                           "ids": [i for m in g.members if m.devices
                                   for i in self.assignments[m.actor].ids]}
                          for g in self.gangs if g.devices]}

    def _gang_node(self, gang: Gang) -> int:
        return next(self.assignments[m.actor].node for m in gang.members if m.devices)


def plan_placement(gangs: Sequence[Gang], devices_per_node: int,
                   nodes: int | None = None) -> PlacementPlan:
    """Place `gangs` first-fit on nodes of `devices_per_node` devices (at most `nodes` nodes)."""
    if devices_per_node < 1:
        raise PlacementError(f"nodes need at least one device to place devices on, got {devices_per_node}")
    plan = PlacementPlan(devices_per_node, nodes, list(gangs))
    free: list[int] = []  # free devices per node, nodes opened as needed
    for gang in gangs:
        if not gang.devices:
            continue
        _check_fits_a_node(gang, devices_per_node)
        node = next((n for n, left in enumerate(free) if left >= gang.devices), None)
        if node is None:
            free.append(devices_per_node)
            node = len(free) - 1
        first = devices_per_node - free[node]
        for m in gang.members:
            if m.devices:
                plan.assignments[m.actor] = Devices(node, tuple(range(first, first + m.devices)))
                first += m.devices
        free[node] -= gang.devices
    if nodes is not None and len(free) > nodes:
        raise PlacementError(_too_big(plan, len(free), nodes))
    return plan


def _check_fits_a_node(gang: Gang, per_node: int) -> None:
    if gang.devices <= per_node:
        return
    field_text = f" ({gang.size_field}={gang.devices})" if gang.size_field else ""
    fix = (f"set {gang.size_field} to at most {per_node}" if gang.size_field
           else f"give it at most {per_node} devices")
    raise PlacementError(f"{gang.name} needs {gang.devices} devices on one node{field_text}, but a "
                         f"node has {per_node}: {fix} (a divisor of {per_node} packs nodes fully)")


def _too_big(plan: PlacementPlan, needed_nodes: int, nodes: int) -> str:
    per = plan.devices_per_node
    return (f"the job needs {plan.devices_needed} devices on {needed_nodes} node(s) of {per} "
            f"({_breakdown(plan.gangs)}), but the cluster has {nodes} node(s), {nodes * per} "
            f"devices: use {needed_nodes} nodes (--nodes {needed_nodes}, or a Ray cluster that "
            f"large) or shrink the job by {plan.devices_needed - nodes * per} device(s) at least "
            f"({', '.join(_size_fields(plan.gangs))})")


def _size_fields(gangs: Sequence[Gang]) -> list[str]:
    fields = ["actor.world_size", "rollout.num_replicas", "rollout.tensor_parallel_size"]
    return fields + sorted({g.size_field for g in gangs if g.devices and g.size_field and g.size_field not in fields})


def _breakdown(gangs: Sequence[Gang]) -> str:
    counts: dict[tuple[str, int], int] = {}
    for g in gangs:
        if g.devices:
            kind = g.name.rsplit(" ", 1)[0] if g.name[-1:].isdigit() else g.name
            counts[(kind, g.devices)] = counts.get((kind, g.devices), 0) + 1
    return ", ".join(f"{n} {kind} x {d}" for (kind, d), n in counts.items())
