"""The policy ranks as one object: start them on Ray with their planned environment, fan calls
out, gather answers with a deadline that names any rank that does not answer."""

from __future__ import annotations

import os
from typing import Any, Sequence

import ray

from polyrl.distributed.ray_launch import actor_options, plan_for_role
from polyrl.distributed.waits import gather
from polyrl.platform import Platform
from polyrl.workers.batch import Sample, split_evenly
from polyrl.workers.policy import PolicyWorker


class PolicyGroup:
    def __init__(self, cfg: Any, platform: Platform, total_steps: int):
        self.cfg = cfg
        self.timeout_s = cfg.ray.timeout_s
        world = cfg.actor.world_size
        cpus = cfg.actor.num_cpus_per_worker or default_threads(world)
        plan = plan_for_role(platform, "trainer", backend=cfg.rollout.backend,
                             placement=cfg.rollout.placement, mode=cfg.trainer.mode,
                             config_env=cfg.env)
        devices = 1 if platform.ray_resource else 0
        options = actor_options(plan, platform.ray_actor_options(devices, num_cpus=cpus))
        remote_cls = ray.remote(PolicyWorker)
        self.workers = [
            remote_cls.options(**options, name=None).remote(cfg, rank, world, total_steps, cpus)
            for rank in range(world)
        ]
        self.names = [f"policy rank {r}" for r in range(world)]
        address = None
        if world > 1:
            address = self._get([self.workers[0].address.remote()], "rendezvous", self.names[:1])[0]
        self.num_params = self.call("setup", address, phase="start-up")[0]

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def _get(self, refs, phase: str, names: Sequence[str] | None = None) -> list:
        return gather(refs, names or self.names, phase=phase, timeout_s=self.timeout_s)

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

    def logprobs(self, samples: list[Sample], which: str) -> list[list[float]]:
        shards = [(chunk, which) for chunk in split_evenly(samples, self.world_size)]
        return [lp for shard in self.call_sharded("logprobs", shards, phase=f"{which} log-probs")
                for lp in shard]

    def update(self, samples: list[Sample], num_mini_batches: int, use_rollout_logprobs: bool) -> dict:
        shards = [(chunk, num_mini_batches, use_rollout_logprobs)
                  for chunk in split_evenly(samples, self.world_size)]
        per_rank = self.call_sharded("update", shards, phase="update")
        return per_rank[0]  # metrics are global (all-reduced) quantities or rank-0 timings

    def shutdown(self) -> None:
        try:
            self.call("shutdown", phase="shutdown")
        finally:
            for w in self.workers:
                ray.kill(w)


def default_threads(world_size: int) -> int:
    """One core stays with the driver, Ray and the reward threads; the rest are shared by the
    ranks. Oversubscribed OpenMP threads spin-wait: on a 2-core machine a 2-thread worker next to
    a busy driver ran a step 15x slower than a 1-thread worker (docs/benchmarks.md)."""
    return max(1, ((os.cpu_count() or 1) - 1) // world_size)
