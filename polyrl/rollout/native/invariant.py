"""Batch-invariant decoder arithmetic, shared by the native engine and the trainer
(`rollout.batch_invariant=true`, docs/algorithms.md "Exactly on-policy").

Every function here computes a token's result with the same operations, in the same order, in
the same dtypes, whatever else is in the batch, however it is padded or packed, and whether its
keys come from the engine's KV cache or from the trainer's full-sequence forward. The engine's
decode, prefill and prefix-extend (model.py's `InvariantDecoder` below) and the trainer's
log-prob forward (polyrl/training/batch_invariant.py) both call `layer_forward`, `attend`,
`rms_norm`, `linear` and `token_logprobs`, so the log-probs the engine samples with and the
ones the trainer recomputes are the same bits.

Why each piece is written the way it is (the equalities it buys are tested in
tests/training/test_batch_invariant.py):

* Matmuls (`linear`): BLAS / oneDNN pick kernels and reduction splits by the row count (a GEMV
  for one row, K-splitting for few), so `F.linear(x[:m], W)` rows differ from
  `F.linear(x, W)[:m]` (2026-12-04, Intel Xeon with AMX, 2 threads, a 1408 x 512 weight: fp32
  rows differ for m = 1, 2, 3, 4, 8; bf16 for m = 32). Here rows always go through `F.linear` in tiles of exactly `TILE` rows
  (the caller pads), so every row is multiplied by the same kernel on the same shape; within a
  tile a row's result does not depend on its position or on the other rows.
* One thread (`serial`): a threaded GEMM splits its work by the thread count, which differs
  between a Ray rollout actor and a trainer rank; element-wise kernels split a tensor into one
  chunk per thread and compute each chunk's tail with the scalar (not the vectorised) exp / cos,
  which differ in the last bit. Inside `serial()` torch runs one thread, and activations are
  padded to a multiple of `TILE` rows so no element falls in a scalar tail.
* Attention (`attend`): per query, over keys in chunks of `KEY_CHUNK` positions: the scores by
  an element-wise product and a sum over the head dim, the softmax denominator and the weighted
  values summed within each chunk and then chunk after chunk (a cumulative sum, sequential).
  Keys past a query's position contribute exact zeros, so the result is the same over the
  engine's cache capacity and over the trainer's sequence length. Scores and sums in float32.
* Experts (`experts`, Qwen3-MoE / Qwen2-MoE): the router's logits through `linear`, the
  softmax and top-k per row; each expert's tokens gathered and multiplied in their own padded
  tiles (a token's product is the same bits whichever tokens share its expert's tile), and a
  token's k expert outputs summed in its top-k slot order, one element-wise add at a time.
* Casts: weights are used in the compute dtype (`w.to(dtype)`: a no-op in the engine, the same
  rounding as autocast in the trainer); the residual stream is in the compute dtype; norms in
  float32 then rounded (as the Hugging Face RMSNorm); logits in float32.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from polyrl.rollout.native.loader import ModelSpec, rope_tables
from polyrl.rollout.native.moe import MoeSpec

TILE = 64
"""Rows per matmul call. A multiple of 64 also keeps every element-wise kernel on its vectorised
path (fp32 vectors of 16, bf16 of 32, unrolled twice)."""
KEY_CHUNK = 64
"""Keys summed together before the running (sequential) sum over chunks."""
QUERY_BLOCK = 64
"""Queries of one sequence attended together in the trainer's forward (bounds the [queries,
heads, keys, head_dim] product's memory; the result does not depend on it)."""

_threads_lock = threading.Lock()
_serial_depth = 0
_saved_threads = 1


@contextmanager
def serial():
    """torch on one thread for the enclosed computation (re-entrant; restores the count after)."""
    global _serial_depth, _saved_threads
    with _threads_lock:
        if _serial_depth == 0:
            _saved_threads = torch.get_num_threads()
            torch.set_num_threads(1)
        _serial_depth += 1
    try:
        yield
    finally:
        with _threads_lock:
            _serial_depth -= 1
            if _serial_depth == 0:
                torch.set_num_threads(_saved_threads)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_rows(x: torch.Tensor, multiple: int = TILE) -> torch.Tensor:
    """x [N, ...] with zero rows appended up to a multiple of `multiple` (contiguous)."""
    extra = round_up(max(x.shape[0], 1), multiple) - x.shape[0]
    if extra:
        x = torch.cat([x, x.new_zeros(extra, *x.shape[1:])])
    return x.contiguous()


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x [N, K] (N a multiple of TILE) @ w^T + b, one `F.linear` per TILE rows."""
    x = x.contiguous()
    return torch.cat([F.linear(x[i:i + TILE], w, b) for i in range(0, x.shape[0], TILE)])


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The Hugging Face RMSNorm over the last dim: float32 statistics, rounded, times the weight."""
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return w * (xf * torch.rsqrt(var + eps)).to(x.dtype)


_tables: dict = {}


def rope(spec: ModelSpec, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [N, 1, head_dim] at `positions`, from tables whose length is a multiple
    of 1024 (one vectorised pass each, so a position's value never depends on the length)."""
    need = int(positions.max()) + 1 if positions.numel() else 1
    key = (spec.architecture, spec.head_dim, float(spec.rope_scaling), tuple(spec.inv_freq.tolist()), dtype,
           positions.device)
    cos, sin = _tables.get(key, (None, None))
    if cos is None or cos.shape[0] < need:
        with serial():
            cos, sin = rope_tables(spec, round_up(need, 1024), dtype, positions.device)
        _tables[key] = (cos, sin)
    return cos[positions, None, :], sin[positions, None, :]


@dataclass
class LayerView:
    """One decoder layer's tensors in the compute dtype, under the names of the math."""
    input_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate: torch.Tensor | None  # gate / up / down: None in a mixture-of-experts layer (`moe`)
    up: torch.Tensor | None
    gate_bias: torch.Tensor | None
    up_bias: torch.Tensor | None
    down: torch.Tensor | None
    down_bias: torch.Tensor | None
    moe: ExpertsView | None = None


@dataclass
class ExpertsView:
    """A mixture-of-experts layer's tensors in the compute dtype (moe.py's layout)."""
    router: torch.Tensor  # [E, H]
    gate_up: torch.Tensor  # [E, 2I, H]: gate rows then up rows
    down: torch.Tensor  # [E, H, I]
    shared_gate: torch.Tensor | None = None  # Qwen2-MoE's shared expert: [S, H]
    shared_up: torch.Tensor | None = None  # [S, H]
    shared_down: torch.Tensor | None = None  # [H, S]
    shared_expert_gate: torch.Tensor | None = None  # [1, H]


Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(q [N, nh, hd], k [N, nkv, hd], v [N, nkv, hd]) -> [N, nh, hd]: where the keys come from."""

Choose = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(the router's top-k ids [N, k], its float32 probabilities [N, E]) -> the ids the experts use:
a mixture-of-experts layer's hook (the engine records routes, the trainer replays them)."""

_ACTS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def layer_forward(spec: ModelSpec, lw: LayerView, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attention: Attention, choose: Choose | None = None) -> torch.Tensor:
    """One decoder layer over rows x [N, H] (N a multiple of TILE), each row one token;
    `choose`: a mixture-of-experts layer's routing hook (`Choose`)."""
    N, eps = x.shape[0], spec.rms_norm_eps
    h = rms_norm(x, lw.input_norm, eps)
    q = linear(h, lw.q, lw.q_bias).view(N, spec.num_heads, spec.head_dim)
    k = linear(h, lw.k, lw.k_bias).view(N, spec.num_kv_heads, spec.head_dim)
    v = linear(h, lw.v, lw.v_bias).view(N, spec.num_kv_heads, spec.head_dim)
    if lw.q_norm is not None:  # Qwen3: RMSNorm over each head's vector, before RoPE
        q, k = rms_norm(q, lw.q_norm, eps), rms_norm(k, lw.k_norm, eps)
    half = spec.head_dim // 2
    q = q * cos + q.roll(half, -1) * sin
    k = k * cos + k.roll(half, -1) * sin
    a = attention(q, k, v).reshape(N, spec.q_size)
    x = x + linear(a, lw.o, lw.o_bias)
    h = rms_norm(x, lw.post_norm, eps)
    act = _ACTS[spec.hidden_act]
    if lw.moe is not None:
        return x + experts(spec.moe, lw.moe, h, act, choose)
    mid = act(linear(h, lw.gate, lw.gate_bias)) * linear(h, lw.up, lw.up_bias)
    return x + linear(mid, lw.down, lw.down_bias)


def experts(moe: MoeSpec, ev: ExpertsView, h: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor],
            choose: Choose | None = None) -> torch.Tensor:
    """The mixture-of-experts MLP of rows h [N, H] (N a multiple of TILE; post-norm), routed as
    moe.py's `route` (logits in h's dtype, softmax in float32, top-k, optionally renormalised,
    weights cast back), each token's result independent of the other rows.

    The (token, slot) pairs are sorted by expert; each expert's rows are padded to whole tiles
    and multiplied by `linear`, so a pair's product does not depend on how many tokens chose that
    expert. Differentiable (the trainer's forward): the weights of the chosen experts are
    `probs.gather(ids)`, which are the top-k values themselves when `choose` keeps the ids."""
    N, k = h.shape[0], moe.top_k
    probs = torch.softmax(linear(h, ev.router, None), dim=-1, dtype=torch.float32)  # row by row
    ids = torch.topk(probs, k, dim=-1).indices
    if choose is not None:
        ids = choose(ids, probs)
    top = probs.gather(-1, ids)
    if moe.norm_topk_prob:  # the slots' sum one add at a time: no reduction kernel picks an order
        total = top[:, 0]
        for j in range(1, k):
            total = total + top[:, j]
        top = top / total[:, None]
    weights = top.to(h.dtype)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    pieces, start = [], 0
    for e, n in enumerate(torch.bincount(flat, minlength=ev.gate_up.shape[0]).tolist()):  # per expert
        if n:
            rows = pad_rows(h[token[start:start + n]])
            gate, up = linear(rows, ev.gate_up[e], None).chunk(2, dim=-1)
            mid = act(gate.contiguous()) * up  # contiguous: a whole number of vectors, no scalar tail
            pieces.append(linear(mid, ev.down[e], None)[:n])
        start += n
    y = torch.cat(pieces)[torch.argsort(order)].view(N, k, -1)  # back to (token, slot) order
    out = y[:, 0] * weights[:, :1]
    for j in range(1, k):
        out = out + y[:, j] * weights[:, j:j + 1]
    if ev.shared_gate is not None:  # Qwen2-MoE: the shared expert, gated by a sigmoid
        mid = act(linear(h, ev.shared_gate, None)) * linear(h, ev.shared_up, None)
        out = out + torch.sigmoid(linear(h, ev.shared_expert_gate, None)) * linear(mid, ev.shared_down, None)
    return out


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
           scale: float) -> torch.Tensor:
    """Softmax attention of M queries, each over its first `visible[m]` keys.

    q [M, nkv, g, hd]; keys / values [M or 1, nkv, Lp, hd] with Lp a multiple of KEY_CHUNK (keys
    past `visible` may hold anything finite); visible [M] -> [M, nkv, g, hd] in q's dtype.
    Differentiable: the backward (`_Attend`) uses ordinary batched matmuls, since gradients need
    not be batch-invariant, only the forward's values."""
    if torch.is_grad_enabled() and (q.requires_grad or keys.requires_grad or values.requires_grad):
        return _Attend.apply(q, keys, values, visible, scale).to(q.dtype)
    return _attend(q, keys, values, visible, scale)[0].to(q.dtype)


def _attend(q, keys, values, visible, scale) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, exp-scores, denominator), float32: the invariant forward."""
    M, nkv, g, hd = q.shape
    Lp = keys.shape[2]
    chunks = Lp // KEY_CHUNK
    qf = q.float().unsqueeze(3)  # [M, nkv, g, 1, hd]
    kf = keys.float().unsqueeze(2)  # [M|1, nkv, 1, Lp, hd]
    # the element-wise product is exact whatever its layout; contiguous so the sum's order is fixed
    scores = (qf * kf).contiguous().sum(-1) * scale  # [M, nkv, g, Lp]
    hidden = torch.arange(Lp, device=q.device)[None, :] >= visible[:, None]  # [M, Lp]
    scores = scores.masked_fill(hidden[:, None, None, :], float("-inf"))
    p = (scores - scores.amax(-1, keepdim=True)).exp()  # masked keys: exactly 0
    den = p.view(M, nkv, g, chunks, KEY_CHUNK).sum(-1).cumsum(-1)[..., -1:]  # [M, nkv, g, 1]
    vf = values.float().unsqueeze(2)  # [M|1, nkv, 1, Lp, hd]
    weighted = (p.unsqueeze(-1) * vf).contiguous().view(M, nkv, g, chunks, KEY_CHUNK, hd).sum(-2)
    num = weighted.cumsum(-2)[..., -1, :]  # [M, nkv, g, hd], chunk after chunk
    return num / den, p, den


class _Attend(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, keys, values, visible, scale):
        out, p, den = _attend(q, keys, values, visible, scale)
        ctx.save_for_backward(q, keys, values, p / den, out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, keys, values, probs, out = ctx.saved_tensors
        shared = keys.shape[0] == 1 and q.shape[0] != 1  # one key set for every query
        qf, kf, vf, do = q.float(), keys.float(), values.float(), grad_out.float()
        d_values = probs.transpose(-1, -2) @ do  # [M, nkv, Lp, hd]
        d_probs = do @ vf.transpose(-1, -2)  # [M, nkv, g, Lp]
        d_scores = probs * (d_probs - (do * out).sum(-1, keepdim=True)) * ctx.scale
        d_q = d_scores @ kf
        d_keys = d_scores.transpose(-1, -2) @ qf
        if shared:
            d_keys, d_values = d_keys.sum(0, keepdim=True), d_values.sum(0, keepdim=True)
        return d_q.to(q.dtype), d_keys.to(keys.dtype), d_values.to(values.dtype), None, None


def self_attention(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   segments: list[tuple[int, int]], scale: float) -> torch.Tensor:
    """Causal attention within each segment (start, length) of the rows; rows outside every
    segment (padding) get zeros. q [N, nh, hd], k / v [N, nkv, hd] -> [N, nh, hd]."""
    N = q.shape[0]
    nkv, g, hd = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, spec.head_dim
    pieces, at = [], 0
    for start, n in sorted(segments):
        if start > at:
            pieces.append(q.new_zeros(start - at, spec.num_heads, hd))
        Lp = round_up(n, KEY_CHUNK)
        keys = F.pad(k[start:start + n].transpose(0, 1), (0, 0, 0, Lp - n)).unsqueeze(0)  # [1, nkv, Lp, hd]
        values = F.pad(v[start:start + n].transpose(0, 1), (0, 0, 0, Lp - n)).unsqueeze(0)
        for s in range(0, n, QUERY_BLOCK):
            e = min(s + QUERY_BLOCK, n)
            qb = q[start + s:start + e].view(e - s, nkv, g, hd)
            visible = torch.arange(s + 1, e + 1, device=q.device)
            seen = round_up(e, KEY_CHUNK)  # chunks past the block's last query add exact zeros
            out = attend(qb, keys[:, :, :seen], values[:, :, :seen], visible, scale)
            pieces.append(out.reshape(e - s, spec.num_heads, hd))
        at = start + n
    if at < N:
        pieces.append(q.new_zeros(N - at, spec.num_heads, hd))
    return torch.cat(pieces)


def token_logprobs(hidden: torch.Tensor, final_norm: torch.Tensor, lm_head: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """Final norm, LM head and log-softmax of rows hidden [N, H] -> float32 [N, V] (N any: padded
    here to TILE rows and cut back)."""
    n = hidden.shape[0]
    h = rms_norm(pad_rows(hidden), final_norm, eps)
    return torch.log_softmax(linear(h, lm_head, None).float(), dim=-1)[:n]
