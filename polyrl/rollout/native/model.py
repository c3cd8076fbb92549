"""The lean decoder forward: Llama / Qwen2 / Qwen3 (and Qwen3-MoE / Qwen2-MoE, whose expert
layers are moe.py's) in plain torch ops over fused weights.

Numerics follow the Hugging Face reference (RMSNorm, RoPE tables in float32, softmax in float32)
so the logprobs a trainer recomputes match what the engine sampled from. Speed comes from issuing
few, large ops: fused qkv and gate/up matmuls (fp32 on a CPU: against prepacked weights, see matmul.py),
q and k normed and rotated together, one shared attention mask per step, and logits only for the
positions that are sampled.

Attention runs in the KV cache's dtype: the model's, except where the matmuls widen bf16 / fp16
to fp32 on a CPU without their matrix instructions (matmul.py). There the cache holds the same
bf16 / fp16-rounded keys and values in fp32 and the attention runs in fp32 (the CPU's bf16
batched GEMMs are emulated, 4-6x slower): scores and probabilities are not rounded to bf16 in
between, as in a fused attention kernel, so the result is slightly more accurate than the plain
bf16 path's; its output is rounded back to the model's dtype.

A vision-language model (vision.py) adds two inputs to prefill and prefix-extend, `MultimodalInputs`:
the vision tower's features, which replace the embeddings of the image-pad tokens, and M-RoPE
position ids; decode takes each sequence's rope position (cache index + its rope delta). Without
them (text-only prompts) the forward is the plain one, unchanged.

Shapes: P prompts padded to T tokens in prefill; B live sequences in decode (slots 0..B-1);
H hidden, nh / nkv query / key-value heads, hd head dim, L attended length.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from polyrl.rollout.native.kv_cache import KVCache
from polyrl.rollout.native.loader import ModelSpec, rope_tables
from polyrl.rollout.native.moe import moe_block
from polyrl.rollout.native.vision import encode_images, mrope_tables, section_rows
from polyrl.rollout.native.weights import ComputeWeights, LayerWeights, ModelWeights

_ACTS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


@dataclass
class MultimodalInputs:
    """A vision-language forward's extra inputs over tokens [P, T] (vision.py)."""

    positions: torch.Tensor
    """M-RoPE ids [3, P, T] (text-only rows: their plain positions in all three rows)."""
    features: torch.Tensor | None = None
    """The vision tower's output [image-pad tokens, H], in the order the tokens appear (row by row)."""
    deepstack: list[torch.Tensor] | None = None
    """Qwen3-VL: features [image-pad tokens, H] added to those tokens after decoder layer i."""


class DecoderModel:
    def __init__(self, spec: ModelSpec, weights: ModelWeights, *, max_len: int, dtype, device):
        self.spec, self.w = spec, weights
        self.cos, self.sin = rope_tables(spec, max_len, dtype, device)
        self.act = _ACTS[spec.hidden_act]
        self.scale = spec.head_dim**-0.5
        self.device = device
        self._rows = None if spec.vision is None else section_rows(spec.vision, spec.head_dim, device)
        self.last_routes: torch.Tensor | None = None
        """After a decode step of a mixture-of-experts model: the expert ids [B, moe layers, k]
        each input token was routed to (the scheduler keeps them per sequence); after a prefill
        (or extend.py), those of each prompt's last token [P, moe layers, k]."""

    # -- vision-language ------------------------------------------------------------------------

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The vision tower's features [image tokens, H] of these images (and Qwen3-VL's
        deep-stack features), in the embeddings' dtype."""
        return encode_images(self.w.visual, pixel_values, grid_thw, self.w.embed.dtype)

    def embed(self, tokens: torch.Tensor, mm: MultimodalInputs, valid: torch.Tensor | None = None):
        """(token embeddings [..., H] with the image-pad tokens' (within `valid`) replaced by the
        features, that mask)."""
        x = F.embedding(tokens, self.w.embed)
        mask = tokens == self.spec.vision.image_token_id
        if valid is not None:
            mask &= valid
        if mm.features is None:
            return x, mask
        return x.masked_scatter(mask[..., None], mm.features), mask

    @staticmethod
    def deep_stack(x: torch.Tensor, layer: int, mm: MultimodalInputs | None, mask: torch.Tensor | None):
        """Qwen3-VL: x with deep-stack features `layer` added at the image tokens (as transformers'
        `_deepstack_process` does after that decoder layer); x itself otherwise."""
        if mm is None or not mm.deepstack or layer >= len(mm.deepstack):
            return x
        return x.masked_scatter(mask[..., None], x[mask] + mm.deepstack[layer])

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / signed sin [..., 1, hd] (broadcast over heads) for M-RoPE ids [3, ...]."""
        cos, sin = mrope_tables(self.cos, self.sin, self._rows, positions)
        return cos.unsqueeze(-2), sin.unsqueeze(-2)

    # -- shared pieces --------------------------------------------------------------------------

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.spec.rms_norm_eps)

    def _qkv(self, h: torch.Tensor, lw: LayerWeights, cw: ComputeWeights, cos: torch.Tensor, sin: torch.Tensor):
        """[..., H] -> q [..., nh, hd], k and v [..., nkv, hd] with qk-norm and RoPE applied."""
        s = self.spec
        qkv = cw.matmul.linear(h, lw.qkv, lw.qkv_bias)
        qk = qkv[..., : s.q_size + s.kv_size].unflatten(-1, (s.num_heads + s.num_kv_heads, s.head_dim))
        v = qkv[..., s.q_size + s.kv_size :].unflatten(-1, (s.num_kv_heads, s.head_dim))
        if lw.qk_norm is not None:  # Qwen3: RMSNorm over each head's vector, before RoPE
            qk = F.rms_norm(qk, (s.head_dim,), None, s.rms_norm_eps) * lw.qk_norm
        # rotate_half(x) * sin == roll(x, hd/2) * sin_signed (see loader.rope_tables)
        qk = qk * cos + qk.roll(s.head_dim // 2, -1) * sin
        return qk[..., : s.num_heads, :], qk[..., s.num_heads :, :], v

    def _mlp_residual(self, x: torch.Tensor, lw: LayerWeights, cw: ComputeWeights,
                      routes: list | None = None) -> torch.Tensor:
        """x + MLP(post_norm(x)); a mixture-of-experts layer's experts (moe.py) in place of the
        MLP, its top-k expert ids appended to `routes` where given."""
        if lw.moe is not None:
            return x + moe_block(self._norm(x, lw.post_norm), lw.moe, self.spec.moe, self.act, routes)
        mm = cw.matmul
        gate, up = mm.linear(self._norm(x, lw.post_norm), lw.gate_up, lw.gate_up_bias).chunk(2, dim=-1)
        return mm.residual_linear(x, self.act(gate) * up, lw.down, lw.down_bias)

    def _logits(self, x: torch.Tensor, cw: ComputeWeights) -> torch.Tensor:
        return cw.matmul.linear(self._norm(x, self.w.final_norm), cw.lm_head, None).float()

    # -- prefill --------------------------------------------------------------------------------

    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, cache: KVCache,
                mm: MultimodalInputs | None = None):
        """Right-padded prompts [P, T] -> float32 logits [P, V] at each prompt's last token.

        Right padding needs no mask: with a causal mask a real token never sees a later pad.
        The pads' K/V land beyond each prompt's length and are overwritten by decode.
        """
        s = self.spec
        P, T = tokens.shape
        cw = self.w.compute  # read once: an update swaps in a whole new set (tensors + matmul)
        mask = None
        if mm is None:
            cos, sin = self.cos[:T, None, :], self.sin[:T, None, :]
            x = F.embedding(tokens, self.w.embed)  # [P, T, H]
        else:
            cos, sin = self.rope(mm.positions)  # [P, T, 1, hd]
            valid = torch.arange(T, device=tokens.device)[None, :] < lengths[:, None]
            x, mask = self.embed(tokens, mm, valid)
        routes = [] if s.moe is not None else None
        for i, lw in enumerate(cw.layers):
            q, k, v = self._qkv(self._norm(x, lw.input_norm), lw, cw, cos, sin)
            # [P, heads, T, hd], in the cache's dtype (fp32 where the matmuls widen bf16 / fp16)
            q, k, v = (t.transpose(1, 2).to(cache.dtype) for t in (q, k, v))
            cache.k[i, slots, :, :, :T] = k.transpose(-1, -2)
            cache.v[i, slots, :, :T] = v
            attn = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scale, enable_gqa=s.num_heads != s.num_kv_heads
            ).to(x.dtype)
            x = cw.matmul.residual_linear(x, attn.transpose(1, 2).flatten(2), lw.o, lw.o_bias)
            x = self.deep_stack(self._mlp_residual(x, lw, cw, routes), i, mm, mask)
        last_index = (torch.arange(P, device=x.device), lengths - 1)
        # the routes of each prompt's last token: what a resumed partial rollout's boundary token used
        self.last_routes = None if routes is None else torch.stack([r[last_index] for r in routes], 1)
        return self._logits(x[last_index], cw)

    # -- decode ---------------------------------------------------------------------------------

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, attend_len: int,
               rope_positions: torch.Tensor | None = None):
        """One new token per live sequence: tokens, positions [B] -> float32 logits [B, V].

        Sequence b lives in cache slot b; its token is written at `positions[b]` and it attends
        to positions <= positions[b]. `attend_len` = max(positions) + 1 (<= the cache's capacity).
        `rope_positions` [B]: the position each token is rotated by where that is not its cache
        index (a vision-language prompt's rope delta; the three M-RoPE rows are equal in decode).
        """
        s = self.spec
        B = tokens.shape[0]
        # Attend over the cache's whole capacity where that reads K and V in place (kv_cache.py);
        # the positions past each sequence's end are masked either way.
        L = cache.capacity if cache.attends_in_place(attend_len) else attend_len
        nkv, g, hd = s.num_kv_heads, s.num_heads // s.num_kv_heads, s.head_dim
        rows = torch.arange(B, device=tokens.device)
        rotary = positions if rope_positions is None else rope_positions
        cos, sin = self.cos[rotary, None, :], self.sin[rotary, None, :]
        # One additive mask for all layers, already in baddbmm's [B * nkv, g, L] shape:
        # 0 where visible, -inf past each sequence's end.
        hidden = torch.arange(L, device=tokens.device)[None, :] > positions[:, None]  # [B, L]
        bias = torch.zeros(B, L, dtype=cache.dtype, device=tokens.device).masked_fill_(hidden, float("-inf"))
        bias = bias[:, None, None, :].expand(B, nkv, g, L).reshape(B * nkv, g, L)
        cw = self.w.compute
        x = F.embedding(tokens, self.w.embed)  # [B, H]
        routes = [] if s.moe is not None else None
        for i, lw in enumerate(cw.layers):
            q, k, v = self._qkv(self._norm(x, lw.input_norm), lw, cw, cos, sin)
            q, k, v = q.to(cache.dtype), k.to(cache.dtype), v.to(cache.dtype)  # no-ops unless widened
            cache.k[i, rows, :, :, positions] = k
            cache.v[i, rows, :, positions] = v
            # GQA without repeating K/V: the g query heads sharing a kv head form one small GEMM.
            # K is stored transposed, so both operands are read in place from the cache.
            keys_t = cache.k[i, :B, :, :, :L].view(B * nkv, hd, L)
            values = cache.v[i, :B, :, :L].view(B * nkv, L, hd)
            scores = torch.baddbmm(bias, q.reshape(B * nkv, g, hd), keys_t, alpha=self.scale)
            attn = torch.bmm(torch.softmax(scores, dim=-1), values).to(x.dtype)  # [B * nkv, g, hd]
            x = cw.matmul.residual_linear(x, attn.view(B, s.q_size), lw.o, lw.o_bias)
            x = self._mlp_residual(x, lw, cw, routes)
        # a mixture-of-experts model: each input token's expert ids [B, moe layers, k] (routes.py)
        self.last_routes = None if routes is None else torch.stack(routes, 1)
        return self._logits(x, cw)
