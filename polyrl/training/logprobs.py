"""Per-token log-probs of response tokens, computing logits only where they are needed.

The LM head is the largest matmul of a small model's forward (vocab x hidden per position);
running it on prompt positions, as `model(input_ids).logits` does, wastes most of those FLOPs.
"""

from __future__ import annotations

import torch

from polyrl.algorithms import entropy_from_logits
from polyrl.batch import MicroBatch


def response_logprobs(
    model: torch.nn.Module, mb: MicroBatch, with_entropy: bool = False, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs [b, R], entropy [b, R] or None) of `mb`'s response tokens under `model`.

    The entropy carries gradient only when `entropy_grad` (an entropy bonus in the loss)."""
    hidden = model.base_model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).last_hidden_state
    H = hidden.shape[-1]
    picked = hidden.gather(1, mb.gather_index.unsqueeze(-1).expand(-1, -1, H))  # [b, R, H]
    logits = model.get_output_embeddings()(picked).float()  # [b, R, V]
    logp_all = torch.log_softmax(logits, dim=-1)  # [b, R, V]
    logprobs = logp_all.gather(-1, mb.target_ids.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if entropy_grad:
        entropy = entropy_from_logits(logits)
    elif with_entropy:
        with torch.no_grad():  # from the log-softmax already computed: no second softmax pass
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprobs, entropy
