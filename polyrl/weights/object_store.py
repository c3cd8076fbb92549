"""Fallback transport through Ray's object store, for when no collective group can be formed
(replicas added later, mixed backends, debugging).

The sender packs buckets exactly as the broadcast transport does, but always in host memory (the
object store holds host bytes; the manifest says "cpu"), puts each in the object store (raw
bytes, so any dtype travels) and publishes (version, manifest, refs) to a `WeightMailbox`
actor. Receivers wait on the mailbox for a version newer than their engine's, fetch every bucket
with a deadline and apply all or nothing: the engine gets host tensors (no process group, no
device on either end; an engine on a device copies them in). The sender owns the objects: if it dies before a
receiver has fetched them, the fetch fails and the receiver keeps its previous weights.

With `weights.background_publish` (the default; trainer.mode=async only: in sync mode the
receivers wait for the version at once, so nothing would overlap) `send()` only snapshots the
version into host buffers of its own and returns; a background thread puts them in the store and
publishes them, overlapping the trainer's next step (a 3 MB `ray.put` alone takes 3-10 ms on a
2-core machine). One publication is in flight at a time: the next `send()` (or `flush()`)
waits for it and raises its error, if any. Receivers are unaffected: they wait on the mailbox
for the version.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import ray
import torch

from polyrl.distributed.waits import RemoteTimeout, gather
from polyrl.weights.base import NamedTensors, TransferStats, WeightSyncError, as_stream
from polyrl.weights.bucketing import StagedWeights, WeightManifest, iter_buckets, plan_buckets
from polyrl.weights.config import WeightSyncConfig


HOST = torch.device("cpu")
"""Where this transport packs and stages on both ends: the object store holds host bytes."""


class WeightMailbox:
    """Holds the latest published version's manifest and object refs (a Ray actor)."""

    def __init__(self) -> None:
        self._latest: tuple[int, WeightManifest, list] | None = None
        self._changed = asyncio.Condition()

    async def publish(self, version: int, manifest: WeightManifest, refs: list) -> int:
        if self._latest is not None and version <= self._latest[0]:
            raise WeightSyncError(f"version {version} is not newer than the published "
                                  f"{self._latest[0]}")
        async with self._changed:
            self._latest = (version, manifest, refs)
            self._changed.notify_all()
        return version

    async def fetch(self, newer_than: int, timeout_s: float) -> tuple[int, WeightManifest, list] | None:
        """The latest publication with version > `newer_than`, waiting up to `timeout_s`."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(
                    lambda: self._latest is not None and self._latest[0] > newer_than), timeout_s)
            except asyncio.TimeoutError:
                return None
        return self._latest

    def latest_version(self) -> int | None:
        return None if self._latest is None else self._latest[0]


def create_mailbox(name: str | None = None, namespace: str | None = None) -> Any:
    """Start (or find, when `name` is given) a mailbox actor. Needs a running Ray."""
    cls = ray.remote(num_cpus=0, max_concurrency=64)(WeightMailbox)
    options: dict[str, Any] = {}
    if name:
        options.update(name=name, get_if_exists=True)
        if namespace:
            options["namespace"] = namespace
    return cls.options(**options).remote()


class ObjectStoreTransport:
    name = "object_store"

    def __init__(self, config: WeightSyncConfig | None = None, *, mailbox: Any):
        self.config = config or WeightSyncConfig(transport="object_store")
        self.mailbox = mailbox
        self._scratch: torch.Tensor | None = None
        self._published: list = []  # keep our refs alive until the next version replaces them
        self._publisher: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._snapshot: list[torch.Tensor] = []
        self.publish_s = 0.0
        """Seconds the last finished publication took (put + mailbox); with background_publish,
        the previous version's, which ran beside the trainer's step."""
        self.last_stats: TransferStats | None = None

    def send(self, named_tensors: NamedTensors, version: int) -> TransferStats:
        self.flush()  # one publication in flight at a time; raises the previous one's error
        stream = as_stream(named_tensors)
        manifest = plan_buckets(stream.specs, version, self.config.bucket_bytes)
        t0 = time.perf_counter()
        if self.config.background_publish:
            # a snapshot the trainer's next step cannot change: one host copy per bucket, in
            # buffers reused from version to version (the previous publication has finished),
            # filled from the stream tensor by tensor
            sizes = [spec.nbytes for spec in manifest.buckets]
            if [b.numel() for b in self._snapshot] != sizes:
                self._snapshot = [torch.empty(n, dtype=torch.uint8) for n in sizes]
            for _ in iter_buckets(manifest, stream, lambda b, _device: self._snapshot[b], zero_copy=False):
                pass
            if self._publisher is None:
                self._publisher = ThreadPoolExecutor(1, thread_name_prefix="weight-publish")
            self._pending = self._publisher.submit(self._put_and_publish, version, manifest,
                                                   [b.numpy() for b in self._snapshot])
        else:
            # packed and put in the store one bucket at a time: a bucket and its tensors are
            # dropped once put (the store holds the copy)
            def scratch(b: int, device: torch.device) -> torch.Tensor:  # one, reused bucket after bucket
                need = manifest.buckets[b].nbytes
                if self._scratch is None or self._scratch.device != device or self._scratch.numel() < need:
                    self._scratch = torch.empty(need, dtype=torch.uint8, device=device)
                return self._scratch

            self._put_and_publish(version, manifest, (
                flat.numpy() for _, flat in iter_buckets(manifest, stream, scratch, device=HOST)))
        stats = TransferStats(self.name, version, manifest.num_tensors, len(manifest.buckets),
                              manifest.total_bytes, time.perf_counter() - t0)
        self.last_stats = stats
        return stats

    def _put_and_publish(self, version: int, manifest: WeightManifest, arrays) -> None:
        t0 = time.perf_counter()
        refs = [ray.put(a) for a in arrays]
        gather([self.mailbox.publish.remote(version, manifest, refs)], ["weight mailbox"],
               phase=f"weight sync v{version}: publish", timeout_s=self.config.timeout_s)
        self._published = refs  # keep our objects alive until the next version replaces them
        self.publish_s = time.perf_counter() - t0

    def flush(self) -> None:
        """Wait for the publication in flight (if any); raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Finish the publication in flight and stop the publishing thread."""
        try:
            self.flush()
        finally:
            if self._publisher is not None:
                self._publisher.shutdown(wait=True)
                self._publisher = None

    def receive(self, engine: Any) -> int:
        timeout = self.config.timeout_s
        current = int(engine.weight_version)
        t0 = time.perf_counter()
        [found] = gather([self.mailbox.fetch.remote(current, timeout)], ["weight mailbox"],
                         phase="weight sync: wait for a new version", timeout_s=timeout + 10)
        if found is None:
            raise RemoteTimeout(f"weight sync: wait for a version newer than {current}",
                                ["weight sender (nothing published)"], timeout)
        version, manifest, refs = found
        manifest.check_device(HOST.type, "this object-store receiver")
        names = [f"weight bucket {b} of v{version}" for b in range(len(refs))]
        try:
            arrays = gather(refs, names, phase=f"weight sync v{version}: fetch", timeout_s=timeout)
        except RemoteTimeout:
            raise
        except Exception as exc:  # owner died, object lost: the version never arrives whole
            raise WeightSyncError(f"version {version} could not be fetched ({type(exc).__name__}); "
                                  "the previous weights stay in service") from exc
        with warnings.catch_warnings():  # store objects are read-only; we only read them
            warnings.simplefilter("ignore", UserWarning)
            buffers = [torch.from_numpy(a) for a in arrays]
        staged = StagedWeights(manifest, buffers)
        for b in range(len(buffers)):
            staged.mark(b)
        applied = staged.apply(engine)
        self.last_stats = TransferStats(self.name, version, manifest.num_tensors, len(refs),
                                        manifest.total_bytes, time.perf_counter() - t0)
        return applied
