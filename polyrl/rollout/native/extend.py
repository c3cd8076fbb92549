"""Prefill of a prompt whose first `start` positions are already in its cache row.

A multi-turn trajectory's turn k+1 prompt is its turn k prompt + the sampled tokens + a tool
turn; with the earlier KV kept (kv_cache.py, prefix reuse) only the new tokens are computed:
their queries attend to the cached keys and to each other causally. The math is DecoderModel's
prefill (polyrl/rollout/native/model.py) over a window [start, start + S) of one row, built from
the same layer pieces so the numerics match it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polyrl.rollout.native.kv_cache import KVCache
from polyrl.rollout.native.model import DecoderModel, MultimodalInputs


def extend(model: DecoderModel, tokens: list[int], start: int, slot: int, cache: KVCache,
           mm: MultimodalInputs | None = None) -> torch.Tensor:
    """Compute positions start .. start + len(tokens) - 1 of row `slot`; float32 logits [V] at the
    last one. Positions < start must already hold this prompt's KV. `mm` (a vision-language
    prompt): M-RoPE ids [3, 1, S] of the new tokens and the features of the images among them
    (their deep-stack features too, Qwen3-VL)."""
    s, device = model.spec, model.device
    S = len(tokens)
    T = start + S
    # new token i (position start + i) sees every cached position and new tokens <= i
    visible = torch.arange(T, device=device)[None, :] <= torch.arange(start, T, device=device)[:, None]
    cw = model.w.compute
    ids = torch.tensor([tokens], device=device)
    mask = None
    if mm is None:
        cos, sin = model.cos[start:T, None, :], model.sin[start:T, None, :]
        x = F.embedding(ids, model.w.embed)  # [1, S, H]
    else:
        cos, sin = model.rope(mm.positions)
        x, mask = model.embed(ids, mm)
    routes = [] if s.moe is not None else None
    for i, lw in enumerate(cw.layers):
        q, k, v = model._qkv(model._norm(x, lw.input_norm), lw, cw, cos, sin)
        q, k, v = (t.transpose(1, 2).to(cache.dtype) for t in (q, k, v))  # [1, heads, S, hd]
        cache.k[i, slot, :, :, start:T] = k[0].transpose(-1, -2)
        cache.v[i, slot, :, start:T] = v[0]
        keys = cache.k[i, slot, :, :, :T].transpose(-1, -2)[None]  # [1, nkv, T, hd]
        values = cache.v[i, slot, :, :T][None]
        attn = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=visible, scale=model.scale, enable_gqa=s.num_heads != s.num_kv_heads
        ).to(x.dtype)
        x = cw.matmul.residual_linear(x, attn.transpose(1, 2).flatten(2), lw.o, lw.o_bias)
        x = model.deep_stack(model._mlp_residual(x, lw, cw, routes), i, mm, mask)
    # a mixture-of-experts model: the last token's expert ids [1, moe layers, k], as prefill keeps
    model.last_routes = None if routes is None else torch.stack([r[:, -1] for r in routes], 1)
    return model._logits(x[:, -1], cw)[0]
