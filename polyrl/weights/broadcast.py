"""Standalone placement: bucketed broadcast from the sync group's leader over torch.distributed.

The group is the layout's `weight_sync` group (trainer leader + every rollout rank) on the
platform's communication backend (gloo on CPU). The source is the group's leader, never a
literal rank 0. One transfer is:

    manifest   names, shapes, dtypes, bucket layout, version   (pickled, from the leader)
    buckets    one broadcast per bucket, raw bytes; the sender packs bucket i+1 while bucket i
               is on the wire and holds at most two scratch buckets
    commit     [version, buckets, ok]: ok=0 when the sender failed midway

When every rank can map the sender's shared memory (CPU tensors, one host: checked at the first
transfer), bucket bytes go through two shared slots instead and the collective carries one
small all-reduce per bucket (`shm.py`): same manifest, same deadlines, same commit.

Receivers stage every bucket, check the commit, then apply with one `engine.update_weights`.
Staging memory is reused across versions (engines copy what they load). Every wait has the
transfer's deadline; a rank that does not arrive is named (watchdog).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from polyrl.distributed.collectives import broadcast_from_leader
from polyrl.distributed.layout import group_leader
from polyrl.distributed.watchdog import Watch, Watchdog, default_watchdog
from polyrl.weights import bucketing
from polyrl.weights.base import NamedTensors, TransferStats, WeightSyncError, named_items
from polyrl.weights.bucketing import StagedWeights, WeightManifest, as_bytes, plan_buckets
from polyrl.weights.config import WeightSyncConfig
from polyrl.weights.shm import SLOTS, ShmRing, attach

IN_FLIGHT = 2


class BroadcastTransport:
    name = "broadcast"

    def __init__(self, config: WeightSyncConfig | None = None, *, group: Any,
                 watchdog: Watchdog | None = None, device: torch.device | None = None):
        self.config = config or WeightSyncConfig(transport="broadcast")
        self.group = group
        self.src = group_leader(group)
        self.device = device
        """Where receivers stage buckets (the platform's device for device backends)."""
        self._watchdog = watchdog
        self._scratch: list[torch.Tensor] = []
        self._ring: ShmRing | None = None
        self._agreed: list[str] | None = None  # ring names every receiver has mapped
        self._staging: list[torch.Tensor] | None = None
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
        offer = self._shm_offer(manifest, ordered)
        broadcast_from_leader({"manifest": manifest, "shm": offer}, self.group,
                              timeout_s=self.config.timeout_s, phase=f"{phase}: manifest",
                              watchdog=self.watchdog)
        watch = self.watchdog.watch(self.group, phase=f"{phase}: buckets",
                                    timeout_s=self.config.timeout_s, what="weight broadcast")
        use_shm = offer is not None and (not offer["vote"] or self._step_signal(watch, True))
        if offer is not None and not use_shm:
            self._close_ring()  # some receiver cannot map it: plain path (a new ring next time)
        if use_shm:
            assert self._ring is not None
            self._ring.unlink()  # every receiver has it mapped: nothing can leak from here on
            self._agreed = self._ring.names
            failure = self._send_shm(manifest, ordered, watch)
        else:
            failure = self._send_plain(manifest, ordered, watch)
        commit = torch.tensor([version, len(manifest.buckets), 0 if failure else 1], dtype=torch.int64)
        watch.wait(dist.broadcast(self._control(commit), src=self.src, group=self.group, async_op=True))
        if failure is not None:
            b, exc = failure
            raise WeightSyncError(f"sending version {version} failed at bucket {b} "
                                  f"({type(exc).__name__}: {exc}); receivers discarded it and keep "
                                  "their previous weights") from exc
        stats = TransferStats(self.name, version, manifest.num_tensors, len(manifest.buckets),
                              manifest.total_bytes, time.perf_counter() - t0)
        self.last_stats = stats
        return stats

    def _send_plain(self, manifest: WeightManifest, ordered: list[torch.Tensor], watch: Watch):
        need = max((s.nbytes for s in manifest.buckets if s.num_slots > 1), default=0)
        if not self._scratch or self._scratch[0].numel() < need:  # reused: no page faults
            device = ordered[0].device if ordered else None
            self._scratch = [torch.empty(need, dtype=torch.uint8, device=device) for _ in range(IN_FLIGHT)]
        inflight: deque = deque()
        failure: tuple[int, BaseException] | None = None
        for b, spec in enumerate(manifest.buckets):
            if len(inflight) >= IN_FLIGHT:  # scratch[b % 2] is free once bucket b-2 is sent
                watch.wait(inflight.popleft())
            flat = None
            if failure is None:
                try:
                    flat = as_bytes(bucketing.pack_bucket(manifest, b, ordered, self._scratch[b % IN_FLIGHT]))
                except Exception as exc:  # keep the collective sequence aligned, then abort
                    failure = (b, exc)
            if flat is None:
                flat = torch.empty(spec.nbytes, dtype=torch.uint8, device=self._scratch[0].device)
            inflight.append(dist.broadcast(flat, src=self.src, group=self.group, async_op=True))
        while inflight:
            watch.wait(inflight.popleft())
        return failure

    def _send_shm(self, manifest: WeightManifest, ordered: list[torch.Tensor], watch: Watch):
        ring = self._ring
        assert ring is not None
        failure: tuple[int, BaseException] | None = None
        for b in range(len(manifest.buckets)):
            # Slot b % 2 held bucket b-2; the previous step's signal said every receiver copied it.
            if failure is None:
                try:
                    bucketing.pack_into(manifest, b, ordered, ring.slots[b % SLOTS])
                except Exception as exc:
                    failure = (b, exc)
            self._step_signal(watch, failure is None)  # "bucket b is in its slot" (or: abort)
        self._step_signal(watch, failure is None)  # receivers have copied the last bucket
        return failure

    def _shm_offer(self, manifest: WeightManifest, ordered: list[torch.Tensor]) -> dict | None:
        if not self.config.shared_memory or not ordered:
            return None
        if any(t.device.type != "cpu" for t in ordered):
            return None
        need = max(s.nbytes for s in manifest.buckets)
        if self._ring is None or self._ring.nbytes < need:
            self._close_ring()
            try:
                self._ring = ShmRing(need)
            except OSError:  # no /dev/shm, or it is full
                return None
            self._ring.write_token()
        return {"names": self._ring.names, "nbytes": self._ring.nbytes, "token": self._ring.token,
                "vote": self._ring.names != self._agreed}  # every receiver mapped it before

    def _close_ring(self) -> None:
        self._agreed = None
        if self._ring is not None:
            self._ring.close()
            self._ring = None

    # --- rollout ranks -----------------------------------------------------------------------
    def receive(self, engine: Any) -> int:
        if self.is_sender:
            raise WeightSyncError(f"rank {self.src} leads the weight-sync group: call send()")
        t0 = time.perf_counter()
        msg = broadcast_from_leader(None, self.group, timeout_s=self.config.timeout_s,
                                    phase="weight sync: manifest", watchdog=self.watchdog)
        manifest = msg.get("manifest") if isinstance(msg, dict) else None
        if not isinstance(manifest, WeightManifest):
            raise WeightSyncError(f"weight sync: the leader sent a {type(msg).__name__}, not a "
                                  "manifest (are both sides on the same polyrl version?)")
        version = manifest.version
        watch = self.watchdog.watch(self.group, phase=f"weight sync v{version}: buckets",
                                    timeout_s=self.config.timeout_s, what="weight broadcast")
        offer = msg.get("shm")
        if offer is not None and offer["vote"]:
            use_shm = self._step_signal(watch, self._attach(offer))
        else:  # the ring we already map (a receiver that cannot map it voted no before)
            use_shm = offer is not None and self._ring is not None and self._ring.names == offer["names"]
        staged = StagedWeights(manifest, self._staging_for(manifest), device=self.device)
        if use_shm:
            aborted = self._receive_shm(manifest, staged, watch)
        else:
            works = [dist.broadcast(staged.buffer(b), src=self.src, group=self.group, async_op=True)
                     for b in range(len(manifest.buckets))]
            for b, work in enumerate(works):
                watch.wait(work)
                staged.mark(b)
            aborted = False
        commit = self._control(torch.zeros(3, dtype=torch.int64))
        watch.wait(dist.broadcast(commit, src=self.src, group=self.group, async_op=True))
        got = [int(x) for x in commit.cpu()]
        if aborted or got[2] != 1:
            raise WeightSyncError(f"the sender aborted version {version} midway; discarded, the "
                                  "previous weights stay in service")
        if got[:2] != [version, len(manifest.buckets)]:
            raise WeightSyncError(f"commit {got[:2]} does not match manifest (version {version}, "
                                  f"{len(manifest.buckets)} buckets); discarded")
        applied = staged.apply(engine)
        self.last_stats = TransferStats(self.name, version, manifest.num_tensors,
                                        len(manifest.buckets), manifest.total_bytes,
                                        time.perf_counter() - t0)
        return applied

    def _receive_shm(self, manifest: WeightManifest, staged: StagedWeights, watch: Watch) -> bool:
        ring = self._ring
        assert ring is not None
        aborted = False
        for b, spec in enumerate(manifest.buckets):
            # One signal per bucket: "I copied bucket b-1" from us, "bucket b is ready" (or abort)
            # from the sender; then we copy b while the sender packs b+1 into the other slot.
            if not self._step_signal(watch, True):
                aborted = True
            if not aborted:
                staged.buffer(b).copy_(ring.slots[b % SLOTS][: spec.nbytes])
                staged.mark(b)
        self._step_signal(watch, True)
        return aborted

    def _attach(self, offer: dict) -> bool:
        if self.device is not None and self.device.type != "cpu":
            return False
        if self._ring is not None and self._ring.names == offer["names"]:
            return True
        self._close_ring()
        self._ring = attach(offer["names"], offer["nbytes"], offer["token"])
        return self._ring is not None

    def _staging_for(self, manifest: WeightManifest) -> list[torch.Tensor]:
        sizes = [s.nbytes for s in manifest.buckets]
        if self._staging is None or [t.numel() for t in self._staging] != sizes:
            self._staging = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
        return self._staging

    # --- control messages --------------------------------------------------------------------
    def _step_signal(self, watch: Watch, ok: bool) -> bool:
        """One all-reduce (MIN) over the group: every rank reached this step, all with ok."""
        flag = self._control(torch.tensor([int(ok)], dtype=torch.int64))
        watch.wait(dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group, async_op=True))
        return bool(int(flag.cpu()[0]))

    def _control(self, t: torch.Tensor) -> torch.Tensor:
        """Small control tensors live where the backend wants them (the staging device)."""
        return t if self.device is None else t.to(self.device)
