"""`DistillConfig`: on-policy distillation from a frozen teacher (docs/algorithms.md,
"On-policy distillation"); the advantage math is polyrl/algorithms/distill.py."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from polyrl.config import Config
from polyrl.config.vocabulary import COLOCATED, DISAGGREGATED, canonical_placement


MAX_WEIGHT = 1000.0
"""The largest distill.coef / distill.reward_weight taken. The per-token reward is a log-prob
difference (a few units), so a weight far past this scales every advantage into gradients that
are not finite (inf, 1e30): each update is then skipped and the run learns nothing."""


class DistillConfig(Config):
    teacher: str | None = None
    """A local Hugging Face model directory (e.g. the output of `polyrl export`), or builtin:NAME
    as model.path takes it. Set, every sampled token gets the per-token reward
    -(log pi_student - log pi_teacher) on top of the estimator's advantages. The teacher must
    share the student's tokenizer vocabulary. null: no distillation."""

    coef: float = Field(1.0, ge=0, le=MAX_WEIGHT, allow_inf_nan=False)
    """Weight of the per-token distillation reward -(log pi_student - log pi_teacher)."""

    reward_weight: float = Field(1.0, ge=0, le=MAX_WEIGHT, allow_inf_nan=False)
    """Weight of the task reward's advantages (the estimator's); 0 is pure distillation."""

    placement: Literal["colocated", "disaggregated"] = "colocated"
    """Where the teacher lives (docs/architecture.md, "Vocabulary"). colocated: on the policy
    ranks beside the reference, sharded as actor.strategy shards the policy (no extra devices).
    disaggregated: on distill.world_size Ray actors of its own, one device each (a teacher too
    large to sit beside the policy); each step's samples are sharded over them and their
    log-probs come back per sample. The earlier value standalone is accepted as an alias of
    disaggregated."""

    world_size: int = Field(1, ge=1)
    """distill.placement=disaggregated: teacher ranks (one device and actor.num_cpus_per_worker
    CPUs each), one process group of their own that distill.strategy shards the teacher over."""

    strategy: Literal["ddp", "fsdp2"] | None = None
    """distill.placement=disaggregated: how the teacher ranks hold the teacher: ddp whole on every
    rank, fsdp2 sharded per decoder layer over them. null: actor.strategy. Forwards use the
    policy's log-prob path (actor.micro_batch_tokens, actor.packing, actor.compute_dtype)."""

    validate_teacher: bool = True
    """Score the teacher on the validation set once before step 1 (`distill/teacher_val_acc`,
    with the run's validation sampling), by a rollout engine of rollout.backend loaded from
    distill.teacher where the teacher lives (the policy ranks, or the teacher's own ranks)
    and shut down after. Needs data.val_files; false skips it (say, a GPU engine that cannot
    start beside the policy's)."""

    @field_validator("placement", mode="before")
    @classmethod
    def _placement_name(cls, value: object) -> object:
        return canonical_placement(value, "distill.placement")

    @model_validator(mode="after")
    def _check(self) -> "DistillConfig":
        if self.enabled and self.coef == 0 and self.reward_weight == 0:
            raise ValueError("distill.coef=0 and distill.reward_weight=0 leave nothing to learn from; "
                             "set distill.coef > 0 (pure distillation: distill.reward_weight=0)")
        if self.placement == COLOCATED and (self.world_size != 1 or self.strategy is not None):
            key = "distill.world_size" if self.world_size != 1 else "distill.strategy"
            raise ValueError(f"{key} sizes a teacher on ranks of its own; set distill.placement=disaggregated "
                             "(colocated, the teacher is sharded over the policy ranks as actor.strategy says)")
        return self

    @property
    def enabled(self) -> bool:
        return self.teacher is not None

    @property
    def own_ranks(self) -> int:
        """Ray actors of the teacher's own (0: none, the teacher is colocated or off)."""
        return self.world_size if self.enabled and self.placement == DISAGGREGATED else 0
