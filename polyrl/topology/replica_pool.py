"""The asynchronous run's rollout replicas: start them, replace dead ones, keep each on the newest
published policy version.

Replicas are `StreamingReplica` Ray actors (threaded: generation calls and weight receives run
at once). Weights reach them through the Ray object store (`weights/object_store.py`): the policy
leader publishes each version to a mailbox actor; a replica fetches the newest version when told
to, and a replacement replica fetches it at start-up. Nothing here blocks: the driver's
`RolloutStream` waits on the refs this pool hands out.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from polyrl.topology.worker_group import WorkerGroup
from polyrl.workers.streaming_replica import StreamingReplica
from polyrl.job import JobConfig

logger = logging.getLogger(__name__)


class ReplicaPool(WorkerGroup):
    """`workers[i]` is replica i's current actor (replaced in place on restart)."""

    def __init__(self, cfg: JobConfig, launch: Any, mailbox: Any):
        """`launch`: the run's `Launch` (topology/base.py); replica i starts, and restarts, with
        its own planned options (its node and devices), as `polyrl train --dry-run` shows."""
        self.cfg, self.mailbox = cfg, mailbox
        self.specs = launch.of("rollout")
        self.options = [launch.options[s.name] for s in self.specs]
        self.cls = ray.remote(StreamingReplica)
        n = cfg.rollout.num_replicas
        super().__init__([self._new(i) for i in range(n)], [f"rollout replica {i}" for i in range(n)],
                         cfg.ray.timeout_s, helpers=[mailbox])
        self.versions = [0] * n
        """The weight version each replica serves (-1: dead or starting)."""
        self.restarts = 0

    def _new(self, index: int) -> Any:
        return self.cls.options(**self.options[index]).remote(self.cfg, self.specs[index].plan, self.mailbox)

    def restart(self, index: int) -> Any:
        """Replace replica `index` with a new actor; returns the ref of its setup (which fetches
        the newest published weights)."""
        ray.kill(self.workers[index])  # a no-op for an actor that is already dead
        self.restarts += 1
        logger.warning("rollout replica %d died; starting a replacement (restart %d)", index, self.restarts)
        self.workers[index] = self._new(index)
        self.versions[index] = -1  # unusable until its setup returns
        return self.workers[index].setup.remote()

    def shutdown(self) -> None:
        for w in self.workers + self.helpers:  # replicas hold nothing to flush
            ray.kill(w)
