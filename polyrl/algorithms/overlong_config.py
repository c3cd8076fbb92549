"""`OverlongConfig`: DAPO's treatments of responses that run into the length limit (soft
overlong punishment, overlong filtering); the functions are polyrl/algorithms/overlong.py."""

from __future__ import annotations

from pydantic import Field, model_validator

from polyrl.config import Config


class OverlongConfig(Config):
    shaping: bool = False
    """Add DAPO's soft overlong punishment (penalty_factor * R_length, between -penalty_factor
    and 0) to each response's reward; needs buffer_length."""

    buffer_length: int | None = Field(None, ge=1)
    """L_buf: the last buffer_length tokens before rollout.response_length are the punishment
    ramp. Must be below rollout.response_length. DAPO used 4096 of 20480 (a fifth)."""

    penalty_factor: float = Field(1.0, ge=0)
    """Scale of the punishment: a response at the limit loses this much reward."""

    filter: bool = False
    """Mask truncated responses (no EOS within rollout.response_length) out of the policy loss;
    they still count in their group's reward statistics."""

    @model_validator(mode="after")
    def _check(self) -> "OverlongConfig":
        if self.shaping and self.buffer_length is None:
            raise ValueError(
                "shaping=true needs the punishment ramp's length; set "
                "algorithm.overlong.buffer_length (e.g. a fifth of rollout.response_length)")
        return self
