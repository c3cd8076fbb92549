"""`OffPolicyConfig`: the off-policy correction between the rollout engine's policy and the
trainer's (truncated importance sampling and/or masking). The correction itself, and what each
level means, is polyrl/algorithms/off_policy.py; docs/async.md has the measurements."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from polyrl.config import Config


class OffPolicyConfig(Config):
    is_level: Literal["auto", "none", "token", "sequence"] = "auto"
    """Truncated importance sampling between the trainer's proximal log-probs and the rollout
    log-probs: per token, per sequence (product of the token ratios), none, or auto (token when
    trainer.mode=async, none when sync: there the engine runs the trainer's weights)."""
    is_cap: float = Field(2.0, gt=0)
    """C: IS weights are truncated to at most this value."""
    mask_level: Literal["auto", "none", "token", "sequence", "geometric"] = "auto"
    """Drop from the policy loss tokens (token), whole responses (sequence: product of ratios;
    geometric: exp of the mean log-ratio, independent of length) whose proximal / rollout ratio
    lies outside [mask_low, mask_high]; auto: token when trainer.mode=async, none when sync
    (on the embedded default task it closed the accuracy gap of staleness 1, docs/async.md)."""
    mask_low: float = Field(0.5, ge=0)
    """Lower ratio threshold of the mask."""
    mask_high: float = Field(2.0, gt=0)
    """Upper ratio threshold of the mask."""

    @model_validator(mode="after")
    def _check(self) -> "OffPolicyConfig":
        if self.mask_low >= self.mask_high:
            raise ValueError(f"off_policy.mask_low={self.mask_low} must be below mask_high="
                             f"{self.mask_high}; e.g. algorithm.off_policy.mask_low=0.5 mask_high=2")
        return self

    def resolve(self, *, on_policy: bool) -> "OffPolicyConfig":
        """This config with each `auto` replaced by the level the plan implies: none when every
        batch comes from the trainer's current weights (`RolePlan.on_policy`), token when samples
        may lag (the streaming topology)."""
        implied = "none" if on_policy else "token"
        return self.model_copy(update={k: implied for k in ("is_level", "mask_level")
                                       if getattr(self, k) == "auto"})

    @property
    def active(self) -> bool:
        return self.is_level not in ("none", "auto") or self.mask_level not in ("none", "auto")
