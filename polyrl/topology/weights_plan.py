"""The run's weight hand-off as planned: who sends each policy version, who receives it, and on
both ends the device the bytes are packed or staged on and the backend that carries them.

The rows come from `run_handoffs` (polyrl/weights/handoff.py), the table written from the rules
the transports themselves follow (`shared_memory_possible`, `device_backend`), for the run's
transport only; the ends' names and the weight-sync group come from the launch plan. On a CPU
machine every row reads cpu / gloo, so `polyrl train --dry-run --platform h100` is where a GPU
run's hand-off (cuda on both ends, nccl) is seen before it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polyrl.platform.base import device_backend
from polyrl.topology.launch_plan import LaunchPlan
from polyrl.topology.process_groups import GroupPlan
from polyrl.weights.handoff import Handoff, run_handoffs


@dataclass(frozen=True)
class WeightsPlan:
    transport: str
    senders: tuple[str, ...]
    """The actors that send each version (`RolePlan.sends_weights`)."""
    receivers: tuple[str, ...]
    """What takes it in: a colocated rank's own engine, or the rollout actors."""
    handoffs: tuple[Handoff, ...]
    """The rows the transport takes, in the order it tries them."""
    group: GroupPlan | None = None
    """The weight-sync process group (broadcast), None for a transport without one."""
    control: str | None = None
    """The backend of the broadcast's control messages (offer, votes, manifest, commit)."""
    via: str | None = None
    """The actor the bytes pass through (object_store: the weight mailbox)."""

    def as_dict(self) -> dict[str, Any]:
        return {"transport": self.transport, "senders": list(self.senders),
                "receivers": list(self.receivers),
                "handoffs": [{"path": h.path,
                              "sender": {"device": h.sender.device, "backend": h.sender.backend},
                              "receiver": {"device": h.receiver.device, "backend": h.receiver.backend}}
                             for h in self.handoffs],
                "group": ({"kind": self.group.kind, "ranks": list(self.group.ranks),
                           "leader": self.group.leader, "backend": self.group.backend,
                           "library": self.group.library}
                          if self.group else None),
                "control": self.control, "via": self.via}

    def lines(self) -> list[str]:
        """One line per row, as the dry run prints them (`weights: in_place engine.update_weights
        cuda -> cuda`)."""
        out = []
        for i, h in enumerate(self.handoffs):
            order = "" if len(self.handoffs) == 1 else (" (first)" if i == 0 else " (else)")
            wire = "" if h.sender.backend == "none" else f" over {h.sender.backend}"
            line = (f"{self.transport} {h.path}{order}: {h.sender.device} -> {h.receiver.device}{wire}, "
                    f"{_names(self.senders)} -> {_names(self.receivers)}")
            if self.via:
                line += f" through the {self.via}"
            if h.path == "backend" and self.group is not None:
                g = self.group
                line += (f"; group {g.kind} of ranks {', '.join(map(str, g.ranks))} (leader {g.leader}, "
                         f"{g.library}), control messages over {self.control}")
            out.append(line)
        return out


def _names(names: tuple[str, ...]) -> str:
    return ", ".join(names) if len(names) < 4 else f"{names[0]} ... {names[-1]} ({len(names)})"


def plan_weights(launch: LaunchPlan, shared_memory: bool) -> WeightsPlan:
    """The hand-off of the run `launch` plans; `shared_memory`: weights.shared_memory."""
    planned = [a for a in launch.actors if a.plan is not None and a.role in ("policy", "rollout")]
    transport = planned[0].plan.transport
    senders = tuple(a.name for a in planned if a.role == "policy" and a.plan.sends_weights)
    platform, kind = launch.platform, launch.platform.device_type
    rows = tuple(run_handoffs(platform, transport, shared_memory))
    if transport == "in_place":  # every colocated rank into the engine in its own process
        return WeightsPlan(transport, senders, tuple(f"{s}'s engine" for s in senders), rows)
    receivers = tuple(a.name for a in planned if a.role == "rollout")
    if transport == "object_store":
        via = next((a.name for a in launch.actors if a.role == "mailbox"), None)
        return WeightsPlan(transport, senders, receivers, rows, via=via)
    group = next((g for g in launch.world.groups if g.kind == "weight_sync"), None) if launch.world else None
    return WeightsPlan(transport, senders, receivers, rows, group,
                       control=device_backend(platform.group_backend(kind), "cpu"))
