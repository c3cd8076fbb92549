"""Packing named tensors into flat, dtype-homogeneous buckets, and staging them on the receiver.

The sender first ships a `WeightManifest` (names, shapes, dtypes, where each tensor sits in which
bucket, the version); buckets then travel as raw bytes, one message per bucket, so any dtype
(bf16, fp8) crosses any backend. The receiver allocates every bucket up front (`StagedWeights`),
fills them, and only when all have arrived and the byte counts match exposes the tensors, as
views into the buckets (no copy), for one `engine.update_weights` call.

Buckets hold one dtype each so a tensor's view into its bucket is always aligned. A tensor bigger
than the budget gets a bucket of its own and is sent without packing (zero copy).

The shared-memory path sees the buckets as one byte stream (`stream_layout`): bucket b starts
at an aligned offset of one flat staging buffer, and the stream travels in ring-sized chunks
(`pack_range` copies any byte range of the tensors straight into a ring slot).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import torch

from polyrl.weights.base import WeightSyncError


@dataclass(frozen=True)
class TensorSlot:
    name: str
    shape: tuple[int, ...]
    dtype: str
    bucket: int
    offset: int
    """Element offset inside the bucket."""
    numel: int


@dataclass(frozen=True)
class BucketSpec:
    dtype: str
    numel: int
    first_slot: int
    num_slots: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize


@dataclass(frozen=True)
class WeightManifest:
    version: int
    slots: tuple[TensorSlot, ...]
    """In bucket order: bucket b holds slots[first_slot : first_slot + num_slots]."""
    buckets: tuple[BucketSpec, ...]

    @property
    def num_tensors(self) -> int:
        return len(self.slots)

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def bucket_slots(self, b: int) -> tuple[TensorSlot, ...]:
        spec = self.buckets[b]
        return self.slots[spec.first_slot: spec.first_slot + spec.num_slots]

    def stream_layout(self) -> tuple[list[int], int]:
        """Where each bucket starts in one flat buffer (ALIGN-byte aligned), and its length."""
        starts, end = [], 0
        for spec in self.buckets:
            starts.append(end)
            end = -(-(end + spec.nbytes) // ALIGN) * ALIGN
        return starts, end


ALIGN = 64
"""Bucket alignment in the flat staging buffer: every dtype's view of its bucket is aligned."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"manifest names an unknown dtype '{name}'")
    return dtype


def plan_buckets(items: list[tuple[str, torch.Tensor]], version: int, bucket_bytes: int
                 ) -> tuple[WeightManifest, list[torch.Tensor]]:
    """The manifest, and the tensors reordered to match its slots (grouped by dtype, then in
    the caller's order; a new bucket starts when the next tensor would pass the budget)."""
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in items:
        by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
    slots: list[TensorSlot] = []
    ordered: list[torch.Tensor] = []
    buckets: list[BucketSpec] = []
    for dtype, group in by_dtype.items():
        budget = max(bucket_bytes // dtype.itemsize, 1)
        start, fill = len(slots), 0
        for name, tensor in group:
            n = tensor.numel()
            if fill and fill + n > budget:
                buckets.append(BucketSpec(dtype_name(dtype), fill, start, len(slots) - start))
                start, fill = len(slots), 0
            slots.append(TensorSlot(name, tuple(tensor.shape), dtype_name(dtype), len(buckets), fill, n))
            ordered.append(tensor)
            fill += n
        if len(slots) > start:
            buckets.append(BucketSpec(dtype_name(dtype), fill, start, len(slots) - start))
    return WeightManifest(version, tuple(slots), tuple(buckets)), ordered


def pack_bucket(manifest: WeightManifest, b: int, ordered: list[torch.Tensor],
                scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Bucket `b` as one flat tensor of its dtype. A bucket of one contiguous tensor is that
    tensor's storage (no copy); otherwise the tensors are copied into `scratch` (uint8, at
    least the bucket's bytes) or a new buffer."""
    spec = manifest.buckets[b]
    tensors = ordered[spec.first_slot: spec.first_slot + spec.num_slots]
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return tensors[0].detach().reshape(-1)
    if scratch is None:
        scratch = torch.empty(spec.nbytes, dtype=torch.uint8, device=tensors[0].device)
    return pack_into(manifest, b, ordered, scratch)


def pack_into(manifest: WeightManifest, b: int, ordered: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy bucket `b`'s tensors into `out` (uint8, at least the bucket's bytes); returns the
    flat bucket as a view of `out` in the bucket's dtype."""
    spec = manifest.buckets[b]
    flat = out[: spec.nbytes].view(spec.torch_dtype)
    tensors = ordered[spec.first_slot: spec.first_slot + spec.num_slots]
    for slot, tensor in zip(manifest.bucket_slots(b), tensors):
        flat[slot.offset: slot.offset + slot.numel].copy_(tensor.detach().reshape(-1))
    return flat


def stream_pieces(manifest: WeightManifest, ordered: list[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    """(offset in the flat stream, raw bytes) of every tensor, in stream order."""
    starts, _ = manifest.stream_layout()
    pieces = []
    for slot, tensor in zip(manifest.slots, ordered):
        offset = starts[slot.bucket] + slot.offset * tensor.element_size()
        pieces.append((offset, as_bytes(tensor.detach().reshape(-1))))
    return pieces


def pack_range(pieces: list[tuple[int, torch.Tensor]], start: int, out: torch.Tensor) -> None:
    """Copy bytes [start, start + len(out)) of the stream into `out` (uint8); gaps between
    buckets are left as they are."""
    end = start + out.numel()
    first = max(bisect.bisect_right(pieces, start, key=lambda p: p[0]) - 1, 0)
    for offset, raw in pieces[first:]:
        if offset >= end:
            break
        lo, hi = max(start, offset), min(end, offset + raw.numel())
        if lo < hi:
            out[lo - start: hi - start].copy_(raw[lo - offset: hi - offset])


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
        for b, spec in enumerate(self.manifest.buckets):
            flat = self.buffers[b].view(spec.torch_dtype)
            for slot in self.manifest.bucket_slots(b):
                out[slot.name] = flat[slot.offset: slot.offset + slot.numel].view(slot.shape)
        return out

    def apply(self, engine: Any) -> int:
        """One all-or-nothing `engine.update_weights` call; returns the version applied."""
        engine.update_weights(self.tensors(), self.manifest.version)
        return self.manifest.version
