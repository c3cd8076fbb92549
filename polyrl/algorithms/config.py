"""`AlgorithmConfig`: which advantage estimator, policy-loss clipping, KL and entropy terms.

One schema for the GRPO family: GRPO, Dr. GRPO (`norm_adv_by_std=False`), DAPO (clip-higher via
`clip_ratio_high`, dynamic sampling via `filter_tied_groups`, `loss_agg_mode="token-mean"`), RLOO
and REINFORCE++ with a group baseline. Combinations that cannot run are rejected at start.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from polyrl.algorithms.off_policy import OffPolicyConfig
from polyrl.config import Config

GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_pp")
"""Estimators whose baseline is computed from the other samples of the same prompt."""


class AlgorithmConfig(Config):
    adv_estimator: Literal["grpo", "rloo", "reinforce_pp"] = "grpo"
    """Advantage estimator: grpo (group mean/std), rloo (leave-one-out mean), reinforce_pp
    (REINFORCE++ with group-mean baseline, then whitened over the whole batch)."""

    norm_adv_by_std: bool = True
    """GRPO only: divide by the group's reward std. False gives Dr. GRPO (arXiv:2503.20783),
    which removes the difficulty bias that std normalisation introduces."""

    adv_eps: float = Field(1e-6, gt=0)
    """Added to the std before dividing, so a near-tied group does not blow up."""

    clip_ratio_low: float = Field(0.2, ge=0, lt=1)
    """PPO clip: the ratio is clipped below at 1 - clip_ratio_low."""

    clip_ratio_high: float = Field(0.2, ge=0)
    """PPO clip: the ratio is clipped above at 1 + clip_ratio_high. DAPO's clip-higher uses 0.28."""

    dual_clip_c: float | None = None
    """Dual-clip constant (arXiv:1912.09729): for negative advantages the loss is bounded by
    -A * c. None disables; must be > 1 (typical 3)."""

    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    """How the [B, T] loss matrix becomes a scalar. token-mean weighs every token equally (DAPO);
    seq-mean-token-mean is the original GRPO; seq-mean-token-sum is Dr. GRPO's."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Estimator of KL(policy || reference) per token (http://joschu.net/blog/kl-approx.html).
    k3 is unbiased and low variance; it is what GRPO's KL loss uses."""

    use_kl_in_reward: bool = False
    """Subtract kl_coef * sum_t KL_t from each sequence's reward before computing advantages."""

    use_kl_loss: bool = False
    """Add kl_coef * KL (aggregated like the policy loss) to the actor loss (GRPO's choice)."""

    kl_coef: float = Field(0.001, ge=0)
    """Weight of the KL term (reward penalty or loss, whichever is on)."""

    entropy_coeff: float = Field(0.0, ge=0)
    """Weight of an entropy bonus in the actor loss (loss -= entropy_coeff * entropy). 0 = off;
    entropy is still reported as a metric."""

    filter_tied_groups: bool = False
    """DAPO dynamic sampling (arXiv:2503.14476): drop groups whose samples all got the same
    reward, since their advantages are zero and they only dilute the batch."""

    policy_loss: str = "ppo_clip"
    """Policy loss from the POLICY_LOSSES registry."""

    off_policy: OffPolicyConfig = Field(default_factory=OffPolicyConfig)
    """Correction for the gap between the rollout engine's policy (its log-probs travel with each
    sample) and the trainer's pre-update policy: truncated importance sampling and/or masking
    (see polyrl/algorithms/off_policy.py and docs/async.md)."""

    @model_validator(mode="after")
    def _check_combinations(self) -> "AlgorithmConfig":
        if self.use_kl_in_reward and self.use_kl_loss:
            raise ValueError(
                "use_kl_in_reward and use_kl_loss are both true, which penalises KL twice; "
                "set algorithm.use_kl_loss=false (reward penalty) or "
                "algorithm.use_kl_in_reward=false (KL loss)"
            )
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            raise ValueError(
                f"dual_clip_c={self.dual_clip_c} must be > 1 (the bound -A*c must lie above the "
                "clipped loss); set algorithm.dual_clip_c=3 or null to disable"
            )
        from polyrl.algorithms.losses import POLICY_LOSSES  # lazy: losses import this module

        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(
                f"policy_loss '{self.policy_loss}' is not registered; valid choices: "
                f"{', '.join(POLICY_LOSSES.names())}"
            )
        return self

    @property
    def uses_reference(self) -> bool:
        """Whether a reference policy's log-probs are needed at all."""
        return (self.use_kl_in_reward or self.use_kl_loss) and self.kl_coef > 0


def check_samples_per_prompt(cfg: AlgorithmConfig, n: int) -> None:
    """Raise if `n` samples per prompt cannot form the estimator's group baseline."""
    if cfg.adv_estimator in GROUP_ESTIMATORS and n < 2:
        name = {"grpo": "GRPO", "rloo": "RLOO", "reinforce_pp": "REINFORCE++ (group baseline)"}
        raise ValueError(
            f"{name[cfg.adv_estimator]} needs rollout.n >= 2 samples per prompt to form a group "
            f"baseline, got rollout.n={n}; set rollout.n=8 (or any value >= 2)"
        )
