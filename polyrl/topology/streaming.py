"""Streaming rollout (trainer.mode=async, disaggregated replicas; `STREAMING` in
polyrl/distributed/topologies.py): replicas keep generating while the policy trains, under a
staleness bound (rollout_stream.py, docs/async.md).

The policy group is built with the stream's `gather` as its waiter, so every wait on the policy
(update, log-probs, checkpoint) keeps the replicas fed: an explicit constructor argument, decided
here, instead of a hidden swap. Weights go through the Ray object store (weights/object_store.py):
the policy leader publishes each version to a mailbox, replicas fetch it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from polyrl.batch import RolloutBatch
from polyrl.distributed.topologies import STREAMING
from polyrl.distributed.waits import gather
from polyrl.rollout.base import SamplingParams
from polyrl.rollout.launch_args import needs_first_sync
from polyrl.topology.base import (Topology, TrainingError, attach_prompts, plan, rendezvous, setup_all, start_policy,
                                  train_sampling)
from polyrl.topology.replica_pool import ReplicaPool
from polyrl.topology.rollout_stream import RolloutStream
from polyrl.weights.object_store import create_mailbox


class StreamingTopology(Topology):
    spec = STREAMING

    def start(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        self.launch = plan(ctx)
        mailbox = create_mailbox()
        self.pool = ReplicaPool(cfg, self.launch, mailbox)
        self.stream = RolloutStream(cfg, self.pool, ctx.loader, ctx.score, train_sampling(cfg))
        self.policy = start_policy(ctx, self.launch, waiter=self.stream.gather)
        address = rendezvous(self.policy, cfg.actor.world_size > 1)
        versions = setup_all(self.policy, self.policy.refs("setup", address, mailbox)
                             + self.pool.refs("setup"), self.pool.names)
        self.pool.versions = list(versions)
        if needs_first_sync(cfg.rollout, colocated=self.spec.colocated_engine):
            self._fill_replicas()
        self.last_batch_at = time.perf_counter()

    def _fill_replicas(self) -> None:
        """FP8 replicas start on dummy weights (R4): they receive the policy before any rollout."""
        refs = self.policy.refs("sync_weights", False) + self.pool.refs("receive_weights")
        gather(refs, self.policy.names + self.pool.names, phase="weight sync", timeout_s=self.cfg.ray.timeout_s)

    def next_batch(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        with self.ctx.timer("generate"):  # waiting for finished groups: the trainer's idle time
            groups, metrics = self.stream.take_batch()
        batch = RolloutBatch.cat([g.samples for g in groups])
        # generation overlaps training: its rate is tokens per wall-second of the trainer's step
        now = time.perf_counter()
        metrics["perf/generate_tokens_per_s"] = float(batch.response_lengths.sum()) / max(now - self.last_batch_at, 1e-9)
        self.last_batch_at = now
        return batch, metrics

    def publish(self, bump: bool = True) -> dict[str, float]:
        """Publish to the mailbox; replicas fetch it while generating."""
        results = self.policy.call("sync_weights", bump, phase="weight sync")
        self.stream.published(results[0]["weight_sync/version"] if results[0] else self.stream.version)
        return results[0]

    def generate(self, prompts: Sequence[Any], sampling: SamplingParams, seeds: list[int],
                 phase: str) -> RolloutBatch:
        """Measures the current policy, not a replica still behind it; a replica that dies is
        replaced and its shard rerun."""
        self.stream.wait_replicas_current(phase)
        batch = self.stream.generate_sharded(list(prompts), sampling, seeds, phase)
        return attach_prompts(batch, prompts)

    def state_dict(self) -> dict[str, Any]:
        return {"async": self.stream.state_dict()}  # drawn but untrained prompts

    def load_state_dict(self, driver_state: dict[str, Any], source: str) -> None:
        if "async" not in driver_state:
            raise TrainingError(f"{source} was written by a trainer.mode=sync run; resume it with "
                                "trainer.mode=sync or start fresh (trainer.resume=off)")
        self.stream.load_state_dict(driver_state["async"])

    def shutdown(self) -> None:
        stream = getattr(self, "stream", None)
        if stream is not None:
            stream.close()  # dispatch nothing more
        try:
            super().shutdown()  # the policy ranks first: a publication in flight lands in the mailbox
        finally:
            pool = getattr(self, "pool", None)
            if pool is not None:
                pool.shutdown()
