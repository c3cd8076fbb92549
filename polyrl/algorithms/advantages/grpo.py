"""GRPO advantages: each sample's reward against its group's mean (and std).

GRPO, DeepSeekMath (arXiv:2402.03300) sec. 4.1.2, outcome supervision:
    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)        broadcast to every response token
Dr. GRPO (arXiv:2503.20783) drops the std division (`norm_adv_by_std=False`): dividing by std
up-weights prompts that are nearly always solved or nearly never solved.

std is the unbiased (n - 1) estimate, as in verl, so numbers match runs made there.
"""

from __future__ import annotations

import torch

from polyrl.algorithms.advantages.groups import broadcast_to_tokens, group_stats


def grpo_advantages(
    rewards: torch.Tensor,  # [B] one scalar reward per sequence
    group_ids: torch.Tensor,  # [B] samples of the same prompt share an id
    response_mask: torch.Tensor,  # [B, T] 1 on response tokens, 0 on padding
    *,
    norm_adv_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:  # [B, T] float32
    stats = group_stats(rewards, group_ids)
    adv = rewards.to(torch.float64) - stats.mean
    if norm_adv_by_std:
        adv = adv / (stats.std + eps)
    return broadcast_to_tokens(adv, response_mask)
