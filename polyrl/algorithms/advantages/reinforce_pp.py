"""REINFORCE++ with a group baseline: subtract the group mean, then whiten over the whole batch.

REINFORCE++ (Hu, arXiv:2501.03262), the "baseline" variant used for reasoning with several
samples per prompt:
    s_i = r_i - mean(r_group)                        local (per-prompt) baseline
    A_{i,t} = (s_i - mean_batch(s)) / (std_batch(s) + eps)   over all response tokens
Normalising with batch statistics instead of per-group std avoids GRPO's per-prompt difficulty
bias while keeping the advantage scale stable. As in verl, the batch statistics are taken over
response *tokens* (longer responses weigh more) with the unbiased variance.
"""

from __future__ import annotations

import torch

from polyrl.algorithms.advantages.groups import broadcast_to_tokens, group_stats


def reinforce_pp_advantages(
    rewards: torch.Tensor,  # [B]
    group_ids: torch.Tensor,  # [B]
    response_mask: torch.Tensor,  # [B, T]
    *,
    norm_adv_by_std: bool = True,  # unused: the batch whitening is part of the method
    eps: float = 1e-6,
) -> torch.Tensor:  # [B, T]
    stats = group_stats(rewards, group_ids)
    scores = (rewards.to(torch.float64) - stats.mean).unsqueeze(-1)  # [B, 1]
    mask = response_mask.to(torch.float64)  # [B, T]
    num_tokens = mask.sum()
    if num_tokens < 2:  # no variance to speak of
        return torch.zeros_like(mask, dtype=torch.float32)
    token_scores = scores * mask
    mean = token_scores.sum() / num_tokens
    var = (((scores - mean) ** 2) * mask).sum() / (num_tokens - 1)
    adv = (scores - mean) / (var.sqrt() + eps)  # [B, 1]
    return broadcast_to_tokens(adv.squeeze(-1), response_mask)
