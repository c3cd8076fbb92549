"""Pure tensor functions of the GRPO / PPO family: advantages, policy losses, KL, entropy.

The trainer calls, in order: `kl_penalized_rewards` (if use_kl_in_reward), `compute_advantages`,
then per micro-batch `actor_loss(cfg, ...)` (policy loss from POLICY_LOSSES + KL loss if
use_kl_loss - entropy bonus), with `entropy_from_logits` for the entropy metric or bonus.
"""

from polyrl.algorithms.advantages import ADV_ESTIMATORS, AdvantageOutput, compute_advantages
from polyrl.algorithms.config import AlgorithmConfig, check_samples_per_prompt
from polyrl.algorithms.entropy import entropy_from_logits
from polyrl.algorithms.kl import kl_estimate, kl_loss, kl_penalized_rewards
from polyrl.algorithms.losses import POLICY_LOSSES, aggregate, masked_mean
from polyrl.algorithms.objective import actor_loss

__all__ = [
    "ADV_ESTIMATORS",
    "AdvantageOutput",
    "AlgorithmConfig",
    "POLICY_LOSSES",
    "actor_loss",
    "aggregate",
    "check_samples_per_prompt",
    "compute_advantages",
    "entropy_from_logits",
    "kl_estimate",
    "kl_loss",
    "kl_penalized_rewards",
    "masked_mean",
]
