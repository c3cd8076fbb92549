"""Where each transport's bytes live on both ends, and which backend carries them: the device
hand-offs of a weight sync, planned for any platform without its hardware.

On a CPU machine every tensor is on cpu and every group is gloo, so a transport whose two ends
disagree (a sender packing on cuda, receivers staging on cpu: NCCL on one side, gloo on the
other, and a hang) looks fine. This table is what a GPU run does, from the same rules the
transports follow:

    in_place                 one process: the engine takes the trainer's tensors on the rank's
                             device; no group
    broadcast, shared memory cpu on both ends (the segment is host memory; only when the ranks'
                             device is the CPU: `shared_memory_possible`)
    broadcast, backend       the rank's device on both ends (`SyncGroup.device`), carried by the
                             group's backend for that device type (`device_backend`: nccl for
                             cuda, hccl for npu, gloo for cpu); control messages on gloo
    object_store             host bytes on both ends (`object_store.HOST`): Ray's object store,
                             no group; an engine on a device copies them in

Both ends of a row always agree; the first broadcast transfer checks it on the live ranks
(`broadcast.py`), and each manifest names the device its buckets were packed on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from polyrl.platform.base import device_backend

if TYPE_CHECKING:
    from polyrl.platform import Platform

NO_GROUP = "none"


@dataclass(frozen=True)
class End:
    device: str
    """The device type the bytes are packed (sender) or staged (receiver) on."""
    backend: str
    """What carries them: a torch.distributed backend, "shared memory", "ray object store" or
    "none" (one process)."""


@dataclass(frozen=True)
class Handoff:
    transport: str
    path: str
    sender: End
    receiver: End

    @property
    def agrees(self) -> bool:
        return self.sender == self.receiver


def shared_memory_possible(device_type: str) -> bool:
    """Whether the broadcast's shared-memory ring can carry bytes packed on `device_type`: host
    memory only (device bytes go through the device backend)."""
    return device_type == "cpu"


def plan_handoffs(platform: "Platform", device_type: str | None = None,
                  transports: tuple[str, ...] = ("in_place", "broadcast", "object_store")) -> list[Handoff]:
    """Every transport's hand-off (of `transports`) for ranks computing on `device_type` devices
    (default: the platform's, what `Platform.claim_device` gives every rank). A type, not a
    device: planning for an NPU needs no torch_npu."""
    kind = device_type or platform.device_type
    wire = device_backend(platform.group_backend(kind), kind)
    rows = []
    if "in_place" in transports:
        rows.append(Handoff("in_place", "engine.update_weights", End(kind, NO_GROUP), End(kind, NO_GROUP)))
    if "broadcast" in transports:
        if shared_memory_possible(kind):
            shm = End("cpu", "shared memory")
            rows.append(Handoff("broadcast", "shared memory", shm, shm))
        rows.append(Handoff("broadcast", "backend", End(kind, wire), End(kind, wire)))
    if "object_store" in transports:
        from polyrl.weights.object_store import HOST  # imports Ray: a run in one process has none

        store = End(HOST.type, "ray object store")
        rows.append(Handoff("object_store", "object store", store, store))
    return rows


def run_handoffs(platform: "Platform", transport: str, shared_memory: bool = True,
                 device_type: str | None = None) -> list[Handoff]:
    """The rows a run of `transport` takes, in the order it tries them (`plan_handoffs`' rows of
    that transport): the broadcast offers its shared-memory ring first where the ring can carry
    the bytes and `weights.shared_memory` is on, and takes the backend row when a receiver cannot
    open it (/dev/shm missing or full, another host)."""
    return [h for h in plan_handoffs(platform, device_type, (transport,))
            if shared_memory or h.path != "shared memory"]
