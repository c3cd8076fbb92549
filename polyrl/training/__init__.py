"""Training engines: how one model is trained across the policy's ranks (base.py has the seam,
mesh.py the ranks' layout).

`build_engine` is the one place that maps `actor.strategy` onto an engine class."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from polyrl.platform import Platform
from polyrl.registry import Registry
from polyrl.training.base import NonFiniteUpdate, StepResult, TrainingEngine

if TYPE_CHECKING:  # a config leaf of a higher package: for the signature only
    from polyrl.training.config import ActorConfig

TRAINING_ENGINES: Registry[type] = Registry("training strategy")
TRAINING_ENGINES.register("ddp", "polyrl.training.ddp:DDPEngine")
TRAINING_ENGINES.register("fsdp2", "polyrl.training.fsdp2:FSDP2Engine")


def build_engine(model: torch.nn.Module, cfg: ActorConfig, platform: Platform, device: torch.device, *,
                 rank: int = 0, world_size: int = 1, group: Any = None,
                 horizon: int | None = None, **options: Any) -> TrainingEngine:
    """The engine of `cfg.strategy` around `model` (loaded, on `device`, identical on every rank; or
    deferred on the meta device by `load_causal_lm(..., deferred=True)`, read here).
    `group`: the `world_size` policy ranks (None: the whole world), laid out as `ParallelDims`
    (training/mesh.py: `cfg.sequence_parallel_size` ranks per sequence-parallel group, or the
    `mesh` option). `horizon`: the run's length in optimizer steps; None builds a frozen engine
    (no optimizer). `options`: engine options such as `head` (training/values.py for a critic)
    or `mesh`."""
    from polyrl.training import sharded_load

    if cfg.strategy != "fsdp2" and sharded_load.is_deferred(model):  # fsdp2 reads only its shards
        sharded_load.materialize(model, device)
    return TRAINING_ENGINES.get(cfg.strategy)(model, cfg, platform, device, rank=rank,
                                             world_size=world_size, group=group, horizon=horizon,
                                             **options)


__all__ = ["NonFiniteUpdate", "StepResult", "TRAINING_ENGINES", "TrainingEngine", "build_engine"]
