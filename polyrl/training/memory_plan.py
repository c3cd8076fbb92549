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
hybrid with a GPU engine (it fills from the first streamed sync). With the built-in engine in
hybrid, and with ddp, every rank builds the whole model and moves it to its device, then FSDP2 copies
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
from dataclasses import dataclass

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

    @classmethod
    def from_config(cls, c: dict) -> "Shape":
        """Qwen2-shaped (the default, as the QWEN25 dicts) or Llama-shaped (`model_type: llama`:
        its attention_bias and mlp_bias)."""
        llama = c.get("model_type") == "llama"
        bias = ("qkvo" if c.get("attention_bias") else "") if llama else "qkv"
        return cls(c["vocab_size"], c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
                   c["num_key_value_heads"], c["intermediate_size"], bool(c.get("tie_word_embeddings", False)),
                   attention_bias=bias, mlp_bias=llama and bool(c.get("mlp_bias")))

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        if self.counted_layer is not None:
            return self.counted_layer
        h, kv, i = self.hidden, self.kv_width, self.intermediate
        bias = {"qkv": h + 2 * kv, "qkvo": 2 * h + 2 * kv, "": 0}[self.attention_bias]
        mlp_bias = 2 * i + h if self.mlp_bias else 0
        return 2 * h * h + 2 * h * kv + bias + 3 * h * i + mlp_bias + 2 * h

    @property
    def params(self) -> int:
        if self.counted is not None:
            return self.counted
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * self.layer_params + self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer, bfloat16."""
        return 2 * self.layers * self.kv_width * 2


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
    return tokens * layers * compute + head + 2 * compute * s.layer_params / tp


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
    hybrid placement, LoRA and ddp still do (the colocated engine starts from the whole model)."""
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


def layout(s: Shape, gpus: int, mode: str, *, reference: bool = True, checkpointing: bool = True,
           offload: bool = False, master: int = 4) -> dict:
    """Per-GPU peak of a layout. hybrid: every GPU trains (FSDP2 over all of them) and hosts an
    engine shard; the engine sleeps (weights and KV released) during the update, the training
    state stays resident during generation unless `offload`. standalone: half the GPUs train,
    half generate."""
    budget = USABLE * H100_GB * GB
    trainers = gpus if mode == "hybrid" else gpus // 2
    train = training_bytes(s, trainers, master=master, reference=reference, checkpointing=checkpointing)
    if offload:  # actor.offload: shards and AdamW state in host memory (AdamW steps there too)
        train.update(parameters=0.0, gradients=0.0, optimizer=0.0, reference=0.0,
                     transient=_device_transient(s, checkpointing))
    update_peak = sum(train.values())
    resident = train["parameters"] + train["optimizer"] + train["reference"]
    if mode == "hybrid":
        tp = smallest_tp(s, budget - resident)
        engine = engine_bytes(s, tp or 8)
        generate_peak = resident + sum(engine.values())
        peak = max(update_peak, generate_peak)
    else:
        tp = smallest_tp(s, budget)
        engine = engine_bytes(s, tp or 8)
        generate_peak = sum(engine.values())
        peak = max(update_peak, generate_peak)
    # fsdp2 loads sharded in both layouts (polyrl/workers/policy.py): standalone, and hybrid with
    # a GPU engine, which starts on dummy weights and fills from the first streamed sync (its own
    # weight shard beside the policy's), the sync holding one bucket (weights.bucket_mb)
    sharded = load_bytes_sharded(s, trainers) + SYNC_BUCKET_BYTES
    load_today = sharded + engine["weights"] if mode == "hybrid" else sharded
    return {"model": None, "gpus": gpus, "mode": mode, "trainers": trainers, "tp": tp,
            "update_gb": update_peak / GB, "generate_gb": generate_peak / GB, "peak_gb": peak / GB,
            "fits": tp is not None and peak <= budget, "load_today_gb": load_today / GB,
            "load_today_fits": load_today <= budget, "load_sharded_gb": sharded / GB}


def sync_seconds(s: Shape) -> dict[str, float]:
    """One publish of the bfloat16 weights (2 P bytes) at each bandwidth."""
    return {name: 2 * s.params / (gbps * GB) for name, gbps in BANDWIDTH_GBPS.items()}


def predict_bench(shape: dict, ranks: int, tokens_per_rank: int, bucket_mb: float) -> dict[str, float]:
    """What the model predicts for `polyrl bench memory` (fp32 master and compute, no reference,
    no checkpointing), MiB above the baseline: load = this rank's shard (sharded loading), step =
    the training peak, sync = what stays after the step (parameters + AdamW) +
    one bucket's scratch or, when larger, a gathered largest tensor with its gather buffer."""
    s = Shape.from_config({"tie_word_embeddings": True, **shape})
    train = training_bytes(s, ranks, master=4, compute=4, tokens=tokens_per_rank)
    # a tensor bigger than a bucket travels in row slices (polyrl/weights/bucketing.py row_pieces):
    # one rank holds a bucket; several hold the slice being gathered and the one before it
    bucket, largest = bucket_mb * MiB, 4 * max(s.vocab * s.hidden, s.hidden * s.intermediate)
    piece = largest / math.ceil(largest / bucket) if largest > bucket else largest
    extra = bucket if ranks == 1 else max(bucket, 2 * piece)
    return {"load_mib": load_bytes_sharded(s, ranks) / MiB, "step_mib": sum(train.values()) / MiB,
            "sync_mib": (train["parameters"] + train["optimizer"] + extra) / MiB}


def scaling_rows() -> list[dict]:
    rows = []
    for name, config in QWEN25.items():
        s = Shape.from_config(config)
        for gpus in (8, 16, 64):
            for mode in ("hybrid", "standalone"):
                row = layout(s, gpus, mode)
                row["model"] = name
                row["params_b"] = s.params / 1e9
                row["fits_bf16_master"] = layout(s, gpus, mode, master=2)["fits"]
                row["fits_offload"] = layout(s, gpus, mode, offload=True)["fits"]
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
