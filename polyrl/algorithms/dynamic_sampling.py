"""DAPO dynamic sampling: which groups of a generation round carry a learning signal.

DAPO, Yu et al. 2025 (arXiv:2503.14476) sec. 3.2, eq. 11: a prompt whose samples all get the
same reward has zero advantage under a group baseline (GRPO, RLOO, REINFORCE++ baseline), so it
adds no gradient and only shrinks the effective batch. Dynamic sampling keeps generating rounds
of prompts and keeps only the groups whose rewards differ, until the step has
`data.train_batch_size` of them (or `algorithm.max_sampling_rounds` rounds have run).

The trainer loop owns the rounds; these functions are the pure per-round decisions.
"""

from __future__ import annotations

import torch

from polyrl.algorithms.advantages.groups import tied_group_mask


def informative_groups(
    rewards: torch.Tensor,  # [B]
    groups: torch.Tensor,  # [B] samples of one prompt share an id (any integers)
) -> torch.Tensor:  # [B] bool: the sample's group has at least two different rewards
    """Per-sample mask of the groups whose rewards differ (a group of one never does)."""
    tied, _ = tied_group_mask(rewards, groups)
    return ~tied


def select_informative(
    rewards: torch.Tensor,  # [B]
    groups: torch.Tensor,  # [B]
    needed: int,  # groups still missing from the step's batch
) -> tuple[torch.Tensor, int]:  # keep [B] bool, number of groups kept (<= needed)
    """Keep the first `needed` informative groups, in the order their first sample appears.

    Whole groups are kept or dropped, never split: a group baseline needs all its samples.
    Taking groups in arrival order (not, say, the most varied ones) keeps the selection from
    biasing which prompts the policy learns from.
    """
    informative = informative_groups(rewards, groups)
    _, inverse = torch.unique(groups, return_inverse=True)
    num_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    positions = torch.arange(inverse.numel(), device=inverse.device)
    first = torch.full((num_groups,), inverse.numel(), device=inverse.device, dtype=torch.long)
    first = first.scatter_reduce(0, inverse, positions, reduce="amin")  # [G] first sample's index
    group_informative = torch.zeros(num_groups, dtype=torch.bool, device=inverse.device)
    group_informative[inverse] = informative
    candidates = torch.nonzero(group_informative).squeeze(-1)
    chosen = candidates[torch.argsort(first[candidates])][: max(needed, 0)]
    selected = torch.zeros(num_groups, dtype=torch.bool, device=inverse.device)
    selected[chosen] = True
    return selected[inverse], int(chosen.numel())
