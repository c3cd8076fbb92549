"""Mixture-of-experts layers of the native engine: Qwen3-MoE (softmax top-k router) and Qwen2-MoE
(the same router plus a sigmoid-gated shared expert).

Numerics follow transformers' `Qwen3MoeTopKRouter` / `Qwen2MoeSparseMoeBlock`: router logits in
the model's dtype, softmax in float32, top-k of the probabilities, optionally renormalised, the
weights cast back to the model's dtype before they scale the experts' outputs.

The experts run batched, never a Python loop per token: the (token, slot) pairs are sorted by
expert once per layer, and each projection multiplies the contiguous per-expert segments. Where
the engine's matmul packs weights (matmul.py: oneDNN's blocked layout, fp32 on AVX-512 CPUs, bf16
on avx512_bf16 ones without AMX) each expert's two matrices are packed once and a segment is one
packed product (`packed_moe`); elsewhere each projection is one grouped matmul over the segments
(`torch._grouped_mm` on a CPU; on a GPU, or where this torch lacks it, one `mm` per expert that
received tokens). Experts that received no token cost nothing.

Weights are held fused as transformers holds them in memory ([E, 2I, H] gate/up, [E, H, I] down);
a checkpoint on disk names each expert apart (`mlp.experts.{e}.gate_proj.weight`), so both
spellings map onto views of the same tensors (`moe_targets`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.nn.functional as F

from polyrl.batch.routes import encode, routes_dtype
from polyrl.rollout.native.threads import torch_threads

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
"""The mixture-of-experts decoders the engine runs (the router shapes implemented here)."""

KNOWN_MOE_ARCHITECTURES = (
    "MixtralForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM",
    "Glm4MoeForCausalLM", "OlmoeForCausalLM", "Qwen3NextForCausalLM", "Llama4ForCausalLM",
    "Ernie4_5_MoeForCausalLM", "HunYuanMoEV1ForCausalLM", "DbrxForCausalLM", "PhimoeForCausalLM",
)
"""Mixture-of-experts models whose router shape the engine does not implement (yet): refused by
name (docs/moe.md) so the message says what is missing."""


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int
    """Each routed expert's intermediate size (`moe_intermediate_size`)."""
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]
    """Per decoder layer: True where it is a mixture-of-experts block, False a dense MLP."""
    shared_intermediate_size: int = 0
    """Qwen2-MoE: the shared expert's intermediate size (0: no shared expert)."""


def moe_spec(config: Any, arch: str) -> MoeSpec | None:
    """The mixture-of-experts shape of `config` (None for a dense architecture)."""
    if arch not in MOE_ARCHITECTURES:
        return None
    only_dense = set(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1) or 1
    experts = config.num_experts
    sparse = tuple(i not in only_dense and experts > 0 and (i + 1) % step == 0
                   for i in range(config.num_hidden_layers))
    if config.num_experts_per_tok > experts:
        raise ValueError(f"native engine: num_experts_per_tok={config.num_experts_per_tok} exceeds "
                         f"num_experts={experts}")
    shared = config.shared_expert_intermediate_size if arch == "Qwen2MoeForCausalLM" else 0
    return MoeSpec(num_experts=experts, top_k=config.num_experts_per_tok,
                   intermediate_size=config.moe_intermediate_size,
                   norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)),
                   sparse_layers=sparse, shared_intermediate_size=int(shared or 0))


@dataclass
class MoeWeights:
    """One mixture-of-experts layer's tensors. The loaded ones are plain; the forward's copy
    (`packed_moe`) may add each expert's two matrices in the matmul's packed format."""

    router: torch.Tensor  # [E, H]
    gate_up: torch.Tensor  # [E, 2I, H]: gate rows then up rows, as transformers fuses them
    down: torch.Tensor  # [E, H, I]
    shared_gate_up: torch.Tensor | None = None  # [2S, H]
    shared_down: torch.Tensor | None = None  # [H, S]
    shared_gate: torch.Tensor | None = None  # [1, H]
    packed: PackedExperts | None = None
    """Per expert, gate_up[e] and down[e] packed (None: the grouped matmul over the plain tensors)."""

    def matrices(self) -> list[torch.Tensor]:
        """The plain tensors."""
        return [t for t in (self.router, self.gate_up, self.down, self.shared_gate_up, self.shared_down,
                            self.shared_gate) if t is not None]


@dataclass(frozen=True)
class PackedExperts:
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    matmul: Any  # the matmul.py implementation that packed them and multiplies by them
    batched: bool = False
    """Whether one `torch.bmm` over the plain weights gives these products to the bit (`bmm_matches_packed`):
    then a decode step on more than one thread may take it (`_padded_products`)."""


def packed_moe(w: MoeWeights, matmul: Any) -> MoeWeights:
    """The forward's copy of a layer: each expert's two matrices and the shared expert packed
    where the engine's matmul packs matrices of their shape and dtype (matmul.py's rule over the
    shape, the dtype and the CPU, never a timing); new tensors, rebuilt after every weight update.
    Elsewhere (a GPU, a CPU where the rule leaves them plain) the experts keep the grouped matmul
    over the plain tensors, which beats one plain `F.linear` per expert. Measured (docs/moe.md
    "Speed"): a decode step gives each expert a few rows, and `_grouped_mm` re-lays every expert's
    weight out on every call, which the packed copies do once. The router stays plain: its
    logits pick the top-k, and the trainer computes them with `F.linear`."""
    if not matmul.packs:
        return w
    gate_up = [matmul.pack(t) for t in w.gate_up]
    if not all(t.is_mkldnn for t in gate_up):
        return w
    pack = matmul.pack
    batched = bmm_matches_packed(matmul, w.gate_up.dtype, tuple(w.gate_up.shape[1:]), tuple(w.down.shape[1:]))
    return replace(w, shared_gate_up=None if w.shared_gate_up is None else pack(w.shared_gate_up),
                   shared_down=None if w.shared_down is None else pack(w.shared_down),
                   shared_gate=None if w.shared_gate is None else pack(w.shared_gate),
                   packed=PackedExperts(gate_up, [pack(t) for t in w.down], matmul, batched))


def bmm_matches_packed(matmul: Any, dtype: torch.dtype, gate_up: tuple[int, int], down: tuple[int, int]) -> bool:
    """Whether `torch.bmm` over experts' plain [out, in] weights of these shapes, on two threads,
    gives the packed products of `matmul` on one thread bit for bit (a probe with random numbers,
    once per shape; `_BMM_PROBES`). Where it does (bf16 on an avx512_bf16 CPU without AMX, where
    both are oneDNN's bf16 kernels summing in the same order), a decode step may switch between
    them by its thread count and still compute the same numbers (threads.py promises that).
    Measured on the bench machine: bf16 matches at the bench's shapes, fp32 only at small ones
    (64-wide; at 384 BLAS's bmm and oneDNN's packed product sum in other orders), so the answer
    is probed per shape, never assumed per dtype."""
    key = (type(matmul), getattr(matmul, "batch_hint", None), dtype, gate_up, down)
    if key not in _BMM_PROBES:
        _BMM_PROBES[key] = _probe_bmm(matmul, dtype, gate_up, down)
    return _BMM_PROBES[key]


_BMM_PROBES: dict[tuple, bool] = {}


def _probe_bmm(matmul: Any, dtype: torch.dtype, gate_up: tuple[int, int], down: tuple[int, int]) -> bool:
    gen = torch.Generator().manual_seed(0)
    for out_features, in_features in (gate_up, down):
        weights = torch.randn(2, out_features, in_features, generator=gen).to(dtype)
        rows = torch.randn(2, 7, in_features, generator=gen).to(dtype)
        with torch_threads(1):
            packed = [matmul.linear(rows[e, :n], matmul.pack(weights[e]), None) for e, n in enumerate((7, 3))]
        with torch_threads(max(2, torch.get_num_threads())):
            batched = torch.bmm(rows, weights.transpose(1, 2))
        if not all(torch.equal(batched[e, :n], p) for e, (n, p) in enumerate(zip((7, 3), packed))):
            return False
    return True


def new_moe_weights(spec: MoeSpec, hidden: int, new: Callable[..., torch.Tensor]) -> MoeWeights:
    E, I, S = spec.num_experts, spec.intermediate_size, spec.shared_intermediate_size
    return MoeWeights(
        router=new(E, hidden), gate_up=new(E, 2 * I, hidden), down=new(E, hidden, I),
        shared_gate_up=new(2 * S, hidden) if S else None, shared_down=new(hidden, S) if S else None,
        shared_gate=new(1, hidden) if S else None,
    )


def moe_targets(prefix: str, w: MoeWeights, spec: MoeSpec) -> dict[str, torch.Tensor]:
    """HF name -> view, for both the fused in-memory names (what a trainer syncs) and the
    per-expert names of a saved checkpoint. `prefix`: "model.layers.{i}.mlp."."""
    I, S = spec.intermediate_size, spec.shared_intermediate_size
    out = {prefix + "gate.weight": w.router,
           prefix + "experts.gate_up_proj": w.gate_up,
           prefix + "experts.down_proj": w.down}
    for e in range(spec.num_experts):
        out[f"{prefix}experts.{e}.gate_proj.weight"] = w.gate_up[e, :I]
        out[f"{prefix}experts.{e}.up_proj.weight"] = w.gate_up[e, I:]
        out[f"{prefix}experts.{e}.down_proj.weight"] = w.down[e]
    if S:
        out[prefix + "shared_expert.gate_proj.weight"] = w.shared_gate_up[:S]
        out[prefix + "shared_expert.up_proj.weight"] = w.shared_gate_up[S:]
        out[prefix + "shared_expert.down_proj.weight"] = w.shared_down
        out[prefix + "shared_expert_gate.weight"] = w.shared_gate
    return out


def required_moe_names(prefix: str, spec: MoeSpec) -> set[str]:
    """The names a checkpoint must cover (either spelling of the experts, see `covers_experts`)."""
    names = {prefix + "gate.weight", prefix + "experts.gate_up_proj", prefix + "experts.down_proj"}
    if spec.shared_intermediate_size:
        names |= {prefix + f"shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")}
        names.add(prefix + "shared_expert_gate.weight")
    return names


def fold_expert_names(names: set[str], prefix: str, spec: MoeSpec) -> set[str]:
    """`names` with a complete set of per-expert names counted as the fused names they fill."""
    per_expert = {f"{prefix}experts.{e}.{p}_proj.weight" for e in range(spec.num_experts) for p in ("gate", "up")}
    downs = {f"{prefix}experts.{e}.down_proj.weight" for e in range(spec.num_experts)}
    out = set(names)
    if per_expert <= names:
        out.add(prefix + "experts.gate_up_proj")
    if downs <= names:
        out.add(prefix + "experts.down_proj")
    return out


def routed_experts(rows: list[torch.Tensor], length: int, spec: MoeSpec) -> torch.Tensor:
    """A sample's routes for `TokenOutput.extra["routed_experts"]`: [length, moe layers, k] in
    the routes column's compact dtype (polyrl/batch/routes.py); `rows` holds the expert ids of
    each generated token that was fed back, the last one (never fed) is marked not routed."""
    layers = sum(spec.sparse_layers)
    stacked = torch.stack(rows) if rows else None
    return encode(stacked, length, routes_dtype(spec.num_experts), layers, spec.top_k)


def route(x: torch.Tensor, router: torch.Tensor, spec: MoeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [N, H] -> (weights [N, k] in x's dtype, expert ids [N, k]), as transformers routes."""
    probs = torch.softmax(F.linear(x, router), dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(x.dtype), ids


def _grouped(x: torch.Tensor, w_t: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows of x sorted by expert (segment e ends at ends[e]) times w_t[e] [in, out]."""
    if x.is_cpu and hasattr(torch, "_grouped_mm"):  # CUDA's kernel takes bf16 on sm90+ only: not relied on
        return torch._grouped_mm(x, w_t, offs=ends.to(torch.int32))
    out = x.new_empty(x.shape[0], w_t.shape[-1])
    start = 0
    for e, end in enumerate(ends.tolist()):  # once per expert, never per token
        if end > start:
            torch.mm(x[start:end], w_t[e], out=out[start:end])
        start = end
    return out


ONE_THREAD_PAIRS = 256
"""Up to this many (token, slot) pairs (a decode step's: 64 sequences x top-2 = 128), the
experts' bookkeeping (routing, sort, gather, activation, weighted scatter) runs on one thread and
only the packed products on all of them. Those ops touch tensors of a few hundred KB, and on more
than one thread each opened its own parallel region: measured at 128 pairs x 384 on the bench
machine (docs/moe.md "Speed"), a mul 5.7 -> 17 us, a cat of 16 pieces 8 -> 17 us, the gather
30 -> 70 us at 2 threads against 1. The thread count does not change any of their results (each
element or row is computed alone); a rule over the shape, never a timing."""


def _packed_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w: MoeWeights,
                    act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`experts_forward` with packed experts: one product per expert that received tokens, never
    per token, each on all the threads (or, `_padded_products`, one bmm over all experts); the
    rest on one thread at decode sizes (`ONE_THREAD_PAIRS`)."""
    k = ids.shape[1]
    threads = torch.get_num_threads()
    small = 1 if ids.numel() <= ONE_THREAD_PAIRS else None
    with torch_threads(small):
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(w.packed.gate_up))
        sizes = counts.tolist()
        token = order // k
        rows = x.index_select(0, token)
    if w.packed.batched and threads > 1 and len(sizes) * max(sizes) <= PADDED_ROWS_LIMIT * flat.numel():
        y = _padded_products(rows, flat.index_select(0, order), counts, max(sizes), w, act, small)
    else:
        y = _per_expert_products(rows, sizes, w, act, small)
    with torch_threads(small):
        y = y * weights.reshape(-1).index_select(0, order).unsqueeze(1)
        return torch.zeros_like(x).index_add_(0, token, y)


def _per_expert_products(rows: torch.Tensor, sizes: list[int], w: MoeWeights,
                         act: Callable[[torch.Tensor], torch.Tensor], small: int | None) -> torch.Tensor:
    """Rows sorted by expert (sizes[e] each) through their experts: two packed products per
    expert that received tokens."""
    mm = w.packed.matmul
    live = [e for e, n in enumerate(sizes) if n]
    live_sizes = [sizes[e] for e in live]
    hidden = [mm.linear(r, w.packed.gate_up[e], None) for e, r in zip(live, rows.split(live_sizes))]
    with torch_threads(small):
        gate, up = torch.cat(hidden).chunk(2, dim=-1)
        pieces = (act(gate) * up).split(live_sizes)
    out = [mm.linear(r, w.packed.down[e], None) for e, r in zip(live, pieces)]
    with torch_threads(small):
        return torch.cat(out)


PADDED_ROWS_LIMIT = 3
"""`_padded_products` is taken while the padded rows (experts x the fullest expert's rows) are at
most this many times the real ones: a decode step's experts are bound by reading their weights,
and one bf16 bmm over 16 experts of [512, 384] took 543 / 603 / 686 / 753 us a layer at 8 / 13 /
16 / 24 rows each (one thread, bench machine), so padding up to ~3x costs little; beyond it few
experts hold tokens and the packed products read only theirs."""


def _padded_products(rows: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor, most: int, w: MoeWeights,
                     act: Callable[[torch.Tensor], torch.Tensor], small: int | None) -> torch.Tensor:
    """The same as `_per_expert_products`, bit for bit where `PackedExperts.batched`: every
    expert's rows padded with zeros to the fullest expert's count `most`, each projection one
    `torch.bmm` over all the experts' plain weights. Taken on more than one thread where the
    padding at most triples the rows (`PADDED_ROWS_LIMIT`: every expert, or nearly, received
    tokens, so the bmm reads about the weights the packed products read): 2 products a layer where the packed path
    runs one per expert, each a parallel region of its own (docs/moe.md "Speed": bf16 on two
    threads, the experts of six layers 5.3 -> 4.2 ms)."""
    E, H = counts.shape[0], rows.shape[1]
    with torch_threads(small):
        slot = torch.arange(rows.shape[0]) - (torch.cumsum(counts, 0) - counts).index_select(0, experts)
        where = experts * most + slot
        padded = rows.new_zeros(E * most, H).index_copy_(0, where, rows).view(E, most, H)
    hidden = torch.bmm(padded, w.gate_up.transpose(1, 2))
    with torch_threads(small):
        gate, up = hidden.chunk(2, dim=-1)
        activated = act(gate) * up
    out = torch.bmm(activated, w.down.transpose(1, 2))
    with torch_threads(small):
        return out.view(E * most, H).index_select(0, where)


def experts_forward(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w: MoeWeights,
                    act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum_j weights[:, j] * expert_{ids[:, j]}(x), for x [N, H]: the (token, slot) pairs sorted
    by expert, each projection one grouped matmul over them (or, packed, one product per expert
    that received tokens, `_packed_experts`)."""
    if w.packed is not None:
        return _packed_experts(x, weights, ids, w, act)
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    ends = torch.cumsum(torch.bincount(flat, minlength=w.gate_up.shape[0]), 0)
    token = order // k
    gate, up = _grouped(x.index_select(0, token), w.gate_up.transpose(1, 2), ends).chunk(2, dim=-1)
    y = _grouped(act(gate) * up, w.down.transpose(1, 2), ends)
    y = y * weights.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, token, y)


def moe_block(x: torch.Tensor, w: MoeWeights, spec: MoeSpec, act: Callable[[torch.Tensor], torch.Tensor],
              routes: list | None = None) -> torch.Tensor:
    """The mixture-of-experts MLP of x [..., H] (post-norm hidden states) -> [..., H].
    `routes`: where given, the top-k expert ids [..., k] are appended to it."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    linear = F.linear if w.packed is None else w.packed.matmul.linear
    small = w.packed is not None and flat.shape[0] * spec.top_k <= ONE_THREAD_PAIRS
    with torch_threads(1 if small else None):  # a decode step's routing: see ONE_THREAD_PAIRS
        weights, ids = route(flat, w.router, spec)
    if routes is not None:
        routes.append(ids.view(*shape[:-1], spec.top_k))
    out = experts_forward(flat, weights, ids, w, act)
    if w.shared_gate_up is not None:
        gate, up = linear(flat, w.shared_gate_up, None).chunk(2, dim=-1)
        shared = linear(act(gate) * up, w.shared_down, None)
        out = out + torch.sigmoid(linear(flat, w.shared_gate, None)) * shared
    return out.view(shape)
