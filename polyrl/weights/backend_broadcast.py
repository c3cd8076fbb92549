"""The broadcast transport's backend path: every byte through the group's communication backend
(other hosts, device tensors, or `weights.shared_memory: false`).

    manifest   pickled broadcast from the leader
    buckets    one broadcast per bucket, raw bytes; the sender packs bucket i+1 (pulling its
               tensors from the weight stream) while bucket i is on the wire, and holds at most
               two buckets
    commit     [version, buckets, ok]: ok=0 when the sender failed midway, and receivers
               discard what they staged

Buckets are packed and staged on `SyncGroup.device` on both ends (NCCL carries them on a GPU
platform, gloo on the CPU); the manifest names the sender's device type and a receiver staging
elsewhere refuses it. Manifest and commit are CPU messages (gloo on every platform).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Iterable

import torch
import torch.distributed as dist

from polyrl.distributed.collectives import broadcast_from_leader
from polyrl.distributed.watchdog import Watch
from polyrl.weights import bucketing
from polyrl.weights.base import WeightSyncError
from polyrl.weights.bucketing import StagedWeights, WeightManifest, flat_staging, staging_views
from polyrl.weights.sync_group import SyncGroup

IN_FLIGHT = 2


class BackendBroadcast:
    def __init__(self, config: Any, sync: SyncGroup):
        self.config, self.sync = config, sync
        self._scratch: list[torch.Tensor | None] = [None] * IN_FLIGHT
        self._manifest: WeightManifest | None = None
        self._scratch_bytes = 0
        self._staging: torch.Tensor | None = None

    # --- sender ------------------------------------------------------------------------------
    def send(self, manifest: WeightManifest, stream: Iterable[tuple[str, torch.Tensor]], deadline: float):
        """Deliver one version, packing each bucket from `stream` as its turn comes; returns
        (where, exception) if packing failed midway (the receivers were told to discard it),
        else None."""
        sync, phase = self.sync, f"weight sync v{manifest.version}"
        broadcast_from_leader({"manifest": manifest}, sync.group, timeout_s=self.config.timeout_s,
                              phase=f"{phase}: manifest", watchdog=sync.watchdog)
        watch = sync.watchdog.watch(sync.group, phase=f"{phase}: buckets", what="weight broadcast",
                                    timeout_s=max(deadline - time.monotonic(), 0.001))
        self._manifest = manifest
        self._scratch_bytes = max((s.nbytes for s in manifest.buckets if s.num_slots > 1), default=0)
        failure = self._send_buckets(manifest, stream, watch)
        commit = torch.tensor([manifest.version, len(manifest.buckets), 0 if failure else 1], dtype=torch.int64)
        watch.wait(dist.broadcast(sync.control(commit), src=sync.src, group=sync.group, async_op=True))
        return failure

    def _send_buckets(self, manifest: WeightManifest, stream: Iterable[tuple[str, torch.Tensor]], watch: Watch):
        """At most IN_FLIGHT buckets are alive: bucket b is packed (its tensors pulled from the
        stream) once bucket b - IN_FLIGHT is on the wire, and each bucket, with the tensors it
        holds, is dropped as soon as its broadcast completes."""
        device = self.sync.device  # every bucket on it, whatever device each tensor is on
        buckets = bucketing.iter_buckets(manifest, stream, self._scratch_for, device=device)
        inflight: deque = deque()
        failure: tuple[str, BaseException] | None = None
        for b, spec in enumerate(manifest.buckets):
            if len(inflight) >= IN_FLIGHT:  # scratch[b % 2] is free once bucket b-2 is sent
                watch.wait(inflight.popleft()[0])
            flat = None
            if failure is None:
                try:
                    _, flat = next(buckets)
                except Exception as exc:  # keep the collective sequence aligned, then abort
                    failure = (f"bucket {b}", exc)
            if flat is None:  # the aborted bucket's stand-in: the receivers still expect it
                flat = torch.empty(spec.nbytes, dtype=torch.uint8, device=device)
            inflight.append((dist.broadcast(flat, src=self.sync.src, group=self.sync.group, async_op=True), flat))
            del flat
        while inflight:
            watch.wait(inflight.popleft()[0])
        return failure

    def _scratch_for(self, b: int, device: torch.device) -> torch.Tensor:
        """Scratch buffer b % IN_FLIGHT, as big as the largest packed bucket and reused across
        versions (no page faults); a lone non-contiguous tensor bigger than that gets its own."""
        if self._manifest.buckets[b].nbytes > self._scratch_bytes:
            return torch.empty(self._manifest.buckets[b].nbytes, dtype=torch.uint8, device=device)
        i = b % IN_FLIGHT
        buf = self._scratch[i]
        if buf is None or buf.device != device or buf.numel() < self._scratch_bytes:
            buf = self._scratch[i] = torch.empty(self._scratch_bytes, dtype=torch.uint8, device=device)
        return buf

    # --- receivers ---------------------------------------------------------------------------
    def receive(self, engine: Any, deadline: float) -> WeightManifest:
        """Stage the next version, then apply it in one `engine.update_weights` call."""
        sync = self.sync
        msg = broadcast_from_leader(None, sync.group, timeout_s=self.config.timeout_s,
                                    phase="weight sync: manifest", watchdog=sync.watchdog)
        manifest = msg.get("manifest") if isinstance(msg, dict) else None
        if not isinstance(manifest, WeightManifest):
            raise WeightSyncError(f"weight sync: the leader sent a {type(msg).__name__}, not a "
                                  "manifest (are both sides on the same polyrl version?)")
        sync.at_version(manifest.version)
        manifest.check_device(sync.device.type, f"rank {dist.get_rank()}")
        staged = StagedWeights(manifest, staging_views(manifest, self._staging_for(manifest)))
        self._receive_buckets(manifest, staged, deadline)
        staged.apply(engine)
        return manifest

    def _receive_buckets(self, manifest: WeightManifest, staged: StagedWeights, deadline: float) -> None:
        sync = self.sync
        watch = sync.watchdog.watch(sync.group, phase=f"weight sync v{manifest.version}: buckets",
                                    what="weight broadcast",
                                    timeout_s=max(deadline - time.monotonic(), 0.001))
        works = [dist.broadcast(staged.buffer(b), src=sync.src, group=sync.group, async_op=True)
                 for b in range(len(manifest.buckets))]
        for b, work in enumerate(works):
            watch.wait(work)
            staged.mark(b)
        commit = sync.control(torch.zeros(3, dtype=torch.int64))
        watch.wait(dist.broadcast(commit, src=sync.src, group=sync.group, async_op=True))
        got = [int(x) for x in commit.cpu()]
        if got[2] != 1:
            raise WeightSyncError(f"the sender aborted version {manifest.version} midway; "
                                  "discarded, the previous weights stay in service")
        if got[:2] != [manifest.version, len(manifest.buckets)]:
            raise WeightSyncError(f"commit {got[:2]} does not match manifest (version "
                                  f"{manifest.version}, {len(manifest.buckets)} buckets); discarded")

    def _staging_for(self, manifest: WeightManifest) -> torch.Tensor:
        total = manifest.stream_layout()[1]
        if self._staging is None or self._staging.numel() != total:  # reused: no page faults
            self._staging = flat_staging(manifest, self.sync.device)
        return self._staging

    def close(self) -> None:
        self._scratch, self._staging = [None] * IN_FLIGHT, None
