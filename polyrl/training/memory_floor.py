"""The least memory a policy rank needs with a run's settings, what a rank has, and which settings
would fit: the memory pre-flight (polyrl/trainer/preflight.py `check_memory`, also run by
`polyrl train --dry-run`; docs/training.md "A model too big for its ranks").

Only terms the code surely allocates are counted, with the memory model's formulas
(polyrl/training/memory_plan.py; the activations and the LM head are estimates that over-predict
small models, docs/scaling.md): a run refused by this floor cannot fit, and a run it lets through
may still need activation memory on top.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from polyrl.training.memory_plan import MiB, Shape, gathered_units_bytes

FORMULA_MODEL_TYPES = ("qwen2", "llama", "qwen3_moe", "qwen2_moe")
"""config.json model types whose parameters `Shape` counts by formula (no torch, no transformers:
the dry run stays light); other models are counted on the meta device. The mixture-of-experts
ones must be: their layers differ (mlp_only_layers, decoder_sparse_step), which the meta count's
extrapolation from one and two layers cannot see."""
HEAD_DIM_FORMULA_TYPES = ("qwen3_moe", "qwen2_moe")
"""Of those, the ones whose formula takes an explicit head_dim (heads x head_dim != hidden)."""
LORA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_MEMORY_SHARE = 0.95
"""The largest rollout.gpu_memory_utilization the pre-flight suggests (the CUDA context and the
allocator need the rest)."""
MAX_RANKS = 4096
"""The largest actor.world_size the pre-flight considers when it looks for one that fits."""

SIMULATED_DEVICE_MEMORY: dict[str, int] = {
    "NVIDIA H100 80GB HBM3": 81559 * MiB,  # what nvidia-smi and torch report
    "NVIDIA GB200": 186 * 10**9,
    "NVIDIA GB300": 288 * 10**9,
    "AMD Instinct MI300X": 192 * 10**9,
    "Ascend910B": 64 * 10**9,
}
"""Device memory of the machines `--platform` simulates (polyrl/platform/detect.py SIMULATED_PROBES,
by device name): the reported capacity for the H100, the vendors' nominal one for the others."""


def model_shape(config: Any, trust_remote_code: bool = False) -> Shape | None:
    """The shape and exact parameter count of the model a config.json describes (a dict or a
    transformers config): by formula for Qwen2 / Llama layouts, else counted on the meta device
    (`count_on_meta`); None when neither can tell (not a causal LM transformers knows). A size
    that is present but not a positive integer (0 heads, -1 layers, "4096") is a ValueError naming it."""
    c = _as_dict(config)
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    for key in (*keys, "num_key_value_heads", "head_dim"):  # present but not a size: the config is broken
        value = c.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"config.json has {key}={value!r}; a model's sizes are positive integers "
                             "(is the file damaged or hand-edited?)")
    if any(not isinstance(c.get(k), int) for k in keys):
        return None
    c.setdefault("num_key_value_heads", c["num_attention_heads"])
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    shape = Shape.from_config(c)
    model_type = c.get("model_type")
    if model_type in FORMULA_MODEL_TYPES and (head_dim * c["num_attention_heads"] == c["hidden_size"]
                                              or model_type in HEAD_DIM_FORMULA_TYPES):
        return shape
    counted = count_on_meta(config, trust_remote_code)
    if counted is None:
        return None
    total, per_layer = counted
    return replace(shape, counted=total, counted_layer=per_layer)


def _as_dict(config: Any) -> dict:
    """config.json's keys from a dict, a transformers config or any object with its attributes."""
    if hasattr(config, "to_dict"):
        return config.to_dict()
    return dict(config) if isinstance(config, dict) else dict(vars(config))


def count_on_meta(config: Any, trust_remote_code: bool = False) -> tuple[int, int] | None:
    """(parameters, parameters of one decoder layer) of the causal LM `config` describes, built
    on the meta device with one and with two decoder layers (a whole 72B model takes seconds to
    build even there; the layers repeat, so the count extrapolates exactly)."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        return None
    c = _as_dict(config)
    layers = c["num_hidden_layers"]

    def count(n: int) -> int:
        d = {**c, "num_hidden_layers": n}
        if isinstance(d.get("layer_types"), list):
            d["layer_types"] = d["layer_types"][:n]
        model_type = d.pop("model_type", None)
        cfg = (type(config).from_dict(d) if hasattr(config, "to_dict")
               else AutoConfig.for_model(model_type, **d))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)
        return model.num_parameters()

    try:
        one, two = count(1), count(2)
    except Exception:  # an architecture transformers cannot build from this config: no count
        return None
    return one + (layers - 1) * (two - one), two - one


def describe_params(s: Shape, expert_parallel: int = 1) -> str:
    """'7.62B parameters', or for a mixture-of-experts model also what one token uses and how the
    experts lie: '30.53B parameters (mixture-of-experts: 3.35B active per token; 128 experts per
    layer, 16 per rank at actor.expert_parallel_size=8)'."""
    text = f"{s.params / 1e9:.2f}B parameters"
    if not s.experts:
        return text
    per_rank = (f"{s.experts_per_rank(expert_parallel)} per rank at actor.expert_parallel_size={expert_parallel}"
                if expert_parallel > 1 else "all on every rank's shard")
    return (f"{text} (mixture-of-experts: {s.active_params / 1e9:.2f}B active per token; {s.experts} experts "
            f"per layer, {per_rank})")


def lora_params(s: Shape, rank: int, targets: Any = "all-linear") -> int:
    """Adapter parameters of LoRA rank `rank` on the decoder's linear layers `targets`
    ("all-linear" or module names; names outside the attention and MLP projections add none)."""
    h, kv, i = s.hidden, s.kv_width, s.intermediate
    sizes = {"q_proj": h + h, "k_proj": h + kv, "v_proj": h + kv, "o_proj": h + h,
             "gate_proj": h + i, "up_proj": h + i, "down_proj": i + h}
    names = LORA_LINEARS if targets == "all-linear" else [t.split(".")[-1] for t in targets]
    return rank * s.layers * sum(sizes.get(n, 0) for n in set(names))


@dataclass(frozen=True)
class Knobs:
    """The settings that change what a policy rank holds (each a config key)."""

    world_size: int
    strategy: str  # actor.strategy: ddp | fsdp2
    offload: bool  # actor.offload
    master: int  # bytes of actor.param_dtype
    lora_rank: int  # model.lora_rank
    colocated_engine: bool  # rollout.placement=colocated: an engine in every policy rank
    expert_parallel: int = 1  # actor.expert_parallel_size (mixture-of-experts; 1: experts on every rank)
    tensor_parallel: int = 1  # actor.tensor_parallel_size (fsdp2: every projection sliced over tp ranks)
    sequence_parallel: int = 1  # actor.sequence_parallel_size: held as given (the floor counts no activations)

    @property
    def offload_refused(self) -> bool:
        """Tensor or expert parallelism, neither of which takes actor.offload yet (preflight.py
        `check_tensor_parallel`, training/expert_parallel.py `check_supported`)."""
        return self.tensor_parallel > 1 or self.expert_parallel > 1

    @property
    def lora_refused(self) -> bool:
        """Expert parallelism does not take LoRA yet (training/expert_parallel.py `check_supported`)."""
        return self.expert_parallel > 1


@dataclass(frozen=True)
class Setting:
    """What the pre-flight takes as given: the run's other settings and the machine."""

    compute: int  # bytes of actor.compute_dtype
    reference: bool  # a KL term: a frozen reference beside the policy
    lora_targets: Any
    engine: str  # "share": takes rollout.gpu_memory_utilization of the device (vLLM, SGLang);
    # "copy": keeps its own copy of the weights, awake or asleep (the native engine); else "weights"
    engine_dtype: int  # bytes of rollout.dtype
    tensor_parallel: int
    memory_share: float  # rollout.gpu_memory_utilization
    device_bytes: int  # one device's memory; on a CPU the host's
    on_device: bool  # False: a CPU host, shared by every rank (offload moves nothing)
    other_ranks: int = 0  # CPU: disaggregated rollout ranks sharing the host
    teacher: int = 0  # parameters of a colocated distillation teacher: frozen, held like the reference


def available_bytes(k: Knobs, f: Setting) -> float:
    """Memory one policy rank may use: its device, or on a CPU its share of the host."""
    return f.device_bytes if f.on_device else f.device_bytes / (k.world_size + f.other_ranks)


def loads_sharded(strategy: str, colocated_engine: bool, lora: bool, engine_streams: bool = False) -> bool:
    """Whether the policy is loaded on the meta device and read shard by shard (m P / N) rather
    than whole: PolicyWorker's choice (polyrl/workers/policy.py `setup`), fsdp2 unless a colocated
    engine starts from the whole module (the built-in engine; a GPU engine starts from the first
    streamed sync: `engine_streams`, polyrl/rollout/factory.py `colocated_engine_streams`). A LoRA
    policy's base loads sharded too (`lora`: kept for the callers; its adapters start as peft
    draws them, training/sharded_load.py)."""
    return strategy == "fsdp2" and (not colocated_engine or engine_streams)


def rank_floor(s: Shape, k: Knobs, f: Setting) -> dict[str, dict[str, float]]:
    """Bytes a policy rank surely holds in each phase: `load` (the model, as PolicyWorker loads it),
    `engine start` (colocated: the whole model beside its engine, awake), `update` (one optimizer step)
    and `generate` (colocated: the training state resident beside the awake engine)."""
    P, m = s.params, k.master
    N = k.world_size if k.strategy == "fsdp2" else 1
    adapters = lora_params(s, k.lora_rank, f.lora_targets) if k.lora_rank else 0
    trainable = adapters if k.lora_rank else P
    offload = k.offload and k.strategy == "fsdp2" and f.on_device
    on_device = 0.0 if offload else 1.0
    if not k.colocated_engine:
        awake = asleep = 0.0
    elif f.engine == "copy":
        awake = asleep = f.engine_dtype * P
    elif f.engine == "share" and f.on_device:
        awake, asleep = f.memory_share * f.device_bytes, 0.0
    else:
        awake, asleep = f.engine_dtype * P / f.tensor_parallel, 0.0
    state = {"parameters": on_device * m * (P + adapters) / N, "gradients": on_device * m * trainable / N,
             "AdamW": on_device * 2 * m * trainable / N,
             "reference": on_device * m * P / N if f.reference and not k.lora_rank else 0.0,
             "teacher": on_device * m * f.teacher / N}
    # step temporaries: foreach AdamW's (the sqrt of the second moments) or, when larger,
    # FSDP2's two gathered layers in the compute dtype (under expert parallelism a layer's
    # gather holds only the rank's own experts; under tensor parallelism only the rank's slice:
    # memory_plan.py `gathered_units_bytes`). The state terms need no expert or tp term: every
    # expert is held once over the N ranks however they are split (E / ep experts, each sharded
    # over N / ep), and every projection's 1/tp slice is sharded over the N / tp others, so a
    # rank holds P / N of every kind of parameter (memory_plan.py `training_bytes` alike).
    gathered = s.gathered_layer_params(k.expert_parallel)
    transient = max(on_device * m * trainable / N,
                    gathered_units_bytes(gathered, f.compute, k.tensor_parallel) if k.strategy == "fsdp2" else 0)
    if loads_sharded(k.strategy, k.colocated_engine, bool(k.lora_rank)):
        load = on_device * m * P / N
    else:  # whole on the device, then (fsdp2) the shard copied out of it, to the host under offload
        load = m * P * (1 + on_device / N if k.strategy == "fsdp2" else 1)
    phases = {"load": {"model load": load, "engine": asleep},
              "update": {**state, "step temporaries": transient, "engine": asleep}}
    if k.colocated_engine:
        phases["engine start"] = {"whole model": m * P, "engine": awake}
        phases["generate"] = {"parameters": state["parameters"], "AdamW": state["AdamW"],
                              "reference": state["reference"], "teacher": state["teacher"], "engine": awake}
    return phases


def rank_need(s: Shape, k: Knobs, f: Setting) -> tuple[float, str]:
    """The floor's peak over the phases, and the phase that sets it."""
    totals = {phase: sum(terms.values()) for phase, terms in rank_floor(s, k, f).items()}
    phase = max(totals, key=totals.get)
    return totals[phase], phase


def fits(s: Shape, k: Knobs, f: Setting) -> bool:
    return rank_need(s, k, f)[0] <= available_bytes(k, f)


def fewest_ranks(s: Shape, k: Knobs, f: Setting) -> int | None:
    """The smallest actor.world_size above k's under which k (made fsdp2) fits, or None; a
    multiple of the tensor- and expert-parallel sizes (the mesh lays them out within the world)."""
    step = k.sequence_parallel * k.tensor_parallel * k.expert_parallel  # ep divides the data ranks
    for n in range(k.world_size + 1, MAX_RANKS + 1):
        if n % step:
            continue
        if fits(s, replace(k, world_size=n, strategy="fsdp2"), f):
            return n
    return None


def fitting_changes(s: Shape, k: Knobs, f: Setting) -> list[str]:
    """Settings that would fit, each computed: more ranks, offload, LoRA, bfloat16 master weights,
    disaggregated placement, tensor parallelism over the same ranks; one that fits only with more
    ranks too says how many. Offload is not offered under tensor or expert parallelism, nor LoRA
    under expert parallelism, which do not take them yet."""
    fsdp2 = [] if k.strategy == "fsdp2" else ["actor.strategy=fsdp2"]
    changes: list[tuple[list[str], Knobs]] = []
    if f.on_device and not k.offload and not k.offload_refused:
        changes.append((fsdp2 + ["actor.offload=true"], replace(k, offload=True, strategy="fsdp2")))
    if not k.lora_rank and not k.lora_refused:
        changes.append((["model.lora_rank>0"], replace(k, lora_rank=8)))
    if k.master > 2:
        changes.append((["actor.param_dtype=bfloat16"], replace(k, master=2)))
    if k.colocated_engine:
        changes.append((["rollout.placement=disaggregated"], replace(k, colocated_engine=False)))
    out = []
    if (n := fewest_ranks(s, k, f)) is not None:
        out.append(fsdp2 + [f"actor.world_size>={n}"])
    if (t := fewest_tensor_parallel(s, k, f)) is not None:
        out.append(fsdp2 + [f"actor.tensor_parallel_size={t}"])
    for keys, changed in changes:
        if fits(s, changed, f):
            out.append(keys)
        elif (n := fewest_ranks(s, changed, f)) is not None:
            out.append(keys + [f"actor.world_size>={n}"] + [key for key in fsdp2 if key not in keys])
    return [" and ".join(keys) for keys in out]


def fewest_tensor_parallel(s: Shape, k: Knobs, f: Setting) -> int | None:
    """The smallest actor.tensor_parallel_size above 1 under which k (made fsdp2) fits on the
    same ranks: one that divides actor.world_size and the model's heads, key-value heads and MLP
    width (training/tensor_parallel.py `check_divisible`), where tp can be on (no offload or
    expert parallelism; none suggested beside sequence parallelism or a tp already set); None
    otherwise."""
    if k.offload_refused or k.sequence_parallel > 1 or k.offload:
        return None
    for t in (2, 4, 8, 16, 32, 64):
        if k.world_size % t or s.heads % t or s.kv_heads % t or s.intermediate % t:
            continue
        if fits(s, replace(k, tensor_parallel=t, strategy="fsdp2"), f):
            return t
    return None


def engine_need(s: Shape, f: Setting) -> tuple[float, float]:
    """(bytes of one engine rank's weights in rollout.dtype, what that engine rank may hold) on a
    device: vLLM and SGLang load their shard within rollout.gpu_memory_utilization of the device,
    the native engine (no tensor parallelism) its whole copy within the device, others their
    shard within the device."""
    tp = 1 if f.engine == "copy" else f.tensor_parallel
    have = f.memory_share * f.device_bytes if f.engine == "share" else f.device_bytes
    return f.engine_dtype * s.params / tp, have


def engine_changes(s: Shape, f: Setting, tensor_parallel: bool) -> list[str]:
    """Engine settings whose weights would fit, computed: a larger tensor-parallel size (a power of
    two dividing the attention heads, for an engine that declares tensor_parallel), a larger
    memory share (vLLM, SGLang), bfloat16 weights."""
    need, have = engine_need(s, f)
    out: list[list[str]] = []
    sizes = [t for t in (2, 4, 8, 16, 32, 64) if t > f.tensor_parallel and s.heads % t == 0]
    for dtype, label in [(f.engine_dtype, [])] + ([(2, ["rollout.dtype=bfloat16"])] if f.engine_dtype > 2 else []):
        f_dtype = replace(f, engine_dtype=dtype)
        if label and engine_need(s, f_dtype)[0] <= have:
            out.append(label)
            continue
        t = next((t for t in sizes if engine_need(s, replace(f_dtype, tensor_parallel=t))[0] <= have), None)
        if tensor_parallel and t is not None:
            out.append(label + [f"rollout.tensor_parallel_size>={t}"])
    if f.engine == "share" and (share := math.ceil(20 * need / f.device_bytes) / 20) <= MAX_MEMORY_SHARE:
        out.append([f"rollout.gpu_memory_utilization>={share:g}"])
    return [" and ".join(keys) for keys in out]


# --- memory of the machine ---------------------------------------------------------------------
def device_memory_bytes(platform: Any) -> int | None:
    """Memory of one of `platform`'s devices (a simulated machine's from SIMULATED_DEVICE_MEMORY,
    a real one's as torch reports it); on a CPU platform the host's (`host_memory_bytes`); None
    where it cannot be known here (a device this process cannot see, an unknown simulated one)."""
    if not platform.ray_resource:
        return host_memory_bytes()
    probe = platform.probe
    if probe.simulated:
        return SIMULATED_DEVICE_MEMORY.get(probe.device_name or "")
    if not probe.device_count:  # seen through an smi tool only: no torch device to ask
        return None
    try:
        return int(platform.device_module().get_device_properties(0).total_memory)
    except Exception:  # a platform plugin whose device module has no such call
        return None


def host_memory_bytes() -> int:
    """This machine's memory, or the container's limit (cgroup v2 memory.max, v1
    memory.limit_in_bytes) where that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total
