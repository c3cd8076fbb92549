"""The distillation teacher (docs/algorithms.md, "On-policy distillation"): its frozen engine,
its validation, and its own Ray actors under distill.placement=disaggregated.

Wherever the teacher lives it is built by the same functions: `teacher_engine` loads
distill.teacher into a frozen training engine (no optimizer) whose `logprobs` is the policy's
log-prob path (packed layout, actor.micro_batch_tokens), and `teacher_rollout` samples the
validation prompts with a rollout engine loaded from the teacher's directory (its held-out
accuracy, once before step 1). Colocated, the policy ranks call them (polyrl/workers/policy.py);
disaggregated, a `TeacherWorker` per teacher rank, in a process group of the teacher ranks alone,
started from its `RolePlan` (polyrl/topology/launch_plan.py plans it, the dry run shows it).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from polyrl.batch import Ragged, RolloutBatch
from polyrl.distributed.role import RolePlan
from polyrl.platform import Platform, get_platform
from polyrl.rollout.base import SamplingParams
from polyrl.rollout.factory import build_disaggregated_engine
from polyrl.training import TrainingEngine, build_engine, sharded_load
from polyrl.training.config import ActorConfig
from polyrl.training.model_loading import load_causal_lm
from polyrl.workers.generation import rollout_rows
from polyrl.job import JobConfig

logger = logging.getLogger(__name__)


def teacher_actor_config(cfg: JobConfig) -> ActorConfig:
    """The teacher ranks' engine settings: the policy's log-prob path (micro-batches, packing,
    dtypes), laid out over the teacher's own ranks by distill.strategy (default actor.strategy),
    without sequence, tensor or expert parallelism (a teacher on the policy ranks uses actor's own)."""
    d = cfg.distill
    strategy = d.strategy or cfg.actor.strategy
    return cfg.actor.model_copy(update={"strategy": strategy, "world_size": d.world_size,
                                        "sequence_parallel_size": 1, "tensor_parallel_size": 1,
                                        "expert_parallel_size": 1,
                                        "offload": cfg.actor.offload and strategy == "fsdp2"})


def teacher_engine(cfg: JobConfig, actor_cfg: ActorConfig, platform: Platform, device: torch.device,
                   **engine_args: Any) -> TrainingEngine:
    """distill.teacher as a frozen engine; under fsdp2 loaded deferred, each rank reading its
    own shards (polyrl/training/sharded_load.py)."""
    model = load_causal_lm(cfg.distill.teacher, actor_cfg.param_dtype, cfg.model.trust_remote_code,
                           deferred=actor_cfg.strategy == "fsdp2")
    if not sharded_load.is_deferred(model):
        model = model.to(device)
    return build_engine(model, actor_cfg, platform, device, **engine_args)


def teacher_rollout(cfg: JobConfig, device: torch.device, platform: Platform, seed: int, rows: list[Any],
                    sampling: SamplingParams, seeds: list[int] | None, group_offset: int) -> RolloutBatch:
    """Samples of the teacher for data rows (`PromptSample`, tokenized by the student's tokenizer,
    which the teacher shares: polyrl/algorithms/distill.py checks it), by a rollout engine of
    rollout.backend loaded from distill.teacher, shut down after: used once, it is not kept."""
    engine = build_disaggregated_engine(cfg.rollout, cfg.distill.teacher, device, seed=seed, platform=platform,
                                     trust_remote_code=cfg.model.trust_remote_code,
                                     tokenizer_path=cfg.model.tokenizer_path or cfg.model.path)
    try:
        return rollout_rows(engine, engine.tokenizer, rows, sampling, seeds, group_offset, cfg.agent)
    finally:
        shutdown = getattr(engine, "shutdown", None)  # GPU adapters free their device memory
        if callable(shutdown):
            shutdown()
        del engine
        platform.empty_cache()


class TeacherWorker:
    """One teacher rank (distill.placement=disaggregated): the teacher's engine on this actor's
    device, in a process group of the distill.world_size teacher ranks (none with one rank)."""

    def __init__(self, cfg: JobConfig, role: RolePlan):
        self.cfg, self.role = cfg, role
        torch.set_num_threads(role.num_threads)
        self.platform = get_platform(cfg.platform)
        self.device = self.platform.claim_device()  # the Ray reservation's, made current
        self.engine: TrainingEngine | None = None

    def address(self) -> str:
        """A rendezvous address on this worker's node (asked of teacher rank 0 only)."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def setup(self, dist_init: str | None) -> int:
        role = self.role
        if role.world_size > 1:
            dist.init_process_group(self.platform.group_backend(self.device.type), init_method=dist_init,
                                    rank=role.rank, world_size=role.world_size,
                                    timeout=timedelta(seconds=self.cfg.ray.timeout_s))
        self.engine = teacher_engine(self.cfg, teacher_actor_config(self.cfg), self.platform, self.device,
                                     rank=role.rank, world_size=role.world_size, mesh=role.mesh)
        return self.engine.num_params

    def logprobs(self, batch: RolloutBatch, which: str = "teacher") -> Ragged:
        """The teacher's log-prob of each response token of this rank's shard."""
        if which != "teacher":
            raise ValueError(f"a teacher rank computes the teacher's log-probs, not the {which}'s")
        return self.engine.logprobs(batch)

    def teacher_generate(self, rows: list[Any], sampling: SamplingParams, seeds: list[int] | None = None,
                         group_offset: int = 0) -> RolloutBatch:
        return teacher_rollout(self.cfg, self.device, self.platform, self.cfg.trainer.seed + 1000 * self.role.index,
                               rows, sampling, seeds, group_offset)

    def ping(self) -> int:
        return self.role.index

    def shutdown(self) -> None:
        if self.role.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
