"""The broadcast transport's shared-memory path: one host, CPU tensors, no collective per
transfer (the ring and its FIFO signals are in `shm.py`).

The manifest goes down each receiver's FIFO, the bytes through the segment, and an abort signal
replaces the backend path's commit. Direct staging (default, when the weights fit): the sender
copies each tensor of the weight stream into the segment as it arrives (holding none of them
after), and receivers hand views of the segment to the engine, releasing it after the engine
loaded them (one copy in total; the segment is the receivers' staging, shared by all of them).
Otherwise a ring of slot-sized chunks: the sender fills chunk n+1 while receivers copy chunk n
into their own staging buffer.
A peer that dies is seen at once (its FIFO end closes); one that stalls, at the deadline. Either
way the ring is out of step and closed, like a group after a failed collective: later transfers
fail at once with the same cause.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, Iterable

import torch

from polyrl.weights import bucketing
from polyrl.weights.base import WeightSyncError
from polyrl.weights.bucketing import StagedWeights, WeightManifest, flat_staging, staging_views
from polyrl.weights.shm import ABORT, CHUNK, MESSAGE, PeerLost, ReceiverRing, SenderRing
from polyrl.weights.sync_group import SyncGroup


class SharedMemoryBroadcast:
    def __init__(self, config: Any, sync: SyncGroup, ring: SenderRing | ReceiverRing):
        self.config, self.sync = config, sync
        self.ring: SenderRing | ReceiverRing | None = ring
        self._lost: str | None = None
        self._staging: torch.Tensor | None = None
        self._views: tuple[tuple, dict[str, torch.Tensor]] | None = None

    # --- sender ------------------------------------------------------------------------------
    def send(self, manifest: WeightManifest, stream: Iterable[tuple[str, torch.Tensor]], deadline: float):
        """Deliver one version, copying each tensor of `stream` into the segment as it arrives;
        returns (where, exception) if that failed midway (the receivers got an abort and keep
        their weights), else None."""
        ring = self._open_ring()
        phase = f"weight sync v{manifest.version}"
        total = manifest.stream_layout()[1]
        geometry = self._geometry(ring, total)
        self.sync.watchdog.beat(f"{phase}: manifest")
        payload = pickle.dumps({"manifest": manifest, "ring": geometry})
        self._guard(lambda: ring.message(payload, deadline), phase)
        self.sync.watchdog.beat(f"{phase}: shared memory")
        return self._guard(lambda: self._stream(ring, manifest, stream, geometry, deadline), phase)

    def _stream(self, ring: SenderRing, manifest: WeightManifest, stream: Iterable[tuple[str, torch.Tensor]],
                geometry: tuple[int, int, bool], deadline: float):
        ring.geometry(*geometry[:2])
        if geometry[2]:
            ring.hold()  # until every receiver is inside receive()
        starts, total = manifest.stream_layout()
        writer = ChunkWriter(ring, total, deadline)
        failure: tuple[str, BaseException] | None = None
        written = 0
        try:
            writer.start()
            for slot, tensor in bucketing.checked(manifest, stream):
                writer.write(starts[slot.bucket] + slot.offset, tensor)
                del tensor
                written += 1
            writer.finish()
        except PeerLost:
            raise
        except Exception as exc:
            where = f" ('{manifest.slots[written].name}')" if written < manifest.num_tensors else ""
            failure = (f"chunk {writer.chunk}{where}", exc)
            ring.publish(deadline, ABORT)
        ring.drain(deadline)  # every receiver has copied (or, direct: applied) every chunk
        return failure

    def _geometry(self, ring: SenderRing, total: int) -> tuple[int, int, bool]:
        """(slots, slot bytes, direct) for a stream of `total` bytes through `ring`."""
        cfg = self.config
        if cfg.shm_direct and total <= ring.capacity:
            return 1, ring.capacity, True
        slot = min(cfg.shm_slot_bytes, ring.capacity // cfg.shm_slots // 64 * 64)
        return min(cfg.shm_slots, ring.capacity // slot), slot, False

    # --- receivers ---------------------------------------------------------------------------
    def receive(self, engine: Any, deadline: float) -> WeightManifest:
        ring = self._open_ring()
        self.sync.watchdog.beat("weight sync: manifest")
        msg = self._guard(lambda: self._message(ring, deadline), "weight sync")
        manifest = msg.get("manifest") if isinstance(msg, dict) else None
        if not isinstance(manifest, WeightManifest):
            raise WeightSyncError(f"weight sync: the leader sent a {type(msg).__name__}, not a "
                                  "manifest (are both sides on the same polyrl version?)")
        self.sync.at_version(manifest.version)
        manifest.check_device("cpu", "this shared-memory receiver")  # the segment is host memory
        phase = f"weight sync v{manifest.version}"
        self.sync.watchdog.beat(f"{phase}: shared memory")
        self._guard(lambda: self._receive_stream(ring, manifest, msg["ring"], engine, deadline), phase)
        return manifest

    def _message(self, ring: ReceiverRing, deadline: float) -> Any:
        signal = ring.next_signal(deadline)
        if signal != MESSAGE:
            self.close(f"out of step: expected a manifest, got {signal!r}")
            raise WeightSyncError(f"weight ring out of step: expected a manifest, got {signal!r}")
        return pickle.loads(ring.read_message(deadline))

    def _receive_stream(self, ring: ReceiverRing, manifest: WeightManifest, geometry: tuple,
                        engine: Any, deadline: float) -> None:
        ring.geometry(*geometry[:2])
        total, direct = manifest.stream_layout()[1], geometry[2]
        if direct:  # the engine loads straight from the segment; we release it afterwards
            self._staging = None
            ring.ready(deadline)  # the sender may write the segment now
        flat = ring.slot[0][:total] if direct else self._staging_for(manifest)
        named = self._views_of(manifest, flat)  # built while the sender packs
        failure: BaseException | None = None
        for n in range(1 if direct else chunks(total, ring.slot_bytes)):
            self._next_chunk(ring, n, manifest, deadline)
            if direct:
                break
            lo, hi = n * ring.slot_bytes, min(total, (n + 1) * ring.slot_bytes)
            if failure is None:
                try:
                    flat[lo:hi].copy_(ring.current_slot()[: hi - lo])
                except Exception as exc:  # keep acknowledging so the ring stays in step
                    failure = exc
            ring.release(deadline)
        if failure is not None:
            raise WeightSyncError(f"staging version {manifest.version} failed "
                                  f"({type(failure).__name__}: {failure}); discarded") from failure
        try:  # every chunk is in: one all-or-nothing update
            engine.update_weights(dict(named), manifest.version)
        finally:
            if direct:
                ring.release(deadline)

    def _views_of(self, manifest: WeightManifest, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The named tensors as views of `flat` (checked against the manifest); reused while the
        layout and the buffer stay the same, which is every version after the first."""
        key = (manifest.slots, manifest.buckets, flat.data_ptr(), flat.numel())
        if self._views is None or self._views[0] != key:
            staged = StagedWeights(manifest, staging_views(manifest, flat))
            for b in range(len(manifest.buckets)):
                staged.mark(b)  # sizes checked; the caller applies only once all bytes arrived
            self._views = (key, staged.tensors())
        return self._views[1]

    def _next_chunk(self, ring: ReceiverRing, n: int, manifest: WeightManifest, deadline: float) -> None:
        signal = ring.next_signal(deadline)
        if signal == ABORT:
            raise WeightSyncError(f"the sender aborted version {manifest.version} midway; "
                                  "discarded, the previous weights stay in service")
        if signal != CHUNK:
            self.close(f"out of step: expected chunk {n}, got {signal!r}")
            raise WeightSyncError(f"weight ring out of step: expected chunk {n}, got {signal!r}")

    def _staging_for(self, manifest: WeightManifest) -> torch.Tensor:
        total = manifest.stream_layout()[1]
        if self._staging is None or self._staging.numel() != total:  # reused: no page faults
            self._staging = flat_staging(manifest)
        return self._staging

    # --- failures ----------------------------------------------------------------------------
    def _open_ring(self) -> Any:
        if self.ring is None:
            raise WeightSyncError(f"the shared-memory weight ring was closed ({self._lost}); the "
                                  "weight-sync group cannot continue: restart the run")
        return self.ring

    def _guard(self, step: Callable[[], Any], phase: str) -> Any:
        """Run a ring step; a peer that stalls or exits becomes a watchdog error naming it.
        Other errors (an abort, an engine that rejects the weights) leave the ring in step."""
        try:
            return step()
        except PeerLost as exc:
            sync = self.sync
            ranks = [sync.src if p < 0 else sync.receivers[p] for p in exc.peers]
            detail = (f"no progress after {self.config.timeout_s:g}s" if exc.timed_out
                      else f"{', '.join(f'rank {r}' for r in ranks)} {exc}")
            self.close(detail)
            raise sync.peer_lost(ranks, exc.timed_out, detail, f"{phase}: shared memory") from None

    def close(self, why: str = "closed by its owner") -> None:
        self._views = None  # views of the segment would keep it mapped
        if self.ring is not None:
            self.ring.close()
            self.ring, self._lost = None, why


class ChunkWriter:
    """Writes the stream into the ring at stream offsets, tensor by tensor: the slot of chunk n
    is claimed (every receiver is done with what it held there) before the first byte of chunk n
    is written, and published once its last byte is; chunks that fall in alignment gaps are
    published as they are. Direct staging is one chunk the size of the stream."""

    def __init__(self, ring: SenderRing, total: int, deadline: float):
        self.ring, self.total, self.deadline = ring, total, deadline
        self.size = ring.slot_bytes
        self.last = chunks(total, self.size) - 1
        self.chunk = 0
        self.slot: torch.Tensor | None = None

    def start(self) -> None:
        self.slot = self.ring.claim_slot(self.deadline)

    def write(self, offset: int, tensor: torch.Tensor) -> None:
        n = tensor.numel() * tensor.element_size()
        if offset // self.size == (offset + n - 1) // self.size or n == 0:  # inside one chunk: typed copy
            self._advance(offset // self.size)
            lo = offset - self.chunk * self.size
            region = self.slot[lo: lo + n]
            bucketing.copy_tensor(region, tensor)
            return
        raw = bucketing.as_bytes(tensor.detach().contiguous().reshape(-1))
        done = 0
        while done < n:
            self._advance((offset + done) // self.size)
            lo = offset + done - self.chunk * self.size
            take = min(n - done, self.size - lo)
            bucketing.copy_tensor(self.slot[lo: lo + take], raw[done: done + take])
            done += take

    def finish(self) -> None:
        self._advance(self.last)
        self.ring.publish(self.deadline)

    def _advance(self, chunk: int) -> None:
        while self.chunk < chunk:
            self.ring.publish(self.deadline)
            self.chunk += 1
            self.slot = self.ring.claim_slot(self.deadline)


def chunks(total: int, slot_bytes: int) -> int:
    """Chunks of a stream through slots of `slot_bytes` (an empty stream still sends one)."""
    return max(-(-total // slot_bytes), 1)
