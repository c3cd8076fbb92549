"""The memory model: per-rank bytes of policy, reference, optimizer, activations and engine, and
weight-sync times.

Pure arithmetic on config.json shapes. It backs docs/scaling.md (whose tables
`polyrl bench memory_model` prints, benchmarks/memory_model.py) and the memory pre-flight's floor
(polyrl/training/memory_floor.py), and is checked against `polyrl bench memory` (`predict_bench`,
compared in docs/training.md "Memory per rank").

FSDP2 over N ranks, P parameters, master dtype of `m` bytes (actor.param_dtype: 4 for float32,
the default; 2 for bfloat16), compute dtype of `c` bytes:

    parameters      m P / N        gradients  m P / N  (freed after the optimizer step)
    AdamW           2 m P / N      reference  m P / N  (frozen FSDP2 engine, when KL is used)
    AdamW step      m P / N        (foreach AdamW's sqrt of the second moments, a temporary that
                                    lives while the step runs, after the activations are freed)
    gathered units  2 c x (largest decoder layer)      (FSDP2 gathers a layer, prefetches the next)
    activations     T x L x (7 h + 2 kv + 4 I) x c     (T = actor.micro_batch_tokens per rank;
                    with gradient checkpointing: T x L x h x c + one layer's worth)
    LM head         8 T V bytes below 2^28 logits (float32 logits + log-softmax); above, fused
                    in chunks (polyrl/training/logprobs.py FUSED_MIN_ELEMENTS): ~0

Loading (polyrl/workers/policy.py): fsdp2 builds the model on the meta device and each rank reads
only its rows (polyrl/training/sharded_load.py): m P / N, LoRA's base and the critic too, and in
colocated placement with a GPU engine (it fills from the first streamed sync). With the built-in
engine in colocated placement, and with ddp, every rank builds the whole model and moves it to its device, then FSDP2 copies
the rank's shard out of it: m P (1 + 1/N) (on a CPU host and device are one and the same:
measured to within 0.2%, docs/training.md "Memory per rank"), never below m P whatever N.

Weight sync streamed from the shards (polyrl/weights/base.py WeightStream): the sender holds its
shard plus one or two buckets (weights.bucket_mb); a tensor bigger than a bucket is gathered and
sent in row slices of at most a bucket (docs/weight_sync.md, "Row slices").

Rollout engine (vLLM / SGLang, tensor parallel t): weights 2 P / t (bfloat16), KV cache per token
2 x L x kv_heads x head_dim x 2 bytes / t, plus a fixed runtime reserve (CUDA graphs, NCCL,
allocator) of `ENGINE_RESERVE_GB`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from polyrl.config.vocabulary import COLOCATED, PLACEMENTS

GB = 1e9
SYNC_BUCKET_BYTES = 64 * 2**20
"""weights.bucket_mb's default: what a streamed sync or a sharded load's first sync holds."""
GiB = 2**30
MiB = 2**20

# config.json of each (Hugging Face Qwen/Qwen2.5-*: hidden_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, intermediate_size, vocab_size, tie_word_embeddings)
QWEN25 = {
    "Qwen2.5-7B": dict(vocab_size=152064, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, tie_word_embeddings=False),
    "Qwen2.5-32B": dict(vocab_size=152064, hidden_size=5120, num_hidden_layers=64, num_attention_heads=40,
                        num_key_value_heads=8, intermediate_size=27648, tie_word_embeddings=False),
    "Qwen2.5-72B": dict(vocab_size=152064, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, intermediate_size=29568, tie_word_embeddings=False),
}

H100_GB = 80.0
USABLE = 0.9
"""Share of a GPU's memory a layout may plan on (the CUDA context, NCCL buffers and allocator
fragmentation take the rest; vLLM's own default gpu_memory_utilization is 0.9)."""
ENGINE_RESERVE_GB = 4.0
"""An engine's fixed reserve besides weights and KV: CUDA graphs, sampler, its own buffers."""
KV_TOKENS = 128 * 4096
"""KV the rollout needs per engine replica: 128 sequences of 4k tokens in flight."""
MICRO_BATCH_TOKENS = 8192
"""actor.micro_batch_tokens (its default)."""

BANDWIDTH_GBPS = {
    "measured: broadcast, shared memory (CPU, 1 host)": 12.3,
    "measured: broadcast over gloo/TCP (CPU)": 1.5,
    "InfiniBand NDR, 1 x 400 Gb/s NIC": 50.0,
    "NVLink 4 (H100 SXM), one direction": 450.0,
}
"""Bytes per second a weight publish moves, GB/s. The two measured rows are docs/benchmarks.md
"Weight sync" (idle machine, median); the others are the links' nominal rates (NCCL reaches
~80-90% of them)."""


def moe_fields(c: dict) -> dict:
    """Shape's mixture-of-experts fields from a config.json (Qwen3-MoE, Qwen2-MoE spelling:
    num_experts, num_experts_per_tok, moe_intermediate_size, decoder_sparse_step, mlp_only_layers,
    shared_expert_intermediate_size); {} for a dense model."""
    experts = c.get("num_experts") or 0
    if not isinstance(experts, int) or experts < 2 or not c.get("moe_intermediate_size"):
        return {}
    step, dense = c.get("decoder_sparse_step") or 1, set(c.get("mlp_only_layers") or ())
    # transformers' Qwen3MoeDecoderLayer: experts where (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers
    layers = sum(1 for i in range(c["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
    return dict(experts=experts, experts_per_token=c.get("num_experts_per_tok") or 1,
                expert_intermediate=c["moe_intermediate_size"], expert_layers=layers,
                shared_intermediate=c.get("shared_expert_intermediate_size") or 0)


@dataclass(frozen=True)
class Shape:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tied: bool
    attention_bias: str = "qkv"
    """Which attention projections have biases: "qkv" (Qwen2), "qkvo" (Llama with
    attention_bias), "" (none)."""
    mlp_bias: bool = False
    counted: int | None = None
    """The parameter count when it was counted on the meta device (`count_on_meta`), not derived."""
    counted_layer: int | None = None
    """Parameters of one decoder layer when counted on the meta device."""
    explicit_head_dim: int = 0
    """config.json's head_dim where heads x head_dim is not the hidden size (Qwen3: 32 x 128 at
    hidden 2048); 0: hidden / heads."""
    qk_norm: bool = False
    """Qwen3's RMSNorm on each head's query and key (2 x head_dim weights per layer)."""
    experts: int = 0
    """Mixture-of-experts (docs/moe.md): routed experts per expert layer (config.json num_experts);
    0 for a dense model."""
    experts_per_token: int = 0
    """num_experts_per_tok: the top-k each token is routed to."""
    expert_intermediate: int = 0
    """moe_intermediate_size: one expert's MLP width."""
    expert_layers: int = 0
    """Decoder layers whose MLP is the expert block (the rest, mlp_only_layers and those off
    decoder_sparse_step, have the dense MLP of `intermediate`)."""
    shared_intermediate: int = 0
    """Qwen2-MoE's shared expert width (shared_expert_intermediate_size), gated per token; 0: none."""

    @classmethod
    def from_config(cls, c: dict) -> "Shape":
        """Qwen2-shaped (the default, as the QWEN25 dicts), Llama-shaped (`model_type: llama`:
        its attention_bias and mlp_bias), or a Qwen3 / Qwen3-MoE / Qwen2-MoE (no attention biases
        on Qwen3, q/k norms; the expert keys of `moe_fields`)."""
        model_type = c.get("model_type")
        llama, qwen3 = model_type == "llama", model_type in ("qwen3", "qwen3_moe")
        bias = ("qkvo" if c.get("attention_bias") else "") if llama or qwen3 else "qkv"
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or 0
        return cls(c["vocab_size"], c["hidden_size"], c["num_hidden_layers"], heads,
                   c.get("num_key_value_heads", heads), c["intermediate_size"],
                   bool(c.get("tie_word_embeddings", False)), attention_bias=bias,
                   mlp_bias=llama and bool(c.get("mlp_bias")),
                   explicit_head_dim=head_dim if head_dim * heads != c["hidden_size"] else 0,
                   qk_norm=qwen3, **moe_fields(c))

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden // self.heads

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        if self.counted_layer is not None:
            return self.counted_layer
        return max(self._dense_layer, self._expert_layer) if self.experts else self._dense_layer

    @property
    def _attention(self) -> int:
        h, q, kv = self.hidden, self.q_width, self.kv_width
        bias = {"qkv": q + 2 * kv, "qkvo": q + h + 2 * kv, "": 0}[self.attention_bias]
        return 2 * h * q + 2 * h * kv + bias + (2 * self.head_dim if self.qk_norm else 0) + 2 * h

    @property
    def _dense_layer(self) -> int:
        h, i = self.hidden, self.intermediate
        return self._attention + 3 * h * i + (2 * i + h if self.mlp_bias else 0)

    @property
    def _expert_layer(self) -> int:
        """Attention, the router (E x h), every routed expert and the gated shared expert."""
        h = self.hidden
        shared = 3 * h * self.shared_intermediate + h if self.shared_intermediate else 0
        return self._attention + self.experts * h + self.experts * self.expert_params_one + shared

    @property
    def expert_params_one(self) -> int:
        """One routed expert of one layer: gate, up and down projections."""
        return 3 * self.hidden * self.expert_intermediate

    @property
    def routed_expert_params(self) -> int:
        """Every routed expert of every expert layer: what expert parallelism splits."""
        return self.expert_layers * self.experts * self.expert_params_one

    @property
    def active_params(self) -> int:
        """Parameters one token's forward uses: all but the experts it is not routed to (top-k of E)."""
        return self.params - self.expert_layers * (self.experts - self.experts_per_token) * self.expert_params_one

    def experts_per_rank(self, expert_parallel: int = 1) -> int:
        """Routed experts (per expert layer) the busiest rank holds with the experts split over
        `expert_parallel` ranks (actor.expert_parallel_size; a size that does not divide them is
        the config's to refuse)."""
        return -(-self.experts // expert_parallel)

    def gathered_layer_params(self, expert_parallel: int = 1) -> int:
        """Parameters FSDP2 gathers for the largest decoder layer: under expert parallelism a rank
        gathers only its own experts (the others live on the other expert ranks)."""
        if not self.experts or expert_parallel == 1:
            return self.layer_params
        skipped = (self.experts - self.experts_per_rank(expert_parallel)) * self.expert_params_one
        return max(self.layer_params - skipped, self._dense_layer)

    @property
    def params(self) -> int:
        if self.counted is not None:
            return self.counted
        dense_layers = self.layers - self.expert_layers if self.experts else self.layers
        layers = dense_layers * self._dense_layer + (self.expert_layers * self._expert_layer if self.experts else 0)
        return self.vocab * self.hidden * (1 if self.tied else 2) + layers + self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer, bfloat16."""
        return 2 * self.layers * self.kv_width * 2


def gathered_units_bytes(layer_params: int, compute: int = 2, tp: int = 1) -> float:
    """FSDP2's two gathered units (the layer computing and the next one prefetched) of
    `layer_params` parameters each, in the compute dtype: a gather over the sharding ranks
    yields a rank's tensor-parallel slice (1/tp) of each layer, never the whole layer."""
    return 2 * compute * layer_params / tp


def _device_transient(s: Shape, checkpointing: bool, compute: int = 2, tokens: int = MICRO_BATCH_TOKENS,
                      tp: int = 1) -> float:
    """What the backward adds to the state: activations, the LM head's logits, two gathered units.
    Tensor parallelism (tp) slices the per-head and MLP activations (q, attention, its output,
    k, v, the MLP's four I-wide tensors), the head's logits and each gathered layer; the
    hidden-wide ones (residual, norms, projections' outputs: 4 h) stay whole on every rank."""
    per_token_layer = 4 * s.hidden + (3 * s.hidden + 2 * s.kv_width + 4 * s.intermediate) / tp
    layers = (s.layers * s.hidden + per_token_layer) if checkpointing else s.layers * per_token_layer
    # the vocabulary-parallel head (tp > 1, training/vocab_parallel.py) always runs in chunks
    head = 8 * tokens * s.vocab if tp == 1 and tokens * s.vocab < 2**28 else 0
    return tokens * layers * compute + head + gathered_units_bytes(s.layer_params, compute, tp)


def training_bytes(s: Shape, ranks: int, *, master: int = 4, compute: int = 2, reference: bool = False,
                   tokens: int = MICRO_BATCH_TOKENS, checkpointing: bool = False, tp: int = 1) -> dict[str, float]:
    """Per-rank bytes of one FSDP2 policy rank during its update (the peak: gradients alive).
    `ranks`: all the policy's ranks; under tensor parallelism (`tp` of them per slice group) each
    holds 1/tp of every parameter sharded over ranks / tp, i.e. 1/ranks of the model as before
    (the norms, whole on every tp rank, are a negligible share)."""
    P, N = s.params, ranks
    # the backward's peak (activations) and the optimizer step's (its temporary) do not overlap
    transient = max(_device_transient(s, checkpointing, compute, tokens, tp), master * P / N)
    return {"parameters": master * P / N, "gradients": master * P / N, "optimizer": 2 * master * P / N,
            "reference": master * P / N if reference else 0.0, "transient": transient}


def engine_bytes(s: Shape, tp: int, kv_tokens: int = KV_TOKENS) -> dict[str, float]:
    """Per-GPU bytes of one rollout engine replica of tensor parallel `tp` (bfloat16)."""
    return {"weights": 2 * s.params / tp, "kv_cache": kv_tokens * s.kv_bytes_per_token / tp,
            "reserve": ENGINE_RESERVE_GB * GB}


def load_bytes_today(s: Shape, ranks: int, master: int = 4) -> float:
    """A whole load (from_pretrained on every rank, then FSDP2 copies its shard out of it): what
    colocated placement, LoRA and ddp still do (the colocated engine starts from the whole model)."""
    return master * s.params * (1 + 1 / ranks)


def load_bytes_sharded(s: Shape, ranks: int, master: int = 4) -> float:
    """fsdp2 without a colocated engine (polyrl/training/sharded_load.py): each rank builds the
    model on the meta device and reads only its own rows, so the peak is its shard."""
    return master * s.params / ranks


def smallest_tp(s: Shape, budget: float, kv_tokens: int = KV_TOKENS) -> int | None:
    """The smallest tensor-parallel size (1, 2, 4, 8) whose engine fits `budget` bytes per GPU."""
    for tp in (1, 2, 4, 8):
        if sum(engine_bytes(s, tp, kv_tokens).values()) <= budget:
            return tp
    return None


def layout(s: Shape, gpus: int, placement: str, *, reference: bool = True, checkpointing: bool = True,
           offload: bool = False, master: int = 4) -> dict:
    """Per-GPU peak of a layout (`placement`, polyrl/config/vocabulary.py). colocated: every GPU
    trains (FSDP2 over all of them) and hosts an engine shard; the engine sleeps (weights and KV
    released) during the update, the training state stays resident during generation unless
    `offload`. disaggregated: half the GPUs train, half generate."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement {placement!r} is not one of {', '.join(PLACEMENTS)}")
    budget = USABLE * H100_GB * GB
    trainers = gpus if placement == COLOCATED else gpus // 2
    train = training_bytes(s, trainers, master=master, reference=reference, checkpointing=checkpointing)
    if offload:  # actor.offload: shards and AdamW state in host memory (AdamW steps there too)
        train.update(parameters=0.0, gradients=0.0, optimizer=0.0, reference=0.0,
                     transient=_device_transient(s, checkpointing))
    update_peak = sum(train.values())
    resident = train["parameters"] + train["optimizer"] + train["reference"]
    if placement == COLOCATED:
        tp = smallest_tp(s, budget - resident)
        engine = engine_bytes(s, tp or 8)
        generate_peak = resident + sum(engine.values())
        peak = max(update_peak, generate_peak)
    else:
        tp = smallest_tp(s, budget)
        engine = engine_bytes(s, tp or 8)
        generate_peak = sum(engine.values())
        peak = max(update_peak, generate_peak)
    # fsdp2 loads sharded in both layouts (polyrl/workers/policy.py): disaggregated, and colocated with
    # a GPU engine, which starts on dummy weights and fills from the first streamed sync (its own
    # weight shard beside the policy's), the sync holding one bucket (weights.bucket_mb)
    sharded = load_bytes_sharded(s, trainers) + SYNC_BUCKET_BYTES
    load_today = sharded + engine["weights"] if placement == COLOCATED else sharded
    return {"model": None, "gpus": gpus, "placement": placement, "trainers": trainers, "tp": tp,
            "update_gb": update_peak / GB, "generate_gb": generate_peak / GB, "peak_gb": peak / GB,
            "fits": tp is not None and peak <= budget, "load_today_gb": load_today / GB,
            "load_today_fits": load_today <= budget, "load_sharded_gb": sharded / GB}


# config.json of each (Hugging Face Qwen/Qwen3-*-A*B: the keys above plus head_dim and the expert
# keys; no mlp_only_layers, decoder_sparse_step 1: every layer is an expert layer)
QWEN3_MOE = {
    "Qwen3-30B-A3B": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False),
    "Qwen3-235B-A22B": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=4096, num_hidden_layers=94,
                            num_attention_heads=64, num_key_value_heads=4, head_dim=128, intermediate_size=12288,
                            moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8,
                            decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False),
}

MOE_GPUS = {"Qwen3-30B-A3B": (8, 16, 64), "Qwen3-235B-A22B": (64, 128, 256)}
"""The GPU counts docs/moe.md's table shows for each."""


def moe_training_shape(s: Shape, expert_parallel: int = 1) -> Shape:
    """`s` as the training terms see it under expert parallelism: the same parameters (each rank
    holds P / N whatever the split: E / ep experts, each sharded over N / ep ranks), a gathered
    layer of only the rank's own experts, and the activation width of a token's k experts (plus
    a shared expert) in place of a dense MLP's."""
    if not s.experts:
        return s
    width = s.experts_per_token * s.expert_intermediate + s.shared_intermediate
    return replace(s, counted=s.params, counted_layer=s.gathered_layer_params(expert_parallel), intermediate=width)


def moe_layout(s: Shape, gpus: int, placement: str, expert_parallel: int = 1, master: int = 4) -> dict:
    """`layout` for a mixture-of-experts model: training terms from `moe_training_shape`, and an
    engine replica of as many GPUs as its weights need (tensor / expert parallel: vLLM and SGLang
    span nodes for an MoE), where `layout` stops at one node of 8."""
    budget = USABLE * H100_GB * GB
    trainers = gpus if placement == COLOCATED else gpus // 2
    t = moe_training_shape(s, expert_parallel)
    row = layout(t, gpus, placement, master=master)
    train = training_bytes(t, trainers, master=master, reference=True, checkpointing=True)
    resident = train["parameters"] + train["optimizer"] + train["reference"] if placement == COLOCATED else 0.0
    engine_gpus = next((e for e in (1, 2, 4, 8, 16, 32, 64)
                        if e <= gpus and resident + sum(engine_bytes(s, e).values()) <= budget), None)
    if engine_gpus is not None:
        row["generate_gb"] = (resident + sum(engine_bytes(s, engine_gpus).values())) / GB
    row.update(fits=engine_gpus is not None and row["update_gb"] * GB <= budget, engine_gpus=engine_gpus,
               ep=expert_parallel, experts_per_rank=s.experts_per_rank(expert_parallel),
               gathered_layer_gb=2 * t.layer_params / GB)
    return row


def moe_scaling_rows() -> list[dict]:
    """docs/moe.md's table: Qwen3-30B-A3B and Qwen3-235B-A22B per H100 at a few GPU counts and
    expert-parallel sizes (bf16 compute, fp32 master, reference, gradient checkpointing)."""
    rows = []
    for name, config in QWEN3_MOE.items():
        s = Shape.from_config(config)
        for gpus in MOE_GPUS[name]:
            for ep in (1, 8):
                for placement in PLACEMENTS:
                    if (gpus if placement == COLOCATED else gpus // 2) % ep:
                        continue
                    row = moe_layout(s, gpus, placement, ep)
                    row.update(model=name, params_b=s.params / 1e9, active_b=s.active_params / 1e9,
                               fits_bf16_master=moe_layout(s, gpus, placement, ep, master=2)["fits"])
                    rows.append(row)
    return rows


def sync_seconds(s: Shape) -> dict[str, float]:
    """One publish of the bfloat16 weights (2 P bytes) at each bandwidth."""
    return {name: 2 * s.params / (gbps * GB) for name, gbps in BANDWIDTH_GBPS.items()}


def predict_bench(shape: dict, ranks: int, tokens_per_rank: int, bucket_mb: float) -> dict[str, float]:
    """What the model predicts for `polyrl bench memory` (fp32 master and compute, no reference,
    no checkpointing), MiB above the baseline: load = this rank's shard (sharded loading), step =
    the training peak, sync = what stays after the step (parameters + AdamW) +
    one bucket's scratch or, when larger, a gathered largest tensor with its gather buffer."""
    s = moe_training_shape(Shape.from_config({"tie_word_embeddings": True, **shape}))
    train = training_bytes(s, ranks, master=4, compute=4, tokens=tokens_per_rank)
    # a tensor bigger than a bucket travels in row slices (polyrl/weights/bucketing.py row_pieces):
    # one rank holds a bucket; several hold the slice being gathered and the one before it
    # an MoE's largest tensor is a layer's fused experts (transformers' gate_up_proj [E, 2 I, h])
    experts = s.experts * 2 * s.expert_intermediate * s.hidden
    bucket, largest = bucket_mb * MiB, 4 * max(s.vocab * s.hidden, s.hidden * s.intermediate, experts)
    piece = largest / math.ceil(largest / bucket) if largest > bucket else largest
    extra = bucket if ranks == 1 else max(bucket, 2 * piece)
    return {"load_mib": load_bytes_sharded(s, ranks) / MiB, "step_mib": sum(train.values()) / MiB,
            "sync_mib": (train["parameters"] + train["optimizer"] + extra) / MiB}


def scaling_rows() -> list[dict]:
    rows = []
    for name, config in QWEN25.items():
        s = Shape.from_config(config)
        for gpus in (8, 16, 64):
            for placement in PLACEMENTS:
                row = layout(s, gpus, placement)
                row["model"] = name
                row["params_b"] = s.params / 1e9
                row["fits_bf16_master"] = layout(s, gpus, placement, master=2)["fits"]
                row["fits_offload"] = layout(s, gpus, placement, offload=True)["fits"]
                rows.append(row)
    return rows


def tensor_parallel_rows(model: str = "Qwen2.5-72B", gpus: int = 16, tokens: int = 32768,
                         checkpointing: bool = True) -> list[dict]:
    """Per-GPU update peak of `model` trained on `gpus` ranks with one `tokens`-token sample per
    micro-batch (a 32K context needs micro-batches of 32K tokens), for actor.tensor_parallel_size
    1, 2, 4, 8: GB of state (fp32 and bf16 master, a KL reference) and of the backward's transient
    (docs/scaling.md, "Tensor parallelism in training")."""
    s = Shape.from_config(QWEN25[model])
    budget = USABLE * H100_GB * GB
    rows = []
    for tp in (1, 2, 4, 8):
        row = {"model": model, "gpus": gpus, "tokens": tokens, "tp": tp,
               "transient_gb": _device_transient(s, checkpointing, 2, tokens, tp) / GB}
        for master, name in ((4, "fp32"), (2, "bf16")):
            t = training_bytes(s, gpus, master=master, reference=True, tokens=tokens,
                               checkpointing=checkpointing, tp=tp)
            row[f"peak_{name}_gb"] = sum(t.values()) / GB
            row[f"fits_{name}"] = sum(t.values()) <= budget
        row["peak_offload_gb"] = row["transient_gb"]  # actor.offload: only the backward's transient on the GPU
        row["fits_offload"] = row["transient_gb"] * GB <= budget
        rows.append(row)
    return rows
