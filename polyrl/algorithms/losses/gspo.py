"""GSPO: clipped policy loss on a sequence-level, length-normalised importance ratio.

Group Sequence Policy Optimization, Zheng et al. 2025 (arXiv:2507.18071), eqs. 5-7 and 10-11.
For response i with loss tokens M_i (the loss mask: padding and, in multi-turn, tool output are
not the policy's actions and do not count):
    s_i = exp( 1/|M_i| * sum_{t in M_i} (logp_t - old_logp_t) )     geometric mean of token ratios
    L_i = max(-A_i * s_i, -A_i * clip(s_i, 1 - eps_low, 1 + eps_high))            `gspo`
GSPO-token (sec. 4.3) keeps the value s_i but lets the gradient flow through each token, so a
per-token advantage A_{i,t} can be used:
    s_{i,t} = sg[s_i] * exp(logp_t - sg[logp_t])            (value s_i, d s_{i,t}/d logp_t = s_i)
    L_{i,t} = max(-A_{i,t} * s_{i,t}, -A_{i,t} * clip(s_{i,t}, 1 - eps_low, 1 + eps_high))
With A_{i,t} = A_i the two have the same value, clipping and gradient under seq-mean-token-mean
aggregation (the paper's 1/G sum_i), which is why the config requires that mode for both.

Why a separate, tiny clip range: log s_i is a *mean* of token log-ratios, so it moves about
1/|y| as much as one token's ratio; the paper clips at 3e-4 / 4e-4 (sec. 5.1). A token-scale
range like 0.2 would never bind (see the validator in polyrl/algorithms/config.py).

Shapes: logprob, old_logprob, advantages, response_mask are all [B, T]; returns a scalar loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from polyrl.algorithms.losses.aggregation import AggMode, aggregate, masked_mean
from polyrl.algorithms.losses.ratio import LOG_RATIO_CLAMP

if TYPE_CHECKING:
    from polyrl.algorithms.config import AlgorithmConfig

def sequence_log_ratio(
    logprob: torch.Tensor,  # [B, T]
    old_logprob: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T]
) -> torch.Tensor:  # [B, 1]: log s_i (with grad through logprob); 0 for a row without tokens
    mask = response_mask.to(logprob.dtype)
    # the mask multiplies the difference, so garbage log-probs on padding cannot leak in
    summed = ((logprob - old_logprob) * mask).sum(-1, keepdim=True)
    log_s = summed / mask.sum(-1, keepdim=True).clamp(min=1)
    return log_s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def gspo_loss(
    logprob: torch.Tensor,  # [B, T] current policy, with grad
    old_logprob: torch.Tensor,  # [B, T] policy that generated the samples (no grad)
    advantages: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T]
    *,
    token_level: bool = False,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    loss_agg_mode: AggMode = "seq-mean-token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    mask = response_mask.to(logprob.dtype)
    log_s = sequence_log_ratio(logprob, old_logprob, mask)  # [B, 1]
    if token_level:
        # value s_i on every token, gradient d/d logp_t = s_i (straight through the token)
        ratio = torch.exp(log_s.detach() + logprob - logprob.detach())  # [B, T]
        adv = advantages
    else:
        ratio = torch.exp(log_s).expand_as(logprob)  # [B, T], one value per row
        # the sequence objective needs one advantage per response: the mean over its loss tokens
        # (exact for outcome estimators, whose advantage is constant along the row)
        adv = masked_row_mean(advantages, mask).expand_as(logprob)

    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped)  # [B, T]; constant along a row for `gspo`
    clip_hit = clipped > unclipped

    loss = aggregate(loss_mat, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    with torch.no_grad():
        token_log_ratio = (logprob - old_logprob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        # the same keys as ppo_clip so workers reduce them alike (polyrl/workers/policy.py):
        # per-token means; pg_clipfrac_lower is the dual-clip fraction, which GSPO has none of
        names = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "ratio_mean")
        values = torch.stack([
            masked_mean(clip_hit.to(mask.dtype), mask),
            torch.zeros((), dtype=mask.dtype, device=mask.device),
            masked_mean(-token_log_ratio, mask),
            masked_mean(ratio.detach(), mask),
            loss.detach().to(mask.dtype),
        ]).tolist()
        metrics = {f"actor/{n}": v for n, v in zip(names, values)}
        metrics["actor/pg_loss"] = values[-1]
    return loss, metrics


def masked_row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, 1]: mean of each row over its mask (0 for an empty row)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)


def _from_config(cfg: "AlgorithmConfig", token_level: bool, *tensors, **agg):
    """Both registry entries share the clip range and aggregation read from the config."""
    return gspo_loss(
        *tensors,
        token_level=token_level,
        clip_ratio_low=cfg.gspo_clip_ratio_low,
        clip_ratio_high=cfg.gspo_clip_ratio_high,
        loss_agg_mode=cfg.loss_agg_mode,
        **agg,
    )


def _registry_entry(token_level: bool, doc: str):
    def loss(cfg: "AlgorithmConfig", logprob: torch.Tensor, old_logprob: torch.Tensor,
             advantages: torch.Tensor, response_mask: torch.Tensor,
             **agg: float | None) -> tuple[torch.Tensor, dict[str, float]]:
        return _from_config(cfg, token_level, logprob, old_logprob, advantages, response_mask, **agg)

    loss.__doc__ = doc
    return loss


gspo_policy_loss = _registry_entry(False, "Registry entry `gspo`: sequence-level GSPO with `algorithm.gspo_clip_ratio_*`.")
gspo_token_policy_loss = _registry_entry(
    True, "Registry entry `gspo_token`: GSPO-token (per-token advantages, gradient per token).")
