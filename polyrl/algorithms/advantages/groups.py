"""Group statistics shared by the group-baseline estimators.

Samples of one prompt share a group id (any integers, e.g. the prompt's dataset index); groups may
have different sizes (after filtering, or in async training), so statistics are computed with
scatter ops over arbitrary ids instead of a [num_groups, n] reshape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GroupStats:
    """Per-sample view of its group's statistics, all shaped [B]."""

    inverse: torch.Tensor
    """Dense group index in [0, num_groups) of each sample (long)."""
    size: torch.Tensor
    """Number of samples in the sample's group (float)."""
    mean: torch.Tensor
    """Mean reward of the sample's group."""
    std: torch.Tensor
    """Unbiased (n - 1) std of the sample's group; 0 for a group of one."""
    num_groups: int


def group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> GroupStats:
    """rewards [B] float, group_ids [B] int -> statistics of each sample's group."""
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be [B]; got {tuple(rewards.shape)} and "
            f"{tuple(group_ids.shape)}"
        )
    rewards = rewards.to(torch.float64)  # sums of many rewards: keep the baseline exact
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=rewards.device)
    count = zeros.index_add(0, inverse, torch.ones_like(rewards))
    mean = zeros.index_add(0, inverse, rewards) / count
    sq_dev = zeros.index_add(0, inverse, (rewards - mean[inverse]) ** 2)
    std = torch.where(count > 1, sq_dev / (count - 1).clamp(min=1), zeros).sqrt()
    return GroupStats(inverse, count[inverse], mean[inverse], std[inverse], num_groups)


def tied_group_mask(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """[B] bool: True where the sample's group has all-equal rewards; and the number of such groups.

    A tied group (all correct or all wrong, or a group of one) gives every sample a zero
    advantage under a group baseline, so DAPO's dynamic sampling drops it.
    """
    rewards = rewards.to(torch.float64)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    init = torch.full((num_groups,), float("inf"), dtype=torch.float64, device=rewards.device)
    gmin = init.scatter_reduce(0, inverse, rewards, reduce="amin")
    gmax = (-init).scatter_reduce(0, inverse, rewards, reduce="amax")
    tied_groups = gmax == gmin
    return tied_groups[inverse], int(tied_groups.sum().item())


def broadcast_to_tokens(per_sequence: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, T]: the sequence's value on every response token, zero on padding."""
    mask = response_mask.to(torch.float32)
    return per_sequence.to(torch.float32).unsqueeze(-1) * mask
