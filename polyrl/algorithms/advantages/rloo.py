"""RLOO advantages: each sample's reward against the mean of the *other* samples of its prompt.

REINFORCE Leave-One-Out, Kool et al. 2019 ("Buy 4 REINFORCE samples, get a baseline for free")
and Ahmadian et al. 2024 (arXiv:2402.14740):
    A_i = r_i - 1/(n-1) * sum_{j != i} r_j  =  n/(n-1) * (r_i - mean(r_group))
The baseline excludes the sample itself, so the estimator stays unbiased. No std normalisation.
A group of one has no baseline; its advantage is 0.
"""

from __future__ import annotations

import torch

from polyrl.algorithms.advantages.groups import broadcast_to_tokens, group_stats


def rloo_advantages(
    rewards: torch.Tensor,  # [B]
    group_ids: torch.Tensor,  # [B]
    response_mask: torch.Tensor,  # [B, T]
    *,
    norm_adv_by_std: bool = True,  # unused: RLOO's baseline is not std-normalised
    eps: float = 1e-6,  # unused
) -> torch.Tensor:  # [B, T]
    stats = group_stats(rewards, group_ids)
    n = stats.size
    scale = torch.where(n > 1, n / (n - 1).clamp(min=1), torch.zeros_like(n))
    adv = scale * (rewards.to(torch.float64) - stats.mean)
    return broadcast_to_tokens(adv, response_mask)
