"""Pure tensor functions of the GRPO / PPO family: advantages, policy losses, KL, entropy, the
critic's loss, and DAPO's batch shaping.

The trainer calls, in order: `overlong_penalty` (if overlong.shaping) on the rewards,
`select_informative` per generation round (if dynamic_sampling), `kl_penalized_rewards` (if
use_kl_in_reward), `compute_advantages` (with the critic's values for gae),
`overlong_filter_mask` (if overlong.filter), then per micro-batch `actor_loss(cfg, ...)` (policy
loss from POLICY_LOSSES + KL loss if use_kl_loss - entropy bonus) and, with a critic,
`value_loss`; `entropy_from_logits` gives the entropy metric or bonus. docs/algorithms.md
lists every estimator and loss.
"""

from polyrl.algorithms.advantages import ADV_ESTIMATORS, AdvantageOutput, compute_advantages
from polyrl.algorithms.advantages.gae import gae_advantages, outcome_token_rewards
from polyrl.algorithms.config import (
    AlgorithmConfig,
    check_critic,
    check_rollout,
    check_samples_per_prompt,
)
from polyrl.algorithms.critic import explained_variance, value_loss
from polyrl.algorithms.dynamic_sampling import informative_groups, select_informative
from polyrl.algorithms.entropy import entropy_from_logits
from polyrl.algorithms.kl import kl_estimate, kl_loss, kl_penalized_rewards
from polyrl.algorithms.losses import POLICY_LOSSES, aggregate, masked_mean
from polyrl.algorithms.objective import actor_loss
from polyrl.algorithms.overlong import OverlongConfig, overlong_filter_mask, overlong_penalty

__all__ = [
    "ADV_ESTIMATORS",
    "AdvantageOutput",
    "AlgorithmConfig",
    "OverlongConfig",
    "POLICY_LOSSES",
    "actor_loss",
    "aggregate",
    "check_critic",
    "check_rollout",
    "check_samples_per_prompt",
    "compute_advantages",
    "entropy_from_logits",
    "explained_variance",
    "gae_advantages",
    "informative_groups",
    "kl_estimate",
    "kl_loss",
    "kl_penalized_rewards",
    "masked_mean",
    "outcome_token_rewards",
    "overlong_filter_mask",
    "overlong_penalty",
    "select_informative",
    "value_loss",
]
