"""AdamW with linear warm-up and a constant / cosine / linear schedule."""

from __future__ import annotations

import math

import torch

from polyrl.workers.config import ActorConfig


def lr_factor(step: int, cfg: ActorConfig, total_steps: int) -> float:
    """Multiplier of cfg.lr at optimizer step `step` (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    span = max(total_steps - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    if cfg.lr_schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        decay = 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


def build_optimizer(
    params, cfg: ActorConfig, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    params = [p for p in params if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
        foreach=True,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg, total_steps)
    )
    return optimizer, scheduler
