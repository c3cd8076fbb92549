"""DAPO's two treatments of responses that run into the length limit.

DAPO, Yu et al. 2025 (arXiv:2503.14476) sec. 3.4. A response cut at the limit gets the reward
of an unfinished answer although its reasoning may be sound; that reward noise hurts training.

Overlong filtering: truncated responses are masked out of the loss (they still count in their
group's reward statistics, so the others' advantages do not change).

Soft overlong punishment, eq. 13, with L_max the generation limit and L_buf the buffer:
    R_length(L) = 0                              L <= L_max - L_buf
                = ((L_max - L_buf) - L) / L_buf   L_max - L_buf < L <= L_max
                = -1                             L > L_max
added to the task reward times a penalty factor: a smooth slope towards the limit instead of a
cliff at it. DAPO used L_max = 20480, L_buf = 4096 (the expected length is L_max - L_buf).
"""

from __future__ import annotations

import torch

from polyrl.algorithms.overlong_config import OverlongConfig

__all__ = ["OverlongConfig", "overlong_filter_mask", "overlong_penalty"]


def overlong_penalty(
    lengths: torch.Tensor,  # [B] response lengths in tokens (those counted against the limit)
    max_length: int,  # L_max: rollout.response_length
    buffer_length: int,  # L_buf
    penalty_factor: float = 1.0,
) -> torch.Tensor:  # [B] float32, in [-penalty_factor, 0]: add it to the rewards
    if not 0 < buffer_length < max_length:
        raise ValueError(f"overlong buffer_length={buffer_length} must lie in (0, max_length="
                         f"{max_length}); lower algorithm.overlong.buffer_length")
    expected = max_length - buffer_length
    ramp = (expected - lengths.to(torch.float32)) / buffer_length
    # clamp to [-1, 0]: no reward for being short, no more than -1 for any overshoot
    return ramp.clamp(min=-1.0, max=0.0) * penalty_factor


def overlong_filter_mask(
    truncated: torch.Tensor,  # [B] bool: the response hit the length limit without finishing
    loss_mask: torch.Tensor,  # [B, R]
) -> torch.Tensor:  # [B, R], loss_mask's dtype: truncated rows zeroed
    keep = (~truncated.bool()).to(loss_mask.dtype).unsqueeze(-1)
    return loss_mask * keep
