"""Disaggregated placement: weights broadcast from the weight-sync group's leader.

The group is the layout's `weight_sync` group (trainer leader + every rollout rank) on the
platform's communication backend (gloo on CPU); the source is the group's leader, never a
literal rank 0. The bytes take one of two data paths, chosen once, at the first transfer:

    SharedMemoryBroadcast (`shm_broadcast.py`)  one host, CPU tensors, `weights.shared_memory`:
        the sender offers a segment in /dev/shm and every receiver must open it (one all-reduce
        checks); from then on no collective runs at all
    BackendBroadcast (`backend_broadcast.py`)   otherwise: manifest, buckets and commit through
        the backend

Both carry the same manifest (names, shapes, dtypes, bucket layout, version) and give the same
all-or-nothing guarantee: receivers apply with one `engine.update_weights` once every byte
arrived, and a sender that fails midway leaves the previous version serving. Every wait has the
transfer's deadline; a rank that does not arrive is named with its last heartbeat (watchdog),
labelled with the version in flight (= the trainer step that produced it).

Both ends are handed the rank's platform device (`device=`, `SyncGroup.device`): the sender packs
buckets there, receivers stage them there, and the group's backend for that device type carries
them (NCCL for cuda, gloo for cpu). The data-path offer names the sender's device type and the
one vote that follows also says whether each receiver stages on it, so a mismatch fails on every
rank in one line at the first transfer (the vote is a CPU tensor: gloo on every platform)
instead of hanging until the watchdog.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from polyrl.distributed.collectives import broadcast_from_leader
from polyrl.distributed.watchdog import Watchdog
from polyrl.weights.backend_broadcast import BackendBroadcast
from polyrl.weights.base import NamedTensors, TransferStats, WeightSyncError, as_stream
from polyrl.weights.bucketing import WeightManifest, device_mismatch, plan_buckets
from polyrl.weights.config import WeightSyncConfig
from polyrl.weights.handoff import shared_memory_possible
from polyrl.weights.shm import SenderRing, attach
from polyrl.weights.shm_broadcast import SharedMemoryBroadcast
from polyrl.weights.sync_group import SyncGroup

CHOOSE_PHASE = "weight sync: choose data path"
MISMATCH, BACKEND, SHARED_MEMORY = 0, 1, 2
"""The choose-phase vote, its minimum over the group: a receiver stages on another device type
than the sender packs on / every byte through the backend / the shared-memory ring."""


class BroadcastTransport:
    name = "broadcast"

    def __init__(self, config: WeightSyncConfig | None = None, *, group: Any,
                 watchdog: Watchdog | None = None, device: torch.device | None = None):
        self.config = config or WeightSyncConfig(transport="broadcast")
        self.sync = SyncGroup(group, watchdog, device)
        self.path: BackendBroadcast | SharedMemoryBroadcast | None = None
        """The data path, once the first transfer chose it."""
        self.last_stats: TransferStats | None = None

    # --- trainer leader ----------------------------------------------------------------------
    def send(self, named_tensors: NamedTensors, version: int) -> TransferStats:
        sync = self.sync
        if not sync.is_sender:
            raise WeightSyncError(f"send() runs on the weight-sync group's leader (global rank "
                                  f"{sync.src}); this is rank {dist.get_rank()}: call receive()")
        sync.at_version(version)
        stream = as_stream(named_tensors)
        manifest = plan_buckets(stream.specs, version, self.config.bucket_bytes, sync.device.type)
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.config.timeout_s
        if self.path is None:
            self.path = self._offer(manifest, deadline)
        failure = self.path.send(manifest, stream, deadline)
        if failure is not None:
            where, exc = failure
            raise WeightSyncError(f"sending version {version} failed at {where} "
                                  f"({type(exc).__name__}: {exc}); receivers discarded it and keep "
                                  "their previous weights") from exc
        self.last_stats = self._stats(manifest, t0)
        return self.last_stats

    def _offer(self, manifest: WeightManifest, deadline: float):
        """Choose the data path with the receivers: offer a shared-memory ring when it may
        work, and take it only if every receiver opened it; every receiver also checks that it
        stages on the device type the buckets are packed on."""
        sync = self.sync
        ring = self._new_ring(manifest)
        try:
            broadcast_from_leader({"offer": ring and ring.offer(), "device": sync.device.type}, sync.group,
                                  timeout_s=self.config.timeout_s, phase=CHOOSE_PHASE,
                                  watchdog=sync.watchdog)
            agreed = sync.vote_min(CHOOSE_PHASE, deadline, SHARED_MEMORY if ring is not None else BACKEND)
        except BaseException:
            if ring is not None:
                ring.close()
            raise
        if agreed == MISMATCH:
            if ring is not None:
                ring.close()
            raise WeightSyncError(f"weight sync: a receiver among ranks {sync.receivers} does not stage "
                                  f"on {sync.device.type}, where this sender packs the buckets (each "
                                  "such receiver's error names its device); nothing was sent")
        if agreed == SHARED_MEMORY:
            ring.connect()  # every receiver has it open: nothing can leak from here on
            return SharedMemoryBroadcast(self.config, self.sync, ring)
        if ring is not None:
            ring.close()
        return BackendBroadcast(self.config, self.sync)

    def _new_ring(self, manifest: WeightManifest) -> SenderRing | None:
        """A segment for the whole stream (direct staging), else a ring; None where shared
        memory cannot carry these weights (off, packed on a device, nobody to send to) or
        /dev/shm is missing or full."""
        cfg = self.config
        on_cpu = shared_memory_possible(self.sync.device.type)
        if not cfg.shared_memory or not on_cpu or not manifest.slots or not self.sync.receivers:
            return None
        ring_bytes = cfg.shm_slots * cfg.shm_slot_bytes
        total = manifest.stream_layout()[1]
        sizes = ([max(_round_up(total), ring_bytes)] if cfg.shm_direct else []) + [ring_bytes]
        for capacity in sizes:
            try:
                return SenderRing(capacity, len(self.sync.receivers))
            except OSError:
                continue
        return None

    # --- rollout ranks -----------------------------------------------------------------------
    def receive(self, engine: Any) -> int:
        sync = self.sync
        if sync.is_sender:
            raise WeightSyncError(f"rank {sync.src} leads the weight-sync group: call send()")
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.config.timeout_s
        if self.path is None:
            self.path = self._accept(deadline)
        manifest = self.path.receive(engine, deadline)
        self.last_stats = self._stats(manifest, t0)
        return manifest.version

    def _accept(self, deadline: float):
        """The receiving half of `_offer`: open the offered ring if this rank can, and vote."""
        sync = self.sync
        msg = broadcast_from_leader(None, sync.group, timeout_s=self.config.timeout_s,
                                    phase=CHOOSE_PHASE, watchdog=sync.watchdog)
        if not isinstance(msg, dict) or "offer" not in msg:
            raise WeightSyncError(f"weight sync: the leader sent a {type(msg).__name__}, not the "
                                  "data-path offer (are both sides on the same polyrl version?)")
        offer, packed = msg["offer"], msg.get("device", "cpu")
        staging = sync.device.type
        on_cpu = shared_memory_possible(staging) and shared_memory_possible(packed)
        ring = attach(offer, sync.receivers.index(dist.get_rank())) if offer is not None and on_cpu else None
        mine = MISMATCH if packed != staging else SHARED_MEMORY if ring is not None else BACKEND
        try:
            agreed = sync.vote_min(CHOOSE_PHASE, deadline, mine)
        except BaseException:
            if ring is not None:
                ring.close()
            raise
        if agreed == MISMATCH:
            if ring is not None:
                ring.close()
            if mine == MISMATCH:
                raise WeightSyncError(device_mismatch(f"rank {dist.get_rank()}", staging, packed))
            raise WeightSyncError(f"weight sync: another receiver does not stage on {packed}, where "
                                  "the sender packs the buckets (its own error names its device)")
        if agreed == SHARED_MEMORY:
            return SharedMemoryBroadcast(self.config, sync, ring)
        if ring is not None:
            ring.close()
        return BackendBroadcast(self.config, sync)

    # --- both --------------------------------------------------------------------------------
    def _stats(self, manifest: WeightManifest, t0: float) -> TransferStats:
        return TransferStats(self.name, manifest.version, manifest.num_tensors, len(manifest.buckets),
                             manifest.total_bytes, time.perf_counter() - t0)

    def buffer_bytes(self) -> dict[str, int]:
        """What this transport keeps between transfers: private scratch buckets (the backend
        path's sender) and the shared-memory segment (the receivers' staging, in /dev/shm)."""
        path = self.path
        if isinstance(path, BackendBroadcast):
            return {"scratch": sum(b.numel() for b in path._scratch if b is not None), "shared": 0}
        if isinstance(path, SharedMemoryBroadcast) and path.ring is not None:
            return {"scratch": 0, "shared": path.ring.nbytes}
        return {"scratch": 0, "shared": 0}

    @property
    def uses_shared_memory(self) -> bool:
        return isinstance(self.path, SharedMemoryBroadcast)

    def close(self) -> None:
        if self.path is not None:
            self.path.close()


def _round_up(n: int, to: int = 64) -> int:
    return max(-(-n // to) * to, to)
