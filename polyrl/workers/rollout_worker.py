"""A standalone rollout replica: an engine on its own resources that receives each new policy
version over the weight transport (disaggregated, "standalone" placement).

All processes of a standalone run share one torch.distributed world: the trainer ranks first,
then every replica's ranks (`RankLayout`). Weights travel inside the "weight_sync" group from its
leader — the group's local rank 0 mapped to a global rank, never a hard-coded rank 0 (R5).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from polyrl.distributed.layout import RankLayout, build_groups
from polyrl.platform import get_platform
from polyrl.rollout.factory import build_standalone_engine
from polyrl.weights import build_transport
from polyrl.batch import RolloutBatch
from polyrl.rollout.base import SamplingParams
from polyrl.workers.generation import rollout_rows
from polyrl.job import JobConfig


def rollout_layout(cfg: JobConfig) -> RankLayout:
    return RankLayout(num_replicas=cfg.rollout.num_replicas,
                      tensor_parallel_size=cfg.rollout.tensor_parallel_size,
                      trainer_world_size=cfg.actor.world_size)


def transport_context(cfg: JobConfig, group: Any, mailbox: Any) -> dict:
    """What the run's weight transport needs: the weight-sync group, or the mailbox actor."""
    if cfg.weight_transport == "object_store":
        return {"mailbox": mailbox}
    return {"group": group}


class RolloutWorker:
    def __init__(self, cfg: JobConfig, global_rank: int, num_threads: int):
        self.cfg, self.rank = cfg, global_rank
        torch.set_num_threads(num_threads)
        self.platform = get_platform(cfg.platform)
        self.device = self.platform.reserved_device()  # from the Ray reservation

    def setup(self, dist_init: str, mailbox: Any = None) -> int:
        cfg = self.cfg
        layout = rollout_layout(cfg)
        backend = (self.platform.cpu_dist_backend() if self.device.type == "cpu"
                   else self.platform.dist_backend())
        dist.init_process_group(backend, init_method=dist_init, rank=self.rank,
                                world_size=layout.world_size, timeout=timedelta(seconds=cfg.ray.timeout_s))
        groups = build_groups(layout, self.rank, backend=backend, timeout_s=cfg.ray.timeout_s)
        self.replica = groups.info.replica
        self.engine = build_standalone_engine(cfg.rollout, cfg.model.path, self.device,
                                              seed=cfg.trainer.seed + 1000 * self.rank,
                                              platform=self.platform,
                                              trust_remote_code=cfg.model.trust_remote_code,
                                              tokenizer_path=cfg.model.tokenizer_path)
        self.tokenizer = self.engine.tokenizer
        self.transport = build_transport(cfg.resolved_weights, "standalone",
                                         **transport_context(cfg, groups.group("weight_sync"), mailbox))
        return self.engine.weight_version

    def generate(self, rows: list[Any], sampling: SamplingParams, seeds: list[int] | None = None,
                 group_offset: int = 0) -> RolloutBatch:
        """Samples for data rows (`PromptSample`), single- or multi-turn (generation.py)."""
        return rollout_rows(self.engine, self.tokenizer, rows, sampling, seeds, group_offset, self.cfg.agent)

    def receive_weights(self) -> int:
        """Apply the next version the trainer sends (all or nothing); returns the version."""
        return self.transport.receive(self.engine)

    def health(self) -> dict:
        return {"rank": self.rank, **self.engine.health()}

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
