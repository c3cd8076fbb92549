"""The native engine's forward in batch-invariant mode (`NativeEngine(batch_invariant=True)`,
`rollout.batch_invariant=true`): prefill, decode and prefix-extend built from invariant.py's
pieces, the ones the trainer's log-prob forward uses (polyrl/training/batch_invariant.py), so
a sampled token's log-prob is the trainer's to the last bit.

It returns float32 log-probs (the log-softmax the trainer computes), not logits: sampling draws
from them as from logits (same distribution) and reports the sampled token's entry as is
(`sample(..., normalized=True)`). The weights are the engine's plain fused tensors read through
views (q / k / v and gate / up are row slices of one matrix: the same shapes and values as the
trainer's separate projections); they are never packed (matmul.py) and never widened, and the KV
cache holds keys and values in the compute dtype. A mixture-of-experts layer (Qwen3-MoE, Qwen2-MoE)
runs invariant.py's `experts` over the same fused expert tensors the trainer holds; decode records
each input token's expert ids (`last_routes`, as DecoderModel does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polyrl.rollout.native import invariant as inv
from polyrl.rollout.native.kv_cache import KVCache
from polyrl.rollout.native.loader import ModelSpec
from polyrl.rollout.native.moe import MoeWeights
from polyrl.rollout.native.weights import LayerWeights, ModelWeights


def engine_layer_view(spec: ModelSpec, lw: LayerWeights) -> inv.LayerView:
    """Views of one fused layer under the math's names (no copy)."""
    q, kv, I, nh = spec.q_size, spec.kv_size, spec.intermediate_size, spec.num_heads
    b = lw.qkv_bias
    gb = lw.gate_up_bias
    return inv.LayerView(
        input_norm=lw.input_norm, q=lw.qkv[:q], k=lw.qkv[q:q + kv], v=lw.qkv[q + kv:],
        q_bias=None if b is None else b[:q], k_bias=None if b is None else b[q:q + kv],
        v_bias=None if b is None else b[q + kv:],
        q_norm=None if lw.qk_norm is None else lw.qk_norm[0],
        k_norm=None if lw.qk_norm is None else lw.qk_norm[nh],
        o=lw.o, o_bias=lw.o_bias, post_norm=lw.post_norm,
        gate=None if lw.moe else lw.gate_up[:I], up=None if lw.moe else lw.gate_up[I:],
        gate_bias=None if gb is None else gb[:I], up_bias=None if gb is None else gb[I:],
        down=lw.down, down_bias=lw.down_bias, moe=None if lw.moe is None else experts_view(lw.moe),
    )


def experts_view(w: MoeWeights) -> inv.ExpertsView:
    """A mixture-of-experts layer's tensors under the math's names (views, no copy)."""
    S = 0 if w.shared_down is None else w.shared_down.shape[1]
    return inv.ExpertsView(
        router=w.router, gate_up=w.gate_up, down=w.down,
        shared_gate=None if not S else w.shared_gate_up[:S], shared_up=None if not S else w.shared_gate_up[S:],
        shared_down=w.shared_down, shared_expert_gate=w.shared_gate,
    )


class InvariantDecoder:
    """DecoderModel's interface (prefill / decode / extend), returning float32 log-probs."""

    invariant = True

    def __init__(self, spec: ModelSpec, weights: ModelWeights, *, dtype: torch.dtype, device):
        self.spec, self.w, self.dtype, self.device = spec, weights, dtype, torch.device(device)
        self.scale = spec.head_dim**-0.5
        self.last_routes: torch.Tensor | None = None
        """After a decode step of a mixture-of-experts model: the expert ids [B, moe layers, k]
        each input token was routed to (as DecoderModel's, model.py)."""

    def _layers(self) -> list[inv.LayerView]:
        return [engine_layer_view(self.spec, lw) for lw in self.w.layers]

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor):
        x = inv.pad_rows(F.embedding(tokens, self.w.embed))
        pos = F.pad(positions, (0, x.shape[0] - positions.shape[0]))
        cos, sin = inv.rope(self.spec, pos, self.dtype)
        return x, cos, sin

    def _logprobs(self, rows: torch.Tensor) -> torch.Tensor:
        return inv.token_logprobs(rows, self.w.final_norm, self.w.lm_head, self.spec.rms_norm_eps)

    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, cache: KVCache):
        """Right-padded prompts [P, T] -> log-probs [P, V] after each prompt's last token."""
        s = self.spec
        P, T = tokens.shape
        segments = [(i * T, int(n)) for i, n in enumerate(lengths.tolist())]
        with inv.serial():
            x, cos, sin = self._embed(tokens.reshape(-1), torch.arange(T, device=tokens.device).repeat(P))
            for i, lw in enumerate(self._layers()):
                def attention(q, k, v, i=i):
                    kk = k[: P * T].view(P, T, s.num_kv_heads, s.head_dim)
                    vv = v[: P * T].view(P, T, s.num_kv_heads, s.head_dim)
                    cache.k[i, slots, :, :, :T] = kk.permute(0, 2, 3, 1)
                    cache.v[i, slots, :, :T] = vv.transpose(1, 2)
                    return inv.self_attention(s, q, k, v, segments, self.scale)
                x = inv.layer_forward(s, lw, x, cos, sin, attention)
            last = x[torch.arange(P, device=x.device) * T + lengths - 1]
            return self._logprobs(last)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, attend_len: int):
        """One new token per live sequence (slot b = sequence b) -> log-probs [B, V]."""
        s = self.spec
        B = tokens.shape[0]
        nkv, g, hd = s.num_kv_heads, s.num_heads // s.num_kv_heads, s.head_dim
        rows = torch.arange(B, device=tokens.device)
        Lp = inv.round_up(attend_len, inv.KEY_CHUNK)
        L = min(cache.capacity, Lp)
        routes: list[torch.Tensor] = []

        def record(ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
            routes.append(ids[:B])
            return ids

        with inv.serial():
            x, cos, sin = self._embed(tokens, positions)
            for i, lw in enumerate(self._layers()):
                def attention(q, k, v, i=i):
                    cache.k[i, rows, :, :, positions] = k[:B]
                    cache.v[i, rows, :, positions] = v[:B]
                    keys = cache.k[i, :B, :, :, :L].transpose(-1, -2)  # [B, nkv, L, hd]
                    values = cache.v[i, :B, :, :L]
                    if L < Lp:
                        keys, values = (F.pad(t, (0, 0, 0, Lp - L)) for t in (keys, values))
                    out = inv.attend(q[:B].view(B, nkv, g, hd), keys, values, positions + 1, self.scale)
                    return inv.pad_rows(out.view(B, s.num_heads, hd))
                x = inv.layer_forward(s, lw, x, cos, sin, attention, record)
            self.last_routes = torch.stack(routes, 1) if routes else None
            return self._logprobs(x[:B])

    def extend(self, tokens: list[int], start: int, slot: int, cache: KVCache) -> torch.Tensor:
        """Positions start .. start + len(tokens) - 1 of row `slot` (its earlier positions already
        cached) -> log-probs [V] after the last one (extend.py's contract)."""
        s = self.spec
        S, T = len(tokens), start + len(tokens)
        nkv, g, hd = s.num_kv_heads, s.num_heads // s.num_kv_heads, s.head_dim
        Lp = inv.round_up(T, inv.KEY_CHUNK)
        ids = torch.tensor(tokens, device=self.device)
        with inv.serial():
            x, cos, sin = self._embed(ids, torch.arange(start, T, device=self.device))
            for i, lw in enumerate(self._layers()):
                def attention(q, k, v, i=i):
                    cache.k[i, slot, :, :, start:T] = k[:S].permute(1, 2, 0)
                    cache.v[i, slot, :, start:T] = v[:S].transpose(0, 1)
                    keys = F.pad(cache.k[i, slot, :, :, :T].transpose(-1, -2), (0, 0, 0, Lp - T))[None]
                    values = F.pad(cache.v[i, slot, :, :T], (0, 0, 0, Lp - T))[None]
                    outs = []
                    for b in range(0, S, inv.QUERY_BLOCK):
                        e = min(b + inv.QUERY_BLOCK, S)
                        visible = torch.arange(start + b + 1, start + e + 1, device=self.device)
                        outs.append(inv.attend(q[b:e].view(e - b, nkv, g, hd), keys, values, visible,
                                               self.scale).view(e - b, s.num_heads, hd))
                    return inv.pad_rows(torch.cat(outs))
                x = inv.layer_forward(s, lw, x, cos, sin, attention)
            return self._logprobs(x[S - 1:S])[0]
