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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from polyrl.weights.base import TensorSpec, WeightSyncError, check_tensor


@dataclass(frozen=True)
class TensorSlot:
    name: str
    shape: tuple[int, ...]
    dtype: str
    bucket: int
    offset: int
    """Byte offset inside the bucket (a multiple of ALIGN)."""
    nbytes: int

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
        """Where each bucket starts in one flat buffer (ALIGN-byte aligned), and its length."""
        starts, end = [], 0
        for spec in self.buckets:
            starts.append(end)
            end = _align(end + spec.nbytes)
        return starts, end


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


def plan_buckets(specs: Iterable[TensorSpec], version: int, bucket_bytes: int) -> WeightManifest:
    """The manifest of a stream with these specs: tensors in stream order, a new bucket when the
    next tensor would pass the budget (a tensor bigger than the budget is alone in its bucket)."""
    slots: list[TensorSlot] = []
    buckets: list[BucketSpec] = []
    start, fill = 0, 0
    for spec in specs:
        n = spec.nbytes
        offset = _align(fill)
        if len(slots) > start and offset + n > bucket_bytes:
            buckets.append(BucketSpec(fill, start, len(slots) - start))
            start, offset = len(slots), 0
        slots.append(TensorSlot(spec.name, tuple(spec.shape), dtype_name(spec.dtype), len(buckets), offset, n))
        fill = offset + n
    if len(slots) > start:
        buckets.append(BucketSpec(fill, start, len(slots) - start))
    return WeightManifest(version, tuple(slots), tuple(buckets))


def checked(manifest: WeightManifest, stream: Iterable[tuple[str, torch.Tensor]]
            ) -> Iterator[tuple[TensorSlot, torch.Tensor]]:
    """(slot, tensor) pairs of `stream`, each checked against its slot, in manifest order."""
    tensors = iter(stream)
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
                 zero_copy: bool = True) -> Iterator[tuple[int, torch.Tensor]]:
    """(b, bucket b as uint8 bytes), packed from `stream` as it arrives: a bucket's tensors are
    pulled only when that bucket is packed, and dropped once copied. With `zero_copy`, a bucket
    of one contiguous tensor is that tensor's own bytes."""
    pairs = checked(manifest, stream)
    for b, spec in enumerate(manifest.buckets):
        if zero_copy and spec.num_slots == 1:
            _, tensor = next(pairs)
            if tensor.is_contiguous():
                yield b, as_bytes(tensor.detach().reshape(-1))
                continue
            out = scratch(b, tensor.device)[: spec.nbytes]
            copy_into(out, manifest.slots[spec.first_slot], tensor)
            del tensor
            yield b, out
            continue
        out = None
        for _ in range(spec.num_slots):
            slot, tensor = next(pairs)
            if out is None:
                out = scratch(b, tensor.device)[: spec.nbytes]
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
        if buffers is None:
            buffers = [torch.empty(spec.nbytes, dtype=torch.uint8, device=device)
                       for spec in manifest.buckets]
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
        for slot in self.manifest.slots:
            raw = self.buffers[slot.bucket][slot.offset: slot.offset + slot.nbytes]
            out[slot.name] = raw.view(slot.torch_dtype).view(slot.shape)
        return out

    def apply(self, engine: Any) -> int:
        """One all-or-nothing `engine.update_weights` call; returns the version applied."""
        engine.update_weights(self.tensors(), self.manifest.version)
        return self.manifest.version

