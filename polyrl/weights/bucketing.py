"""Planning buckets from tensor specs, packing them from a stream, and staging them on the receiver.

The sender first ships a `WeightManifest` (names, shapes, dtypes, where each tensor sits in which
bucket, the version), planned from the stream's specs before any tensor exists (`plan_buckets`);
buckets then travel as raw bytes, one message per bucket, so any dtype (bf16, fp8) crosses any
backend. The receiver allocates every bucket up front (`StagedWeights`), fills them, and only when
all have arrived and the byte counts match exposes the tensors, as views into the buckets (no
copy), for one `engine.update_weights` call.

Buckets follow the stream's order (a sender consuming tensors as they are gathered cannot
reorder them without holding them) and are byte buffers: each tensor starts at an ALIGN-byte
offset, so its typed view is aligned whatever dtypes share the bucket. A tensor bigger than the
budget gets a bucket of its own and is sent without packing (zero copy).

`iter_buckets` packs bucket after bucket from the stream, pulling each tensor only when its bucket
is being filled; a caller that sends a bucket before asking for the next holds one bucket of
tensors (plus its scratch). The shared-memory path sees the buckets as one byte stream
(`stream_layout`): bucket b starts at an aligned offset of one flat staging buffer.

A tensor the stream yields in row slices (`TensorSpec.pieces`, polyrl/weights/base.py) gets one
slot per slice, each alone in its bucket (sent zero copy), and its buckets lie back to back in
the flat layout, so on a receiver the slices form the whole tensor where they land: the engine
gets one view of it, no copy (`StagedWeights.tensors`; buffers that are not one flat layout are
concatenated).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from polyrl.weights.base import TensorSpec, WeightStream, WeightSyncError, check_tensor


@dataclass(frozen=True)
class TensorSlot:
    name: str
    shape: tuple[int, ...]
    dtype: str
    bucket: int
    offset: int
    """Byte offset inside the bucket (a multiple of ALIGN)."""
    nbytes: int
    rows: tuple[int, int] | None = None
    """A row slice [start, stop) of tensor `name` (`shape` is the slice's); None: the whole."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.shape, self.torch_dtype)


@dataclass(frozen=True)
class BucketSpec:
    nbytes: int
    first_slot: int
    num_slots: int


@dataclass(frozen=True)
class WeightManifest:
    version: int
    slots: tuple[TensorSlot, ...]
    """In stream order: bucket b holds slots[first_slot : first_slot + num_slots]."""
    buckets: tuple[BucketSpec, ...]
    device_type: str = "cpu"
    """The device type the sender packed the buckets on (a GPU's: they travel through the
    group's device backend, NCCL). A receiver staging on another device type would wait in
    another backend: it refuses the manifest in one line (`check_device`) instead of waiting
    for the watchdog."""

    def check_device(self, staging: str, where: str = "this rank") -> None:
        """Raise if a receiver that stages on `staging` cannot take these buckets."""
        if staging != self.device_type:
            raise WeightSyncError(device_mismatch(where, staging, self.device_type, self.version))

    @property
    def num_tensors(self) -> int:
        return len(self.slots)

    @property
    def total_bytes(self) -> int:
        """Bytes of the tensors themselves (without alignment padding)."""
        return sum(s.nbytes for s in self.slots)

    def bucket_slots(self, b: int) -> tuple[TensorSlot, ...]:
        spec = self.buckets[b]
        return self.slots[spec.first_slot: spec.first_slot + spec.num_slots]

    def stream_layout(self) -> tuple[list[int], int]:
        """Where each bucket starts in one flat buffer (ALIGN-byte aligned, except that a row
        slice after the first of its tensor starts where the previous slice ends), and its length."""
        starts, end, last = [], 0, 0
        for spec in self.buckets:
            first = self.slots[spec.first_slot]
            start = last if first.rows is not None and first.rows[0] > 0 else _align(end)
            starts.append(start)
            end = last = start + spec.nbytes
        return starts, _align(end)


ALIGN = 64
"""Alignment of every tensor inside its bucket and of every bucket in the flat staging buffer."""


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"manifest names an unknown dtype '{name}'")
    return dtype


def device_mismatch(where: str, staging: str, packed: str, version: int | None = None) -> str:
    """The one line both ends of a device mismatch print."""
    of = "" if version is None else f" of version {version}"
    return (f"weight sync: {where} stages buckets on {staging} but the sender packs them on "
            f"{packed}{of}; both ends must hand the transport the same platform device "
            f"(device=..., see docs/weight_sync.md), or the {packed} broadcasts and the {staging} "
            "receives never meet")


def plan_buckets(specs: Iterable[TensorSpec], version: int, bucket_bytes: int,
                 device_type: str = "cpu") -> WeightManifest:
    """The manifest of a stream with these specs, packed on `device_type`: tensors in stream
    order, a new bucket when the next tensor would pass the budget (a tensor bigger than the
    budget is alone in its bucket, and so is each row slice of a sliced tensor)."""
    slots: list[TensorSlot] = []
    buckets: list[BucketSpec] = []
    start, fill = 0, 0

    def close() -> None:
        nonlocal start, fill
        if len(slots) > start:
            buckets.append(BucketSpec(fill, start, len(slots) - start))
        start, fill = len(slots), 0

    for spec in specs:
        if spec.pieces:
            close()
            for (a, b), shape in zip(zip(spec.pieces, spec.pieces[1:]), spec.piece_shapes()):
                piece = TensorSpec(spec.name, shape, spec.dtype)
                slots.append(TensorSlot(spec.name, shape, dtype_name(spec.dtype), len(buckets), 0,
                                        piece.nbytes, rows=(a, b)))
                fill = piece.nbytes
                close()
            continue
        n = spec.nbytes
        offset = _align(fill)
        if len(slots) > start and offset + n > bucket_bytes:
            close()
            offset = 0
        slots.append(TensorSlot(spec.name, tuple(spec.shape), dtype_name(spec.dtype), len(buckets), offset, n))
        fill = offset + n
    close()
    return WeightManifest(version, tuple(slots), tuple(buckets), device_type)


def checked(manifest: WeightManifest, stream: Iterable[tuple[str, torch.Tensor]]
            ) -> Iterator[tuple[TensorSlot, torch.Tensor]]:
    """(slot, tensor) pairs of `stream`, each checked against its slot, in manifest order (a
    WeightStream's items as they come: row slices of a sliced tensor one by one)."""
    tensors = stream.pieces() if isinstance(stream, WeightStream) else iter(stream)
    for slot in manifest.slots:
        item = next(tensors, None)
        if item is None:
            raise WeightSyncError(f"version {manifest.version}: the weights ended before "
                                  f"'{slot.name}' ({manifest.num_tensors} tensors were planned)")
        check_tensor(slot.spec, *item)
        yield slot, item[1]
        del item
    if next(tensors, None) is not None:
        raise WeightSyncError(f"version {manifest.version}: more tensors than the {manifest.num_tensors} planned")


Scratch = Callable[[int, torch.device], torch.Tensor]
"""scratch(b, device): a uint8 buffer of at least bucket b's bytes on `device`."""


def iter_buckets(manifest: WeightManifest, stream: Iterable[tuple[str, torch.Tensor]], scratch: Scratch,
                 zero_copy: bool = True, device: torch.device | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """(b, bucket b as uint8 bytes), packed from `stream` as it arrives: a bucket's tensors are
    pulled only when that bucket is packed, and dropped once copied. With `zero_copy`, a bucket
    of one contiguous tensor is that tensor's own bytes. `device`: where every bucket is packed
    (a tensor elsewhere is copied there); None: on its first tensor's device."""
    pairs = checked(manifest, stream)
    for b, spec in enumerate(manifest.buckets):
        if zero_copy and spec.num_slots == 1:
            _, tensor = next(pairs)
            if tensor.is_contiguous() and (device is None or tensor.device == device):
                flat = as_bytes(tensor.detach().reshape(-1))
                del tensor  # not alive while the next one is gathered (only the caller's bytes are)
                yield b, flat
                del flat
                continue
            out = scratch(b, device or tensor.device)[: spec.nbytes]
            copy_into(out, manifest.slots[spec.first_slot], tensor)
            del tensor
            yield b, out
            del out
            continue
        out = None
        for _ in range(spec.num_slots):
            slot, tensor = next(pairs)
            if out is None:
                out = scratch(b, device or tensor.device)[: spec.nbytes]
            copy_into(out, slot, tensor)
            del tensor
        yield b, out
    for _ in pairs:  # the stream must end here (`checked` raises if it holds more)
        pass


def copy_into(bucket: torch.Tensor, slot: TensorSlot, tensor: torch.Tensor) -> None:
    """Copy `tensor` into its slot of `bucket` (uint8)."""
    copy_tensor(bucket[slot.offset: slot.offset + slot.nbytes], tensor)


def copy_tensor(region: torch.Tensor, tensor: torch.Tensor) -> None:
    """Copy `tensor` into `region` (uint8 bytes, aligned for its dtype), typed: a strided or
    device tensor needs no flat temporary. Every byte a sender writes goes through here."""
    region.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())


def flat_staging(manifest: WeightManifest, device: torch.device | None = None) -> torch.Tensor:
    """One uint8 buffer for the whole stream (`staging_views` cuts it into buckets)."""
    return torch.empty(manifest.stream_layout()[1], dtype=torch.uint8, device=device)


def staging_views(manifest: WeightManifest, flat: torch.Tensor) -> list[torch.Tensor]:
    starts, total = manifest.stream_layout()
    if flat.numel() != total:
        raise WeightSyncError(f"version {manifest.version}: staging holds {flat.numel()} bytes, "
                              f"the stream needs {total}")
    return [flat[s: s + spec.nbytes] for s, spec in zip(starts, manifest.buckets)]


def as_bytes(flat: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a flat contiguous tensor, as a uint8 view (what travels)."""
    if flat.dim() == 0:
        flat = flat.reshape(1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


class StagedWeights:
    """Receive buffers for one version; the engine sees nothing until every bucket arrived."""

    def __init__(self, manifest: WeightManifest, buffers: list[torch.Tensor] | None = None,
                 device: torch.device | None = None):
        if not isinstance(manifest, WeightManifest):
            raise WeightSyncError(f"expected a weight manifest, got {type(manifest).__name__}")
        self.manifest = manifest
        if buffers is None:  # one flat layout: a sliced tensor's buckets are one tensor already
            buffers = staging_views(manifest, flat_staging(manifest, device))
        if len(buffers) != len(manifest.buckets):
            raise WeightSyncError(f"version {manifest.version}: {len(buffers)} buckets for a manifest "
                                  f"of {len(manifest.buckets)}")
        self.buffers = buffers
        self.arrived = [False] * len(buffers)

    def buffer(self, b: int) -> torch.Tensor:
        """The uint8 receive buffer of bucket `b`."""
        return self.buffers[b]

    def mark(self, b: int) -> None:
        spec, buf = self.manifest.buckets[b], self.buffers[b]
        if buf.dtype != torch.uint8 or buf.numel() != spec.nbytes:
            raise WeightSyncError(f"version {self.manifest.version} bucket {b}: got {buf.numel()} "
                                  f"bytes ({buf.dtype}), the manifest says {spec.nbytes}")
        self.arrived[b] = True

    @property
    def complete(self) -> bool:
        return all(self.arrived)

    def tensors(self) -> dict[str, torch.Tensor]:
        if not self.complete:
            missing = [b for b, ok in enumerate(self.arrived) if not ok]
            raise WeightSyncError(f"version {self.manifest.version} is incomplete: buckets {missing} "
                                  "never arrived; the previous weights stay in service")
        out: dict[str, torch.Tensor] = {}
        pieces: dict[str, list[torch.Tensor]] = {}
        for slot in self.manifest.slots:
            raw = self.buffers[slot.bucket][slot.offset: slot.offset + slot.nbytes]
            if slot.rows is None:
                out[slot.name] = raw.view(slot.torch_dtype).view(slot.shape)
            else:
                pieces.setdefault(slot.name, []).append(raw)
                out[slot.name] = None  # keeps the manifest's order
        for name, raws in pieces.items():
            last = next(s for s in reversed(self.manifest.slots) if s.name == name)
            out[name] = _joined(raws).view(last.torch_dtype).view(last.rows[1], *last.shape[1:])
        return out

    def apply(self, engine: Any) -> int:
        """One all-or-nothing `engine.update_weights` call; returns the version applied."""
        engine.update_weights(self.tensors(), self.manifest.version)
        return self.manifest.version



def _joined(raws: list[torch.Tensor]) -> torch.Tensor:
    """The bytes of consecutive row slices as one tensor: a view when they lie back to back in
    one storage (the flat layout), else one concatenated copy (separate buffers: object store)."""
    first = raws[0]
    storage = first.untyped_storage()
    adjacent = all(r.untyped_storage().data_ptr() == storage.data_ptr()
                   and r.data_ptr() == prev.data_ptr() + prev.numel() for prev, r in zip(raws, raws[1:]))
    if adjacent:
        total = sum(r.numel() for r in raws)
        return torch.empty(0, dtype=torch.uint8, device=first.device).set_(
            storage, first.storage_offset(), (total,))
    return torch.cat(raws)
