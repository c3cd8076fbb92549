"""PPO clipped policy loss with asymmetric (clip-higher) and dual clipping.

PPO, Schulman et al. 2017 (arXiv:1707.06347), eq. 7, as a loss to minimise per token:
    ratio = exp(logp - old_logp)
    L = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))
Clip-higher, DAPO (arXiv:2503.14476) sec. 3.1: eps_high > eps_low lets low-probability tokens
grow, which keeps entropy from collapsing.
Dual clip, Ye et al. 2019 (arXiv:1912.09729): for A < 0 a huge ratio would give an unbounded
loss; it is capped at -A * c (c > 1):  L = min(L, -A * c) where A < 0.

Shapes: logprob, old_logprob, advantages, response_mask are all [B, T]; returns a scalar loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from polyrl.algorithms.losses.aggregation import AggMode, aggregate, masked_mean
from polyrl.algorithms.losses.ratio import LOG_RATIO_CLAMP

if TYPE_CHECKING:
    from polyrl.algorithms.config import AlgorithmConfig

def ppo_clip_loss(
    logprob: torch.Tensor,  # [B, T] current policy, with grad
    old_logprob: torch.Tensor,  # [B, T] policy that generated the samples (no grad)
    advantages: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T]
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    dual_clip_c: float | None = None,
    loss_agg_mode: AggMode = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    log_ratio = (logprob - old_logprob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)

    # Policy loss
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped)
    clip_hit = clipped > unclipped  # the clip bound chose the (pessimistic) value

    # Dual clip: only for negative advantages
    dual_hit = torch.zeros_like(clip_hit)
    if dual_clip_c is not None:
        bound = -advantages * dual_clip_c
        negative = advantages < 0
        dual_hit = negative & (loss_mat > bound)
        loss_mat = torch.where(negative, torch.minimum(loss_mat, bound), loss_mat)

    loss = aggregate(loss_mat, response_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    with torch.no_grad():
        names = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "ratio_mean")
        values = torch.stack([
            masked_mean(clip_hit.float(), response_mask),
            masked_mean(dual_hit.float(), response_mask),
            # k1 estimate of KL(old || new): how far this update has moved the policy
            masked_mean(-log_ratio, response_mask),
            masked_mean(ratio, response_mask),
            loss.detach(),
        ]).tolist()  # one device sync instead of five
        metrics = {f"actor/{n}": v for n, v in zip(names, values)}
        metrics["actor/pg_loss"] = values[-1]
    return loss, metrics


def ppo_clip_policy_loss(
    cfg: "AlgorithmConfig",
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    **agg: float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`ppo_clip_loss` with its knobs read from the algorithm config (the registry's signature)."""
    return ppo_clip_loss(
        logprob,
        old_logprob,
        advantages,
        response_mask,
        clip_ratio_low=cfg.clip_ratio_low,
        clip_ratio_high=cfg.clip_ratio_high,
        dual_clip_c=cfg.dual_clip_c,
        loss_agg_mode=cfg.loss_agg_mode,
        **agg,
    )
