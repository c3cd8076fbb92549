"""The weight-transport contract: `send(named_tensors, version)` on the trainer, `receive(engine)`
on each rollout rank, and the registry of transports.

What is sent is best a `WeightStream`: the tensors' specs up front, the tensors themselves one at
a time (an FSDP2 engine gathers each from its shards as it is asked for it), so the sender plans
its buckets before the first tensor exists and holds at most the bucket in flight. A tensor
bigger than a bucket may come in row slices (`TensorSpec.pieces`, planned by `row_pieces` from
its shape alone): the sender then never holds it whole, and every receiver assembles it before
the engine sees it, so engines get whole Hugging Face tensors either way.

Every transfer is version-stamped, and a receiver applies a version all or nothing: tensors are
staged until every bucket has arrived and the sender has committed, then handed to the engine in
one `engine.update_weights(named_tensors, version)` call. A transfer that fails midway leaves the
previous weights serving.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import torch

from polyrl.distributed.topologies import TopologySpec
from polyrl.registry import Registry


class WeightSyncError(RuntimeError):
    """A transfer that was not applied; the receiving engine keeps its previous weights."""


@dataclass(frozen=True)
class TensorSpec:
    """What a tensor of a transfer will be, known before it exists."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[int, ...] = ()
    """Row boundaries (0, r1, ..., shape[0]) when the producer yields the tensor as the dim-0
    slices [0:r1], [r1:r2], ... one after another (`row_pieces`); empty: it comes whole."""

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize

    def piece_shapes(self) -> list[tuple[int, ...]]:
        """The shape of each item the producer yields for this tensor (one when whole)."""
        if not self.pieces:
            return [self.shape]
        return [(b - a, *self.shape[1:]) for a, b in zip(self.pieces, self.pieces[1:])]


def row_pieces(shape: Sequence[int], dtype: torch.dtype, max_bytes: int) -> tuple[int, ...]:
    """Row boundaries cutting a tensor of `shape` into dim-0 slices of at most `max_bytes` each
    (as even as rows allow; a slice is at least one row), or () when it fits `max_bytes` whole.
    A pure function of the spec, so every rank of a gather plans the same slices."""
    rows = int(shape[0]) if len(shape) else 0
    row_bytes = _numel(shape[1:]) * dtype.itemsize
    if rows < 2 or rows * row_bytes <= max_bytes:
        return ()
    count = min(rows, -(-rows * row_bytes // max(max_bytes, 1)))
    return tuple(rows * i // count for i in range(count + 1))


def _check_pieces(spec: TensorSpec) -> None:
    p = spec.pieces
    if p and (not spec.shape or p[0] != 0 or p[-1] != spec.shape[0] or any(b <= a for a, b in zip(p, p[1:]))):
        raise WeightSyncError(f"'{spec.name}': row pieces {p} do not cut its {spec.shape[:1]} rows in order")


class WeightStream:
    """Named tensors produced one at a time (gathered from shards, merged from adapters) whose
    names, shapes and dtypes are known up front (`specs`). A transport plans its buckets from
    the specs and consumes the tensors as they come, dropping each once its bucket is sent, so
    the sender never holds more than a bucket or two of them: what makes a sync from FSDP2
    shards cost one bucket on top of the shard instead of the whole model.

    A spec with `pieces` is produced as its row slices, one item each (`pieces()` yields them as
    they come, what a bucketed sender packs); iterating the stream yields every tensor whole,
    assembling sliced ones (what an engine loading the stream sees).

    Iterating checks every tensor against its spec (a producer that drifts from what it
    announced is a WeightSyncError, not a corrupted transfer) and can be done once."""

    def __init__(self, specs: Iterable[TensorSpec | tuple], tensors: Iterable[tuple[str, torch.Tensor]],
                 device: torch.device | str | None = "cpu"):
        self.device = None if device is None else torch.device(device)
        """Where the tensors will be (None: on several devices); chooses the data path."""
        self.specs = tuple(s if isinstance(s, TensorSpec) else TensorSpec(s[0], tuple(s[1]), s[2])
                           for s in specs)
        seen: set[str] = set()
        for spec in self.specs:
            _check_pieces(spec)
            if spec.name in seen:
                raise WeightSyncError(f"tensor '{spec.name}' appears twice in one weight transfer")
            seen.add(spec.name)
        self._tensors: Iterable[tuple[str, torch.Tensor]] | None = tensors

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    @property
    def sliced(self) -> bool:
        """Whether any tensor comes in row slices."""
        return any(s.pieces for s in self.specs)

    def pieces(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The producer's items as they come, each checked: a whole tensor per spec, or one
        row slice per piece of a sliced one (in row order)."""
        if self._tensors is None:
            raise WeightSyncError("a weight stream can be consumed once")
        tensors, self._tensors = iter(self._tensors), None
        for spec in self.specs:
            for shape in spec.piece_shapes():
                item = next(tensors, None)
                if item is None:
                    raise WeightSyncError(f"the weight stream ended before '{spec.name}' "
                                          f"({len(self.specs)} tensors were announced)")
                name, tensor = item
                check_tensor(TensorSpec(spec.name, shape, spec.dtype), name, tensor)
                yield name, tensor
                del item, tensor  # the consumer decides how long a tensor lives
        if next(tensors, None) is not None:
            raise WeightSyncError(f"the weight stream yielded more than the {len(self.specs)} "
                                  "tensors it announced")

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor whole: a sliced one is copied slice by slice into one tensor of its
        spec (its slices freed as they are copied), so a consumer holds it and one slice."""
        items = self.pieces()
        for spec in self.specs:
            if not spec.pieces:
                yield next(items)
                continue
            whole = None
            for a, b in zip(spec.pieces, spec.pieces[1:]):
                name, piece = next(items)
                if whole is None:
                    whole = torch.empty(spec.shape, dtype=spec.dtype, device=piece.device)
                whole[a:b].copy_(piece)
                del piece
            yield spec.name, whole
            del whole
        for _ in items:  # `pieces` raises if the producer yields more than it announced
            pass


def check_tensor(spec: TensorSpec, name: str, tensor: Any) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise WeightSyncError(f"'{name}' is a {type(tensor).__name__}, not a tensor")
    if name != spec.name or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
        raise WeightSyncError(f"the weight stream yielded '{name}' {tuple(tensor.shape)} {tensor.dtype} "
                              f"where it announced '{spec.name}' {spec.shape} {spec.dtype}")


def as_stream(named_tensors: NamedTensors) -> WeightStream:
    """`named_tensors` as a WeightStream. A Mapping or a list is already in memory (its specs
    are read from the tensors); a bare iterator is listed first, which holds every tensor it
    yields: a producer that gathers or merges tensors should pass a WeightStream."""
    if isinstance(named_tensors, WeightStream):
        return named_tensors
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise WeightSyncError(f"'{name}' is a {type(tensor).__name__}, not a tensor")
    devices = {t.device for _, t in items} or {torch.device("cpu")}
    return WeightStream([TensorSpec(n, tuple(t.shape), t.dtype) for n, t in items], items,
                        device=devices.pop() if len(devices) == 1 else None)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | WeightStream


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


def build_transport(config: Any, topology: TopologySpec, **context: Any) -> WeightTransport:
    """The transport `config` (a WeightSyncConfig) selects in a run of `topology` (its
    `TopologySpec`, polyrl/distributed/topologies.py: `auto` is its default, one it cannot serve
    is a ValueError naming the fix). A run's actors build theirs from their `RolePlan` instead
    (polyrl/workers/rollout_worker.py:open_transport).

    Context by transport: in_place(engine=...), broadcast(group=..., watchdog=None, device=None),
    object_store(mailbox=...).
    """
    cls = WEIGHT_TRANSPORTS.get(topology.transport(config.transport))
    return cls(config, **context)
