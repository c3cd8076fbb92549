"""`DistillConfig`: on-policy distillation from a frozen teacher (docs/algorithms.md,
"On-policy distillation"); the advantage math is polyrl/algorithms/distill.py."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from polyrl.config import Config


class DistillConfig(Config):
    teacher: str | None = None
    """A local Hugging Face model directory (e.g. the output of `polyrl export`), or builtin:NAME
    as model.path takes it. Set, every sampled token gets the per-token reward
    -(log pi_student - log pi_teacher) on top of the estimator's advantages. The teacher must
    share the student's tokenizer vocabulary. null: no distillation."""

    coef: float = Field(1.0, ge=0)
    """Weight of the per-token distillation reward -(log pi_student - log pi_teacher)."""

    reward_weight: float = Field(1.0, ge=0)
    """Weight of the task reward's advantages (the estimator's); 0 is pure distillation."""

    placement: Literal["colocated", "standalone"] = "colocated"
    """colocated: the teacher runs on the policy ranks beside the reference, sharded as
    actor.strategy shards the policy. standalone (a teacher on its own workers) is not built yet."""

    @model_validator(mode="after")
    def _check(self) -> "DistillConfig":
        if self.placement == "standalone":
            raise ValueError("distill.placement=standalone (a teacher on its own workers) is not built yet; "
                             "use distill.placement=colocated")
        if self.enabled and self.coef == 0 and self.reward_weight == 0:
            raise ValueError("distill.coef=0 and distill.reward_weight=0 leave nothing to learn from; "
                             "set distill.coef > 0 (pure distillation: distill.reward_weight=0)")
        return self

    @property
    def enabled(self) -> bool:
        return self.teacher is not None
