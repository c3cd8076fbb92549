"""Turn a per-token loss matrix [B, T] into a scalar, the three ways the GRPO family does it.

- token-mean: sum over all valid tokens / number of valid tokens. Every token weighs the same,
  so long responses are not down-weighted (DAPO, arXiv:2503.14476 sec. 3.3).
- seq-mean-token-mean: mean over tokens within a sequence, then mean over sequences (original
  GRPO); a token of a short response weighs more than one of a long response.
- seq-mean-token-sum: sum over tokens within a sequence, then mean over sequences (Dr. GRPO,
  arXiv:2503.20783, up to a constant): no length normalisation at all.

With gradient accumulation, pass the *global* `num_tokens` / `num_seqs` of the whole mini-batch:
dividing each micro-batch by its own count would weigh micro-batches unequally.
"""

from __future__ import annotations

from typing import Literal

import torch

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def aggregate(
    loss_mat: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T] 1 on tokens that count
    mode: AggMode = "token-mean",
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> torch.Tensor:  # scalar
    """Aggregate `loss_mat` over `mask`. Rows with no valid token do not count as sequences."""
    mask = mask.to(loss_mat.dtype)
    masked = loss_mat * mask
    if mode == "token-mean":
        denom = mask.sum() if num_tokens is None else torch.tensor(float(num_tokens))
        return masked.sum() / denom.clamp(min=1)
    seq_len = mask.sum(-1)  # [B]
    has_tokens = (seq_len > 0).to(loss_mat.dtype)
    if mode == "seq-mean-token-sum":
        per_seq = masked.sum(-1)
    elif mode == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / seq_len.clamp(min=1)
    else:
        raise ValueError(f"unknown loss_agg_mode '{mode}'; valid choices: {', '.join(AGG_MODES)}")
    denom = has_tokens.sum() if num_seqs is None else torch.tensor(float(num_seqs))
    return (per_seq * has_tokens).sum() / denom.clamp(min=1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over positions where `mask` is 1 (0 when the mask is empty)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)
