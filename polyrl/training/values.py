"""Per-token values of a critic: a sequence-classification-style head with one output per
position (`AutoModelForTokenClassification`, num_labels=1), read where the policy's logits are.

values[:, k] comes from the same hidden state whose logits give the log-prob of response token k
(`MicroBatch.gather_index`), i.e. the value of the state *before* token k is sampled — the
alignment GAE assumes (polyrl/algorithms/advantages/gae.py).
"""

from __future__ import annotations

import torch

from polyrl.batch import MicroBatch
from polyrl.training.ulysses import gather_shards, own_positions
from polyrl.training.varlen import packed_forward_kwargs


def response_values(model: torch.nn.Module, mb: MicroBatch, **_: object) -> tuple[torch.Tensor, None]:
    """(values [b, R], None): the engine's head interface (training/ddp.py). A packed micro-batch
    (the critic packs only under sequence parallelism) reads its row as response_logprobs does:
    this rank's positions of it, summed over the sp group (training/ulysses.py)."""
    kwargs = packed_forward_kwargs(mb)
    scores = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, **kwargs).logits  # [b, L, 1]
    scores = scores.squeeze(-1).float()
    if not kwargs:
        return scores.gather(1, mb.gather_index), None
    real = torch.arange(mb.gather_index.shape[1], device=scores.device).unsqueeze(0) < \
        mb.response_lengths.to(scores.device).unsqueeze(1)
    index, real = own_positions(mb, mb.gather_index, real)
    values = scores.new_zeros(real.shape).masked_scatter(real, scores[0, index[real]])
    return gather_shards(mb, values), None


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
