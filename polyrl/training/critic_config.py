"""Configuration of the critic (PPO with a value model: algorithm.adv_estimator=gae)."""

from __future__ import annotations

from pydantic import Field

from polyrl.config import Config


class CriticConfig(Config):
    enable: bool = False
    """Train a critic beside the policy (needs algorithm.adv_estimator=gae)."""
    path: str | None = None
    """Model directory the critic starts from (its trunk; the value head starts from random).
    Default: model.path, i.e. a value head on the policy's architecture initialised from it."""
    lr: float = Field(1e-5, gt=0)
    """Peak learning rate of the critic's AdamW (its own optimizer)."""
    grad_clip: float | None = Field(1.0, gt=0)
    """Clip the critic's global gradient norm (null disables)."""
    warmup_steps: int = Field(0, ge=0)
    """Trainer steps at the start during which only the critic trains (the policy waits for
    values worth using)."""
