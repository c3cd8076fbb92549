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
from polyrl.algorithms.off_policy import OffPolicyConfig, off_policy_correction
from polyrl.algorithms.plugin_checks import checked_loss


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
    rollout_logprob: torch.Tensor | None = None,  # [B, T] behaviour policy (the engine's)
    off_policy: OffPolicyConfig | None = None,  # resolved (no "auto"); None: cfg.off_policy
) -> tuple[torch.Tensor, dict[str, float]]:
    agg = {"num_tokens": num_tokens, "num_seqs": num_seqs}
    off_policy = off_policy or cfg.off_policy
    policy_mask, off_metrics = response_mask, {}
    if off_policy.active and rollout_logprob is not None:
        # old_logprob is the proximal policy here; scaling A by w >= 0 scales every branch of
        # the clipped loss (and the dual-clip bound) by w, i.e. w * L_ppo per token
        corr = off_policy_correction(old_logprob.detach(), rollout_logprob, response_mask, off_policy)
        advantages = advantages * corr.weights
        policy_mask = response_mask * corr.keep
        off_metrics = corr.metrics
    loss, metrics = checked_loss(cfg.policy_loss, POLICY_LOSSES.get(cfg.policy_loss)(
        cfg, logprob, old_logprob, advantages, policy_mask, **agg
    ), logprob, (old_logprob, advantages), policy_mask)
    metrics.update(off_metrics)
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
