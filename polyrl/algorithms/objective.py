"""The actor's full objective for one micro-batch: policy loss + KL loss - entropy bonus.

Kept here, next to the pieces, so the worker that runs the backward pass does not re-derive
which terms are on: `cfg.use_kl_loss` adds kl_coef * KL (GRPO eq. 3), `cfg.entropy_coeff`
subtracts an entropy bonus. All terms use the same aggregation (`cfg.loss_agg_mode`), and the
same global `num_tokens` / `num_seqs` under gradient accumulation.
"""

from __future__ import annotations

import torch

from polyrl.algorithms.config import AlgorithmConfig
from polyrl.algorithms.kl import kl_loss
from polyrl.algorithms.losses import POLICY_LOSSES, aggregate


def actor_loss(
    cfg: AlgorithmConfig,
    logprob: torch.Tensor,  # [B, T] current policy, with grad
    old_logprob: torch.Tensor,  # [B, T] sampling policy
    advantages: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T]
    *,
    ref_logprob: torch.Tensor | None = None,  # [B, T], needed when cfg.use_kl_loss
    entropy: torch.Tensor | None = None,  # [B, T] per-token entropy (with grad for a bonus)
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    agg = {"num_tokens": num_tokens, "num_seqs": num_seqs}
    loss, metrics = POLICY_LOSSES.get(cfg.policy_loss)(
        cfg, logprob, old_logprob, advantages, response_mask, **agg
    )
    if cfg.use_kl_loss:
        if ref_logprob is None:
            raise ValueError("algorithm.use_kl_loss=true needs ref_logprob (reference log-probs)")
        kl, kl_metrics = kl_loss(
            logprob, ref_logprob, response_mask,
            estimator=cfg.kl_estimator, loss_agg_mode=cfg.loss_agg_mode, **agg,
        )
        loss = loss + cfg.kl_coef * kl
        metrics.update(kl_metrics)
    if entropy is not None:
        ent = aggregate(entropy, response_mask, cfg.loss_agg_mode, **agg)
        metrics["actor/entropy"] = ent.item()
        if cfg.entropy_coeff > 0:
            loss = loss - cfg.entropy_coeff * ent
    metrics["actor/loss"] = loss.item()
    return loss, metrics
