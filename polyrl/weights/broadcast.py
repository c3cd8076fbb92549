"""Standalone placement: bucketed broadcast from the sync group's leader.

The group is the layout's `weight_sync` group (trainer leader + every rollout rank) on the
platform's communication backend (gloo on CPU). The source is the group's leader, never a
literal rank 0. Two data paths carry the same manifest (names, shapes, dtypes, bucket layout,
version) and the same all-or-nothing guarantee:

backend (other hosts, device tensors, `shared_memory: false`)
    manifest   pickled broadcast from the leader (with the shared-memory offer, see below)
    buckets    one broadcast per bucket, raw bytes; the sender packs bucket i+1 while bucket i
               is on the wire and holds at most two scratch buckets
    commit     [version, buckets, ok]: ok=0 when the sender failed midway

shared memory (one host, CPU tensors; `shm.py`)
    The first transfer offers a segment in /dev/shm with its manifest; one all-reduce checks
    that every receiver opened it. From then on a transfer uses no collective at all: the
    manifest goes down each receiver's FIFO, the bytes through the segment, and an abort signal
    replaces the commit. Direct staging (default, when the weights fit): the sender packs the
    whole stream into the segment once and receivers hand views of it to the engine, releasing
    it after the engine loaded them (one copy in total). Otherwise a ring of slot-sized chunks:
    the sender packs chunk n+1 while receivers copy chunk n into their own staging buffer.
    A peer that dies is seen at once (its FIFO end closes); one that stalls, at the deadline.

Receivers apply with one `engine.update_weights` once every byte arrived. Staging memory (a
flat buffer, or the shared segment) is reused across versions and written only while every
receiver is inside `receive()` (engines copy what they load). Every wait has the transfer's
deadline; a rank that does not arrive is named with its last heartbeat (watchdog).
"""

from __future__ import annotations

import pickle
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from polyrl.distributed.collectives import broadcast_from_leader
from polyrl.distributed.layout import group_leader
from polyrl.distributed.watchdog import (CollectiveError, CollectiveTimeout, Watch, Watchdog,
                                         default_watchdog)
from polyrl.weights import bucketing
from polyrl.weights.base import NamedTensors, TransferStats, WeightSyncError, named_items
from polyrl.weights.bucketing import (StagedWeights, WeightManifest, as_bytes, flat_staging,
                                      plan_buckets, staging_views)
from polyrl.weights.config import WeightSyncConfig
from polyrl.weights.shm import ABORT, CHUNK, MESSAGE, PeerLost, ReceiverRing, SenderRing, attach

IN_FLIGHT = 2


class BroadcastTransport:
    name = "broadcast"

    def __init__(self, config: WeightSyncConfig | None = None, *, group: Any,
                 watchdog: Watchdog | None = None, device: torch.device | None = None):
        self.config = config or WeightSyncConfig(transport="broadcast")
        self.group = group
        self.src = group_leader(group)
        self.members = dist.get_process_group_ranks(group)
        self.receivers = [r for r in self.members if r != self.src]
        self.device = device
        """Where receivers stage buckets (the platform's device for device backends)."""
        self._watchdog = watchdog
        self._scratch: list[torch.Tensor] = []
        self._ring: SenderRing | ReceiverRing | None = None
        """The shared-memory ring, once every receiver has opened it."""
        self._shm_refused = False  # some receiver could not open a ring: do not offer again
        self._staging: torch.Tensor | None = None
        self._views: tuple[tuple, dict[str, torch.Tensor]] | None = None
        self.last_stats: TransferStats | None = None

    @property
    def watchdog(self) -> Watchdog:
        return self._watchdog if self._watchdog is not None else default_watchdog()

    @property
    def is_sender(self) -> bool:
        return dist.get_rank() == self.src

    # --- trainer leader ----------------------------------------------------------------------
    def send(self, named_tensors: NamedTensors, version: int) -> TransferStats:
        if not self.is_sender:
            raise WeightSyncError(f"send() runs on the weight-sync group's leader (global rank "
                                  f"{self.src}); this is rank {dist.get_rank()}: call receive()")
        items = named_items(named_tensors)
        manifest, ordered = plan_buckets(items, version, self.config.bucket_bytes)
        phase = f"weight sync v{version}"
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.config.timeout_s
        geometry = self._announce(manifest, ordered, phase, deadline)
        if geometry is not None:
            self.watchdog.beat(f"{phase}: shared memory")
            failure = self._on_ring(lambda: self._send_shm(manifest, ordered, geometry, deadline), phase)
        else:
            watch = self.watchdog.watch(self.group, phase=f"{phase}: buckets",
                                        timeout_s=max(deadline - time.monotonic(), 0.001),
                                        what="weight broadcast")
            failure = self._send_plain(manifest, ordered, watch)
            commit = torch.tensor([version, len(manifest.buckets), 0 if failure else 1], dtype=torch.int64)
            watch.wait(dist.broadcast(self._control(commit), src=self.src, group=self.group, async_op=True))
        if failure is not None:
            where, exc = failure
            raise WeightSyncError(f"sending version {version} failed at {where} "
                                  f"({type(exc).__name__}: {exc}); receivers discarded it and keep "
                                  "their previous weights") from exc
        stats = TransferStats(self.name, version, manifest.num_tensors, len(manifest.buckets),
                              manifest.total_bytes, time.perf_counter() - t0)
        self.last_stats = stats
        return stats

    def _announce(self, manifest: WeightManifest, ordered: list[torch.Tensor], phase: str,
                  deadline: float) -> tuple[int, int, bool] | None:
        """Deliver the manifest; returns the ring geometry this transfer uses, or None (backend
        path). On the ring: down each receiver's FIFO. Otherwise a broadcast, with the offer of
        a new ring and the all-reduce that checks every receiver opened it."""
        on_cpu = all(t.device.type == "cpu" for t in ordered)
        total = manifest.stream_layout()[1]
        if isinstance(self._ring, SenderRing):  # every receiver listens on the ring
            ring = self._ring
            geometry = self._geometry(ring, total) if on_cpu else None
            self.watchdog.beat(f"{phase}: manifest")
            payload = pickle.dumps({"manifest": manifest, "ring": geometry})
            self._on_ring(lambda: ring.message(payload, deadline), phase)
            return geometry
        new = self._new_ring(total) if on_cpu and ordered else None
        geometry = None if new is None else self._geometry(new, total)
        try:
            broadcast_from_leader({"manifest": manifest, "offer": new and new.offer(), "ring": geometry},
                                  self.group, timeout_s=self.config.timeout_s,
                                  phase=f"{phase}: manifest", watchdog=self.watchdog)
            agreed = new is not None and self._vote(phase, deadline, True)
        except BaseException:
            if new is not None:
                new.close()
            raise
        if agreed:
            new.connect()  # every receiver has it open: nothing can leak from here on
            self._ring = new
            return geometry
        if new is not None:
            new.close()
            self._shm_refused = True  # a receiver cannot open it: backend path from now on
        return None

    def _send_plain(self, manifest: WeightManifest, ordered: list[torch.Tensor], watch: Watch):
        need = max((s.nbytes for s in manifest.buckets if s.num_slots > 1), default=0)
        if not self._scratch or self._scratch[0].numel() < need:  # reused: no page faults
            device = ordered[0].device if ordered else None
            self._scratch = [torch.empty(need, dtype=torch.uint8, device=device) for _ in range(IN_FLIGHT)]
        inflight: deque = deque()
        failure: tuple[str, BaseException] | None = None
        for b, spec in enumerate(manifest.buckets):
            if len(inflight) >= IN_FLIGHT:  # scratch[b % 2] is free once bucket b-2 is sent
                watch.wait(inflight.popleft())
            flat = None
            if failure is None:
                try:
                    flat = as_bytes(bucketing.pack_bucket(manifest, b, ordered, self._scratch[b % IN_FLIGHT]))
                except Exception as exc:  # keep the collective sequence aligned, then abort
                    failure = (f"bucket {b}", exc)
            if flat is None:
                flat = torch.empty(spec.nbytes, dtype=torch.uint8, device=self._scratch[0].device)
            inflight.append(dist.broadcast(flat, src=self.src, group=self.group, async_op=True))
        while inflight:
            watch.wait(inflight.popleft())
        return failure

    def _send_shm(self, manifest: WeightManifest, ordered: list[torch.Tensor], geometry: tuple,
                  deadline: float):
        ring = self._ring
        assert isinstance(ring, SenderRing)
        ring.geometry(*geometry[:2])
        if geometry[2]:
            ring.hold()  # until every receiver is inside receive()
        failure: tuple[str, BaseException] | None = None
        size = ring.slot_bytes
        total = manifest.stream_layout()[1]
        try:
            pieces = bucketing.stream_pieces(manifest, ordered)
        except Exception as exc:
            pieces, failure = [], ("chunk 0", exc)
        for n in range(_chunks(total, size) if failure is None else 0):
            slot = ring.claim_slot(deadline)  # every receiver is done with what it held
            lo, hi = n * size, min(total, (n + 1) * size)
            try:
                bucketing.pack_range(pieces, lo, slot[: hi - lo])
            except Exception as exc:
                failure = (f"chunk {n} (stream bytes {lo}..{hi})", exc)
                break
            ring.publish(deadline)
        if failure is not None:
            ring.publish(deadline, ABORT)
        ring.drain(deadline)  # every receiver has copied (or, direct: applied) every chunk
        return failure

    def _new_ring(self, total: int) -> SenderRing | None:
        """A segment for the whole stream (direct staging), else a ring; None if /dev/shm is
        missing or full, or shared memory is off."""
        if not self.config.shared_memory or self._shm_refused or not self.receivers:
            return None
        ring_bytes = self.config.shm_slots * self.config.shm_slot_bytes
        sizes = ([max(_round_up(total), ring_bytes)] if self.config.shm_direct else []) + [ring_bytes]
        for capacity in sizes:
            try:
                return SenderRing(capacity, len(self.receivers))
            except OSError:
                continue
        return None

    def _geometry(self, ring: SenderRing, total: int) -> tuple[int, int, bool]:
        """(slots, slot bytes, direct) for a stream of `total` bytes through `ring`."""
        if self.config.shm_direct and total <= ring.capacity:
            return 1, ring.capacity, True
        slot = min(self.config.shm_slot_bytes, ring.capacity // self.config.shm_slots // 64 * 64)
        return min(self.config.shm_slots, ring.capacity // slot), slot, False

    def _close_ring(self) -> None:
        self._views = None  # views of the segment would keep it mapped
        if self._ring is not None:
            self._ring.close()
            self._ring = None

    # --- rollout ranks -----------------------------------------------------------------------
    def receive(self, engine: Any) -> int:
        if self.is_sender:
            raise WeightSyncError(f"rank {self.src} leads the weight-sync group: call send()")
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.config.timeout_s
        if isinstance(self._ring, ReceiverRing):
            self.watchdog.beat("weight sync: manifest")
            msg = self._on_ring(lambda: self._ring_message(deadline), "weight sync")
        else:
            msg = broadcast_from_leader(None, self.group, timeout_s=self.config.timeout_s,
                                        phase="weight sync: manifest", watchdog=self.watchdog)
        manifest = msg.get("manifest") if isinstance(msg, dict) else None
        if not isinstance(manifest, WeightManifest):
            raise WeightSyncError(f"weight sync: the leader sent a {type(msg).__name__}, not a "
                                  "manifest (are both sides on the same polyrl version?)")
        version = manifest.version
        phase = f"weight sync v{version}"
        offer = msg.get("offer")
        if isinstance(offer, dict):  # a new ring: can every receiver open it?
            index = self.receivers.index(dist.get_rank())
            ring = attach(offer, index) if self.device is None or self.device.type == "cpu" else None
            try:
                agreed = self._vote(phase, deadline, ring is not None)
            except BaseException:
                if ring is not None:
                    ring.close()
                raise
            if agreed:
                self._ring = ring
            elif ring is not None:
                ring.close()
        geometry = msg.get("ring") if self._ring is not None else None
        if geometry is not None:
            self.watchdog.beat(f"{phase}: shared memory")
            applied = self._on_ring(lambda: self._receive_shm(manifest, geometry, engine, deadline), phase)
        else:
            staged = StagedWeights(manifest, staging_views(manifest, self._staging_for(manifest)))
            self._receive_plain(manifest, staged, phase, deadline)
            applied = staged.apply(engine)
        self.last_stats = TransferStats(self.name, version, manifest.num_tensors,
                                        len(manifest.buckets), manifest.total_bytes,
                                        time.perf_counter() - t0)
        return applied

    def _receive_plain(self, manifest: WeightManifest, staged: StagedWeights, phase: str,
                       deadline: float) -> None:
        watch = self.watchdog.watch(self.group, phase=f"{phase}: buckets",
                                    timeout_s=max(deadline - time.monotonic(), 0.001),
                                    what="weight broadcast")
        works = [dist.broadcast(staged.buffer(b), src=self.src, group=self.group, async_op=True)
                 for b in range(len(manifest.buckets))]
        for b, work in enumerate(works):
            watch.wait(work)
            staged.mark(b)
        commit = self._control(torch.zeros(3, dtype=torch.int64))
        watch.wait(dist.broadcast(commit, src=self.src, group=self.group, async_op=True))
        got = [int(x) for x in commit.cpu()]
        if got[2] != 1:
            raise WeightSyncError(f"the sender aborted version {manifest.version} midway; "
                                  "discarded, the previous weights stay in service")
        if got[:2] != [manifest.version, len(manifest.buckets)]:
            raise WeightSyncError(f"commit {got[:2]} does not match manifest (version "
                                  f"{manifest.version}, {len(manifest.buckets)} buckets); discarded")

    def _ring_message(self, deadline: float) -> Any:
        ring = self._ring
        assert isinstance(ring, ReceiverRing)
        signal = ring.next_signal(deadline)
        if signal != MESSAGE:
            self._close_ring()
            raise WeightSyncError(f"weight ring out of step: expected a manifest, got {signal!r}")
        return pickle.loads(ring.read_message(deadline))

    def _receive_shm(self, manifest: WeightManifest, geometry: tuple, engine: Any,
                     deadline: float) -> int:
        ring = self._ring
        assert isinstance(ring, ReceiverRing)
        ring.geometry(*geometry[:2])
        total = manifest.stream_layout()[1]
        direct = geometry[2]
        if direct:  # the engine loads straight from the segment; we release it afterwards
            self._staging = None
            ring.ready(deadline)  # the sender may write the segment now
        flat = ring.slot[0][:total] if direct else self._staging_for(manifest)
        named = self._views_of(manifest, flat)  # built while the sender packs
        failure: BaseException | None = None
        for n in range(1 if direct else _chunks(total, ring.slot_bytes)):
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
        return manifest.version

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
            self._close_ring()
            raise WeightSyncError(f"weight ring out of step: expected chunk {n}, got {signal!r}")

    def _staging_for(self, manifest: WeightManifest) -> torch.Tensor:
        total = manifest.stream_layout()[1]
        if self._staging is None or self._staging.numel() != total:  # reused: no page faults
            self._staging = flat_staging(manifest, self.device)
        return self._staging

    # --- control -----------------------------------------------------------------------------
    def _vote(self, phase: str, deadline: float, ok: bool) -> bool:
        """One all-reduce (MIN) over the group: every rank can use the offered ring."""
        watch = self.watchdog.watch(self.group, phase=f"{phase}: shared-memory check",
                                    timeout_s=max(deadline - time.monotonic(), 0.001),
                                    what="weight broadcast")
        flag = self._control(torch.tensor([int(ok)], dtype=torch.int64))
        watch.wait(dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group, async_op=True))
        return bool(int(flag.cpu()[0]))

    def _on_ring(self, step: Any, phase: str) -> Any:
        """Run a ring step; a peer that stalls or exits becomes a watchdog error naming it (the
        ring is then out of step and closed, like a group after a failed collective). Other
        errors (an abort, an engine that rejects the weights) leave the ring in step."""
        try:
            return step()
        except PeerLost as exc:
            self._close_ring()
            ranks = [self.src if p < 0 else self.receivers[p] for p in exc.peers]
            dog = self.watchdog
            cls = CollectiveTimeout if exc.timed_out else CollectiveError
            detail = (f"no progress after {self.config.timeout_s:g}s" if exc.timed_out
                      else f"{', '.join(f'rank {r}' for r in ranks)} {exc}")
            raise cls("weight broadcast (shared memory)", f"{phase}: shared memory", dog.step,
                      self.members, {r: dog.last_seen(r) for r in ranks}, detail) from None

    def _control(self, t: torch.Tensor) -> torch.Tensor:
        """Small control tensors live where the backend wants them (the staging device)."""
        return t if self.device is None else t.to(self.device)


def _chunks(total: int, slot_bytes: int) -> int:
    """Chunks of a stream through slots of `slot_bytes` (an empty stream still sends one)."""
    return max(-(-total // slot_bytes), 1)


def _round_up(n: int, to: int = 64) -> int:
    return max(-(-n // to) * to, to)
