"""Per-token values of a critic: a sequence-classification-style head with one output per
position (`AutoModelForTokenClassification`, num_labels=1), read where the policy's logits are.

values[:, k] comes from the same hidden state whose logits give the log-prob of response token k
(`MicroBatch.gather_index`), i.e. the value of the state *before* token k is sampled — the
alignment GAE assumes (polyrl/algorithms/advantages/gae.py).
"""

from __future__ import annotations

import torch

from polyrl.batch import MicroBatch


def response_values(model: torch.nn.Module, mb: MicroBatch, **_: object) -> tuple[torch.Tensor, None]:
    """(values [b, R], None): the engine's head interface (training/ddp.py)."""
    scores = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits  # [b, L, 1]
    return scores.squeeze(-1).float().gather(1, mb.gather_index), None


def load_value_model(path: str, dtype: torch.dtype, trust_remote_code: bool = False) -> torch.nn.Module:
    """The policy architecture with a scalar head per token (the head starts from random)."""
    from transformers import AutoModelForTokenClassification

    from polyrl.training.model_loading import model_dir

    model = AutoModelForTokenClassification.from_pretrained(
        str(model_dir(path)), num_labels=1, dtype=dtype, trust_remote_code=trust_remote_code,
        attn_implementation="sdpa")
    for m in model.modules():  # dropout on a regression target only adds noise to the values
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model
