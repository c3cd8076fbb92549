"""Off-policy correction between the policy that sampled a response and the trainer's policy.

In asynchronous RL (and whenever the rollout engine's numerics differ from the trainer's) three
policies meet in one update (decoupled PPO, Hilton et al. 2021, arXiv:2110.00641; AReaL,
arXiv:2505.24298 sec. 5):
    behaviour  pi_b      the engine that sampled the tokens (its log-probs travel with the sample)
    proximal   pi_prox   the trainer's weights before this update (recomputed, or the detached
                         forward of a single-step update)
    current    pi_theta  the weights being optimised
PPO's ratio and clip use pi_theta / pi_prox (a trust region around the trainer's own weights);
the gap pi_prox / pi_b is corrected by importance sampling (IS), truncated at C so one stale
token cannot dominate the batch (truncated IS, Espeholt et al. 2018 IMPALA arXiv:1802.01561),
and/or tokens or whole sequences whose ratio leaves [low, high] are masked out of the loss.

    token IS       w_t = min(r_t, C),                r_t = exp(logp_prox_t - logp_b_t)
    sequence IS    w_t = min(prod_t r_t, C)           (one weight for every token of a row)
    token mask     keep_t = low <= r_t <= high
    sequence mask  keep_t = low <= prod_t r_t <= high   (the whole row is kept or dropped)
    geometric mask keep_t = low <= exp(mean_t log r_t) <= high   (length-independent)

All tensors are [B, T] in the response-aligned layout; weights carry no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polyrl.algorithms.losses.aggregation import masked_mean
from polyrl.algorithms.losses.ratio import LOG_RATIO_CLAMP
from polyrl.algorithms.off_policy_config import OffPolicyConfig

__all__ = ["Correction", "LOG_RATIO_CLAMP", "OffPolicyConfig", "off_policy_correction"]


@dataclass
class Correction:
    weights: torch.Tensor  # [B, T] IS weight per token (1 where IS is off), no grad
    keep: torch.Tensor  # [B, T] 1.0 where the token stays in the loss, 0.0 where masked
    metrics: dict[str, float]


@torch.no_grad()
def off_policy_correction(
    prox_logprob: torch.Tensor,  # [B, T] trainer, pre-update
    rollout_logprob: torch.Tensor,  # [B, T] behaviour (engine)
    response_mask: torch.Tensor,  # [B, T]
    cfg: OffPolicyConfig,
) -> Correction:
    mask = response_mask.to(prox_logprob.dtype)
    # NaN: the engine could not report that token's log-prob (polyrl/rollout/engines/trtllm.py);
    # the token then counts as on-policy (ratio 1) instead of poisoning the loss
    rollout_logprob = torch.where(torch.isnan(rollout_logprob), prox_logprob, rollout_logprob)
    log_ratio = ((prox_logprob - rollout_logprob) * mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)  # [B, T]; 1 on padding
    seq_log_ratio = log_ratio.sum(-1, keepdim=True).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, 1]
    seq_ratio = torch.exp(seq_log_ratio).expand_as(ratio)
    level = cfg.is_level
    if level == "token":
        raw = ratio
    elif level == "sequence":
        raw = seq_ratio
    elif level in ("none", "auto"):
        raw = torch.ones_like(ratio)
    else:
        raise ValueError(f"unknown off_policy.is_level '{level}'; valid: none, token, sequence")
    weights = raw.clamp(max=cfg.is_cap)

    if cfg.mask_level in ("none", "auto"):
        keep = torch.ones_like(ratio)
    else:
        if cfg.mask_level == "token":
            measured = ratio
        elif cfg.mask_level == "sequence":
            measured = seq_ratio
        elif cfg.mask_level == "geometric":
            lengths = mask.sum(-1, keepdim=True).clamp(min=1)
            measured = torch.exp(log_ratio.sum(-1, keepdim=True) / lengths).expand_as(ratio)
        else:
            raise ValueError(f"unknown off_policy.mask_level '{cfg.mask_level}'; valid: none, "
                             "token, sequence, geometric")
        keep = ((measured >= cfg.mask_low) & (measured <= cfg.mask_high)).to(ratio.dtype)

    metrics = {
        "off_policy/is_weight_mean": masked_mean(weights, mask).item(),
        "off_policy/is_weight_max": float((raw * mask).max().item()) if mask.any() else 1.0,
        "off_policy/is_clipped_frac": masked_mean((raw > cfg.is_cap).to(mask.dtype), mask).item(),
        "off_policy/masked_frac": masked_mean(1.0 - keep, mask).item(),
        # k1 estimate of KL(behaviour || proximal): how far the rollout policy lags the trainer
        "off_policy/kl_rollout_proximal": masked_mean(-log_ratio, mask).item(),
    }
    return Correction(weights=weights * mask, keep=keep * mask, metrics=metrics)
