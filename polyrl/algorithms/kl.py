"""KL(policy || reference) per token, and the two ways to use it: reward penalty or loss.

Estimators from J. Schulman, "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html),
with samples x ~ policy and log r = ref_logprob - logprob:
    k1 = -log r                  unbiased, high variance, can be negative
    k2 = (log r)^2 / 2           biased, low variance, always >= 0
    k3 = (r - 1) - log r         unbiased, low variance, always >= 0 (GRPO's KL loss, eq. 4)
All inputs are [B, T]; results are [B, T].
"""

from __future__ import annotations

from typing import Literal

import torch

from polyrl.algorithms.losses.aggregation import AggMode, aggregate, masked_mean

KLEstimator = Literal["k1", "k2", "k3"]

K3_CLAMP = 10.0
"""k3 grows like exp(log r); as in verl it is clamped so one far-off token cannot dominate."""


def kl_estimate(
    logprob: torch.Tensor, ref_logprob: torch.Tensor, estimator: KLEstimator = "k3"
) -> torch.Tensor:
    """Per-token KL estimate [B, T] (padding positions are not masked here)."""
    log_r = ref_logprob - logprob
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    if estimator == "k3":
        log_r = log_r.clamp(-20.0, 20.0)  # exp overflow guard
        return (torch.exp(log_r) - log_r - 1.0).clamp(-K3_CLAMP, K3_CLAMP)
    raise ValueError(f"unknown kl_estimator '{estimator}'; valid choices: k1, k2, k3")


def kl_penalized_rewards(
    rewards: torch.Tensor,  # [B] sequence rewards
    logprob: torch.Tensor,  # [B, T] the sampling policy's log-probs
    ref_logprob: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T]
    *,
    kl_coef: float,
    estimator: KLEstimator = "k1",
) -> tuple[torch.Tensor, dict[str, float]]:
    """rewards - kl_coef * sum_t KL_t: the KL-in-reward penalty, for outcome-reward estimators.

    Placing -kl_coef * KL_t as a per-token reward and summing, as the outcome estimators do,
    gives exactly this; no gradient flows through it.
    """
    with torch.no_grad():
        kl = kl_estimate(logprob, ref_logprob, estimator) * response_mask.to(logprob.dtype)
        seq_kl = kl.sum(-1)  # [B]
        penalized = rewards.to(seq_kl.dtype) - kl_coef * seq_kl
        metrics = {
            "kl/reward_penalty_mean": (kl_coef * seq_kl).mean().item(),
            "kl/token_mean": masked_mean(kl, response_mask).item(),
            "kl/coef": float(kl_coef),
        }
    return penalized, metrics


def kl_loss(
    logprob: torch.Tensor,  # [B, T] current policy, with grad
    ref_logprob: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T]
    *,
    estimator: KLEstimator = "k3",
    loss_agg_mode: AggMode = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL as a loss term (GRPO eq. 3): aggregate like the policy loss; the caller scales it."""
    kl = kl_estimate(logprob, ref_logprob.detach(), estimator)
    loss = aggregate(kl, response_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    return loss, {"actor/kl_loss": loss.item()}
