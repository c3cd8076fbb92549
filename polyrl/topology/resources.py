"""CPU reservations of a run's actors (pure: read by the launch plan and the trainer)."""

from __future__ import annotations

import math
import os

from polyrl.job import JobConfig


def cpus_needed(cfg: JobConfig) -> tuple[int, int]:
    """(CPUs each rank actor reserves, CPUs all actors reserve together: the ranks (policy,
    disaggregated rollout, disaggregated distillation teacher) plus the reward-model worker's
    reward.model.num_cpus)."""
    ranks = cfg.actor.world_size + num_rollout_ranks(cfg) + cfg.distill.own_ranks
    per = cfg.actor.num_cpus_per_worker or default_threads(ranks)
    return per, per * ranks + reward_worker_cpus(cfg)


def reward_worker_cpus(cfg: JobConfig) -> int:
    """CPUs of the Ray reward worker (`reward.model`, not in_process), rounded up."""
    model = cfg.reward.model
    if model is None or model.in_process:
        return 0
    return math.ceil(model.num_cpus)


def num_rollout_ranks(cfg: JobConfig) -> int:
    if cfg.topology.colocated_engine:  # the engines live in the policy ranks
        return 0
    return cfg.rollout.num_replicas * cfg.rollout.tensor_parallel_size


def default_threads(num_ranks: int) -> int:
    """One core stays with the driver, Ray and the reward threads; the rest are shared by the
    ranks (policy ranks plus disaggregated rollout ranks). Oversubscribed OpenMP threads spin-wait:
    on a 2-core machine a 2-thread worker next to a busy driver ran a step 15x slower than a
    1-thread worker (docs/benchmarks.md)."""
    return max(1, ((os.cpu_count() or 1) - 1) // num_ranks)
