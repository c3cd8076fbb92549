"""Advantage estimators: per-sequence scalar rewards -> per-token advantages.

Every group-baseline (outcome) estimator has the signature
    fn(rewards [B], group_ids [B], response_mask [B, T], *, norm_adv_by_std, eps) -> [B, T]
and is registered in `ADV_ESTIMATORS` (entries load lazily), by a package in the
`polyrl.advantage_estimators` entry-point group, or named by import path in the config
(docs/plugins.md). GAE (`adv_estimator=gae`,
polyrl/algorithms/advantages/gae.py) also needs the critic's values and returns the critic's
targets, so it is not in that registry. The trainer calls `compute_advantages(cfg, ...)`, which
dispatches to either, and also finds tied groups for DAPO dynamic sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from polyrl.algorithms.advantages.gae import gae_advantages, outcome_token_rewards
from polyrl.algorithms.advantages.groups import group_stats, tied_group_mask
from polyrl.algorithms.losses.aggregation import masked_mean
from polyrl.registry import Registry

if TYPE_CHECKING:
    from polyrl.algorithms.config import AlgorithmConfig

AdvantageFn = Callable[..., torch.Tensor]

ENTRY_POINT_GROUP = "polyrl.advantage_estimators"
ADV_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator", entry_point_group=ENTRY_POINT_GROUP,
                                                 import_paths=True)
ADV_ESTIMATORS.register("grpo", "polyrl.algorithms.advantages.grpo:grpo_advantages")
ADV_ESTIMATORS.register("rloo", "polyrl.algorithms.advantages.rloo:rloo_advantages")
ADV_ESTIMATORS.register(
    "reinforce_pp", "polyrl.algorithms.advantages.reinforce_pp:reinforce_pp_advantages"
)


ESTIMATOR_TIMEOUT_S = 300.0
"""How long an estimator may take before the run stops naming it. The math is a few tensor ops
over [B, T] (milliseconds), so minutes mean a plugin that never returns, which would otherwise
hang the driver with no message."""


@dataclass
class AdvantageOutput:
    advantages: torch.Tensor
    """[B, T] float32, zero on padding."""
    tied_mask: torch.Tensor
    """[B] bool: the sample's group has all-equal rewards (drop it when filtering tied groups)."""
    metrics: dict[str, float] = field(default_factory=dict)
    returns: torch.Tensor | None = None
    """[B, T] float32, gae only: the critic's regression targets (raw advantages + values)."""


def compute_advantages(
    cfg: "AlgorithmConfig",
    rewards: torch.Tensor,  # [B]
    group_ids: torch.Tensor,  # [B]
    response_mask: torch.Tensor,  # [B, T] loss mask (holes for multi-turn tool output allowed)
    *,
    values: torch.Tensor | None = None,  # [B, T] critic's values at rollout time; gae only
    timeout_s: float = ESTIMATOR_TIMEOUT_S,
) -> AdvantageOutput:
    """Advantages with `cfg.adv_estimator`, plus the tied-group mask and metrics.

    gae: each reward is placed on its response's last loss token, and the output carries the
    critic's `returns` and the metric critic/explained_variance (of the values passed in).
    """
    returns, extra = None, {}
    if cfg.uses_critic:
        if values is None:
            raise ValueError(f"adv_estimator={cfg.adv_estimator} needs the critic's values "
                             "(compute_advantages(..., values=[B, T]))")
        from polyrl.algorithms.critic import explained_variance

        token_rewards = outcome_token_rewards(rewards, response_mask)
        adv, returns = gae_advantages(token_rewards, values, response_mask, cfg.gamma, cfg.lam,
                                      whiten=cfg.whiten_advantages, eps=cfg.adv_eps)
        extra = {
            "critic/explained_variance": explained_variance(values, returns, response_mask),
            "critic/returns_mean": masked_mean(returns, response_mask).item(),
            "critic/values_mean": masked_mean(values.to(returns.dtype), response_mask).item(),
        }
    else:
        from polyrl.algorithms.plugin_checks import ESTIMATOR_CONTRACT, call_with_deadline, checked_advantages

        fn = ADV_ESTIMATORS.get(cfg.adv_estimator)
        adv = call_with_deadline(
            lambda: fn(rewards, group_ids, response_mask, norm_adv_by_std=cfg.norm_adv_by_std, eps=cfg.adv_eps),
            timeout_s, "algorithm.adv_estimator", cfg.adv_estimator, ESTIMATOR_CONTRACT)
        adv = checked_advantages(cfg.adv_estimator, adv, rewards, response_mask)
    tied, num_tied = tied_group_mask(rewards, group_ids)
    num_groups = group_stats(rewards, group_ids).num_groups
    mask = response_mask.bool()
    valid = adv[mask]
    metrics = {
        "adv/mean": valid.mean().item() if valid.numel() else 0.0,
        "adv/max": valid.max().item() if valid.numel() else 0.0,
        "adv/min": valid.min().item() if valid.numel() else 0.0,
        "adv/num_groups": float(num_groups),
        "adv/tied_groups": float(num_tied),
        "adv/tied_group_frac": num_tied / max(num_groups, 1),
        **extra,
    }
    return AdvantageOutput(adv, tied, metrics, returns)


__all__ = [
    "ADV_ESTIMATORS",
    "AdvantageOutput",
    "compute_advantages",
    "gae_advantages",
    "outcome_token_rewards",
    "tied_group_mask",
]
