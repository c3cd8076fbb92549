"""The weight-transport contract: `send(named_tensors, version)` on the trainer, `receive(engine)`
on each rollout rank, and the registry of transports.

Every transfer is version-stamped, and a receiver applies a version all or nothing: tensors are
staged until every bucket has arrived and the sender has committed, then handed to the engine in
one `engine.update_weights(named_tensors, version)` call. A transfer that fails midway leaves the
previous weights serving.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Protocol, runtime_checkable

import torch

from polyrl.registry import Registry

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class WeightSyncError(RuntimeError):
    """A transfer that was not applied; the receiving engine keeps its previous weights."""


@dataclass(frozen=True)
class TransferStats:
    transport: str
    version: int
    num_tensors: int
    num_buckets: int
    bytes: int
    seconds: float

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")

    def metrics(self, prefix: str = "weight_sync/") -> dict[str, float]:
        return {f"{prefix}bytes": float(self.bytes), f"{prefix}seconds": self.seconds,
                f"{prefix}bytes_per_s": self.bytes_per_s, f"{prefix}version": float(self.version)}


@runtime_checkable
class WeightTransport(Protocol):
    name: str

    def send(self, named_tensors: NamedTensors, version: int) -> TransferStats:
        """Trainer side: deliver `named_tensors` (Hugging Face names) stamped `version`."""
        ...

    def receive(self, engine: Any) -> int:
        """Rollout side: wait for the next transfer, apply it to `engine` all or nothing, and
        return the version now served."""
        ...


WEIGHT_TRANSPORTS: Registry[type] = Registry("weight transport")
WEIGHT_TRANSPORTS.register("in_place", "polyrl.weights.in_place:InPlaceTransport")
WEIGHT_TRANSPORTS.register("broadcast", "polyrl.weights.broadcast:BroadcastTransport")
WEIGHT_TRANSPORTS.register("object_store", "polyrl.weights.object_store:ObjectStoreTransport")


def build_transport(config: Any, placement: str = "hybrid", **context: Any) -> WeightTransport:
    """The transport `config` (a WeightSyncConfig) selects under `placement`.

    Context by transport: in_place(engine=...), broadcast(group=..., watchdog=None, device=None),
    object_store(mailbox=...).
    """
    cls = WEIGHT_TRANSPORTS.get(config.resolve(placement))
    return cls(config, **context)


def named_items(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    seen: set[str] = set()
    for name, tensor in items:
        if name in seen:
            raise WeightSyncError(f"tensor '{name}' appears twice in one weight transfer")
        if not isinstance(tensor, torch.Tensor):
            raise WeightSyncError(f"'{name}' is a {type(tensor).__name__}, not a tensor")
        seen.add(name)
    return items
