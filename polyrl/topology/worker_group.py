"""The run's Ray actors as groups (policy ranks; standalone rollout replicas): start them with
their planned environment, fan calls out, gather answers with a deadline that names any actor
that does not answer."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import ray

from polyrl.distributed.waits import gather
from polyrl.platform import Platform
from polyrl.workers.batch import Sample, split_evenly
from polyrl.workers.policy import PolicyWorker


class WorkerGroup:
    """Ray actors of one kind, called together, answers gathered with a deadline."""

    def __init__(self, workers: list, names: list[str], timeout_s: float):
        self.workers, self.names, self.timeout_s = workers, names, timeout_s
        self.waiter = gather
        """How answers are awaited; async training swaps in one that keeps generating."""
        self.helpers: list = []
        """Other actors of this group (a weight mailbox), killed with it."""

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def _get(self, refs, phase: str, names: Sequence[str] | None = None) -> list:
        return self.waiter(refs, names or self.names, phase=phase, timeout_s=self.timeout_s)

    def call(self, method: str, *args, phase: str, **kwargs) -> list:
        """The same call on every rank."""
        refs = [getattr(w, method).remote(*args, **kwargs) for w in self.workers]
        return self._get(refs, phase)

    def call_sharded(self, method: str, shards: Sequence[tuple], phase: str, **kwargs) -> list:
        """Rank i gets `*shards[i]`."""
        refs = [getattr(w, method).remote(*a, **kwargs) for w, a in zip(self.workers, shards)]
        return self._get(refs, phase)

    def generate(self, prompts: list[list[int]], sampling: dict, seeds: list[int] | None,
                 phase: str = "generate") -> list[Sample]:
        """Prompts split evenly over the ranks' engines; samples come back in prompt order."""
        index = list(range(len(prompts)))
        shards = []
        for chunk in split_evenly(index, self.world_size):
            offset = chunk[0] if chunk else 0
            shards.append(([prompts[i] for i in chunk], sampling,
                           [seeds[i] for i in chunk] if seeds else None, offset))
        results = self.call_sharded("generate", shards, phase=phase)
        return [s for shard in results for s in shard]

    def shutdown(self) -> None:
        try:
            self.call("shutdown", phase="shutdown")
        finally:
            for w in self.workers + self.helpers:
                ray.kill(w)


class PolicyGroup(WorkerGroup):
    def logprobs(self, samples: list[Sample], which: str) -> list[list[float]]:
        shards = [(chunk, which) for chunk in split_evenly(samples, self.world_size)]
        return [lp for shard in self.call_sharded("logprobs", shards, phase=f"{which} log-probs")
                for lp in shard]

    def update(self, samples: list[Sample], num_mini_batches: int, use_rollout_logprobs: bool) -> dict:
        shards = [(chunk, num_mini_batches, use_rollout_logprobs)
                  for chunk in split_evenly(samples, self.world_size)]
        per_rank = self.call_sharded("update", shards, phase="update")
        return per_rank[0]  # metrics are global (all-reduced) quantities or rank-0 timings



def launch(cfg: Any, platform: Platform, total_steps: int) -> tuple[PolicyGroup, WorkerGroup | None]:
    """Start the policy ranks (and, for standalone placement, the rollout replicas) with their
    planned environments, rendezvous them in one torch.distributed world and set them up.
    Async training: the replicas are a `ReplicaPool` outside that world (object-store weights)."""
    from polyrl.trainer.launch_plan import plan_actors
    from polyrl.weights.object_store import create_mailbox
    from polyrl.workers.rollout_worker import RolloutWorker

    timeout = cfg.ray.timeout_s
    mailbox = create_mailbox() if cfg.weight_transport == "object_store" else None
    world = cfg.actor.world_size
    # every actor starts with the options `polyrl train --dry-run` shows (one source of truth)
    actors = plan_actors(cfg, platform)
    policy_cls = ray.remote(PolicyWorker)
    planned = [a for a in actors if a.role == "policy"]
    policy = PolicyGroup([policy_cls.options(**a.ray_options()).remote(cfg, a.rank, world, total_steps,
                                                                      a.num_threads)
                          for a in planned], [a.name for a in planned], timeout)
    if cfg.trainer.mode == "async":
        return _launch_async(cfg, platform, policy, mailbox)
    rollout = None
    planned = [a for a in actors if a.role == "rollout"]
    if planned:
        rollout_cls = ray.remote(RolloutWorker)
        rollout = WorkerGroup([rollout_cls.options(**a.ray_options()).remote(cfg, a.rank, a.num_threads)
                               for a in planned], [a.name for a in planned], timeout)
        if mailbox is not None:
            rollout.helpers.append(mailbox)
    address = None
    if world > 1 or rollout is not None:
        address = gather([policy.workers[0].address.remote()], policy.names[:1],
                         phase="rendezvous", timeout_s=timeout)[0]
    setup_refs = [w.setup.remote(address, mailbox) for w in policy.workers]
    names = list(policy.names)
    if rollout is not None:
        setup_refs += [w.setup.remote(address, mailbox) for w in rollout.workers]
        names += rollout.names
    results = gather(setup_refs, names, phase="start-up", timeout_s=timeout)
    policy.num_params = results[0]
    return policy, rollout


def _launch_async(cfg: Any, platform: Platform, policy: PolicyGroup, mailbox: Any):
    from polyrl.trainer.replica_pool import ReplicaPool

    timeout = cfg.ray.timeout_s
    address = None
    if policy.world_size > 1:
        address = gather([policy.workers[0].address.remote()], policy.names[:1],
                         phase="rendezvous", timeout_s=timeout)[0]
    pool = ReplicaPool(cfg, platform, mailbox)
    refs = [w.setup.remote(address, mailbox) for w in policy.workers] + pool.setup_refs()
    results = gather(refs, list(policy.names) + list(pool.names), phase="start-up", timeout_s=timeout)
    policy.num_params = results[0]
    pool.versions = list(results[policy.world_size:])
    return policy, pool


def cpus_needed(cfg: Any) -> tuple[int, int]:
    """(CPUs each actor reserves, CPUs all actors reserve together)."""
    ranks = cfg.actor.world_size + _num_rollout_ranks(cfg)
    per = cfg.actor.num_cpus_per_worker or default_threads(ranks)
    return per, per * ranks


def _num_rollout_ranks(cfg: Any) -> int:
    if cfg.rollout.placement != "standalone":
        return 0
    return cfg.rollout.num_replicas * cfg.rollout.tensor_parallel_size


def default_threads(num_ranks: int) -> int:
    """One core stays with the driver, Ray and the reward threads; the rest are shared by the
    ranks (policy ranks plus standalone rollout ranks). Oversubscribed OpenMP threads spin-wait: on a 2-core machine a 2-thread worker next to
    a busy driver ran a step 15x slower than a 1-thread worker (docs/benchmarks.md)."""
    return max(1, ((os.cpu_count() or 1) - 1) // num_ranks)
