"""Per-token entropy of the policy from its logits, without materialising a second [N, V] copy.

H = logsumexp(z) - sum_v softmax(z)_v * z_v. A [B, T, V] float32 softmax for a 150k vocabulary
is gigabytes, so rows are processed in chunks; each chunk's temporaries are freed before the
next. Under no_grad (the metric) peak extra memory is one chunk; with grad (an entropy bonus)
autograd keeps each chunk's softmax for the backward pass anyway.
"""

from __future__ import annotations

import torch


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """logits [..., V] -> entropy [...] in float32 (computed in float32 for bf16 inputs)."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = []
    for start in range(0, flat.shape[0], chunk_size):
        chunk = flat[start : start + chunk_size].float()
        logz = torch.logsumexp(chunk, dim=-1)
        probs = torch.softmax(chunk, dim=-1)
        out.append(logz - (probs * chunk).sum(-1))
    if not out:
        return logits.new_zeros(logits.shape[:-1], dtype=torch.float32)
    return torch.cat(out).reshape(logits.shape[:-1])
