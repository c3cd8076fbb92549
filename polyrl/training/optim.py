"""AdamW with linear warm-up and a constant / cosine / linear schedule.

The scheduler steps once per optimizer step, and one trainer step takes
`actor.ppo_epochs x num_mini_batches` optimizer steps (`PolicyWorker.update`), so the decay
horizon is counted in optimizer steps: counted in trainer steps it would reach `min_lr_ratio`
after 1 / (epochs x mini-batches) of the run and stay there.
"""

from __future__ import annotations

import math

import torch

from polyrl.training.config import ActorConfig


def optimizer_steps_per_train_step(cfg: ActorConfig, num_mini_batches: int) -> int:
    """Optimizer (and scheduler) steps one trainer step takes: every PPO epoch steps once per
    mini-batch, and every rank runs all of them (`split_evenly` never drops a chunk)."""
    if num_mini_batches < 1:
        raise ValueError(f"num_mini_batches must be >= 1, got {num_mini_batches}")
    return cfg.ppo_epochs * num_mini_batches


def total_optimizer_steps(cfg: ActorConfig, train_steps: int, num_mini_batches: int) -> int:
    """The schedule's horizon for a run of `train_steps` trainer steps."""
    return train_steps * optimizer_steps_per_train_step(cfg, num_mini_batches)


def lr_factor(step: int, cfg: ActorConfig, horizon: int) -> float:
    """Multiplier of cfg.lr at optimizer step `step` (0-based). Decaying schedules reach
    `min_lr_ratio` at step `horizon` (in optimizer steps), i.e. once every step of the run is
    taken: the run's last step still learns, even with `min_lr_ratio=0`."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    span = max(horizon - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    if cfg.lr_schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        decay = 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


def build_optimizer(
    params, cfg: ActorConfig, horizon: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable `params` and its schedule; `horizon` is the run's length in
    optimizer steps (`total_optimizer_steps()`), not in trainer steps."""
    params = [p for p in params if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
        **kernel(params),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg, horizon)
    )
    return optimizer, scheduler


def kernel(params: list[torch.Tensor]) -> dict[str, bool]:
    """torch's fused AdamW where every parameter's device has its kernel (one pass per tensor:
    on CPU a 32.8M-parameter step took 15 ms of CPU against 110 ms for the multi-tensor
    `foreach` path, docs/benchmarks.md), else `foreach`. Decided by the devices, never by
    timing; the two agree to float rounding (3e-8 after ten steps)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    supported = set(_get_fused_kernels_supported_devices())
    if params and all(p.device.type in supported and p.dtype.is_floating_point for p in params):
        return {"fused": True}
    return {"foreach": True}
