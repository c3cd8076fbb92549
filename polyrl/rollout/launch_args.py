"""The exact arguments each rollout engine is started with, built by pure functions.

`engine_launch_args` is what both the rollout actors and `polyrl train --dry-run` call, so the
plan a user inspects is the plan that runs. Builders take the config and the (possibly
simulated) platform and never import the engine: they run on a laptop without a GPU.
Defaults come first, the user's `rollout.engine_kwargs.<engine>` last; a default of `None` means
"not set", a null in the user's kwargs is an error naming the key, and FP8's quantization settings
are merged into the user's dicts key by key (`polyrl/rollout/engines/launch_merge.py`).

What each builder returns is what the adapter passes on unchanged, with two exceptions for
TRT-LLM: `kv_cache_config` is a plain dict here (so it can be printed and compared) and becomes
`KvCacheConfig(**d)` in the adapter, and the placement group the actor starting the engine runs in
(a live Ray object) is added by the adapter at start (`placement_groups`, `placement_bundle_indices`).

`check_launch(rollout, platform)` is the one check of a rollout layout every builder runs first,
so `polyrl train --dry-run` refuses exactly what the launch refuses (issue 28).

Whether the engine is colocated with a policy rank (it sleeps while training and is filled from
the trainer's weights) is the topology's decision: every caller passes it as `colocated` (the launch
plan its actor's `RolePlan.colocated_engine`, the pre-flight the planned topology's); nothing here
reads `rollout.placement`.
"""

from __future__ import annotations

from typing import Any, Callable

from packaging.version import InvalidVersion, Version

from polyrl.platform import Platform
from polyrl.rollout.config import RolloutConfig
from polyrl.rollout.engines.launch_merge import (check_no_nulls, json_object, merge_fp8, model_uses_mla,
                                                 vllm_memory_share)

Builder = Callable[..., dict[str, Any]]
"""(rollout, model_path, platform, engine_version=None, *, colocated) -> launch arguments."""

VLLM_WORKER_EXTENSION = "polyrl.rollout.engines.vllm_worker.PolyrlWorkerExtension"
"""Loaded by vLLM inside each of its workers (by dotted path: vLLM imports it, not polyrl)."""
TRTLLM_WORKER_EXTENSION = "polyrl.rollout.engines.trtllm_worker.PolyrlTRTLLMWorkerExtension"
"""polyrl's TRT-LLM worker extension (TRT-LLM's `rlhf_utils.WorkerExtension` plus
`supports_partial_loading`, and a reload a vision-language model accepts): `update_weights(
ipc_handles)` on every worker, None finalizes. Imported by TRT-LLM inside its workers."""
SGLANG_FLASHINFER_SINCE = Version("0.5.12")
"""From this SGLang version on, FA3 CUDA-graph capture is broken: default to flashinfer (R3)."""
TRTLLM_WORKER_GPU_SHARE = 0.5
"""The share of its device each TensorRT-LLM worker asks Ray for inside the bundles of the
polyrl actor that starts the engine (`per_worker_gpu_share`); the polyrl actor on the same device must hold
no more than the rest of it, or the worker waits for a device that never frees."""
NATIVE_ENGINE_KWARGS = ("max_prefill_tokens", "prefix_cache_tokens", "max_model_len", "max_num_seqs",
                        "dtype", "num_threads")
"""`rollout.engine_kwargs.native` keys: the built-in engine's keyword arguments
(`polyrl/rollout/native/engine.py`) that polyrl does not set itself (model, device, tokenizer,
seed)."""


def merge_args(defaults: dict[str, Any], user: dict[str, Any] | None) -> dict[str, Any]:
    """Defaults (a `None` default is "not set" and dropped), then the user's values key by key
    (already checked for nulls by `user_kwargs`)."""
    merged = {**defaults, **(user or {})}
    return {k: v for k, v in merged.items() if v is not None}


def resolve_load_format(rollout: RolloutConfig, *, colocated: bool) -> str:
    """The load format the engine really starts with: "auto" (read the checkpoint), "dummy"
    (random weights, overwritten by the first sync) or another format the user named.

    The user's value is `rollout.engine_kwargs.<backend>.load_format` if given (it reaches the
    engine), else `rollout.load_format`. Unset means "dummy" for a colocated engine (the
    trainer's weights are copied in right after start) and with FP8 (no FP8 checkpoint exists),
    else "auto". For an engine that is not colocated "dummy" becomes "auto" unless
    quantization=fp8: nothing would fill the weights before the first rollout (R4, verl PR 6344).
    The trainer sends the weights before the first rollout exactly when this returns "dummy"
    for an engine that is not colocated (`needs_first_sync`)."""
    fp8 = rollout.quantization == "fp8"
    key = f"rollout.engine_kwargs.{rollout.backend}.load_format"
    given = (rollout.engine_kwargs.get(rollout.backend) or {}).get("load_format")
    if given is not None and fp8 and given != "dummy":
        raise ValueError(f"{key}={given}: rollout.quantization=fp8 has no FP8 checkpoint to read, "
                         "its weights arrive with the first weight sync; remove the key or set "
                         "it to dummy")
    fmt = given or rollout.load_format or ("dummy" if colocated or fp8 else "auto")
    if fmt == "dummy" and not colocated and not fp8:
        return "auto"
    return fmt


def needs_first_sync(rollout: RolloutConfig, *, colocated: bool) -> bool:
    """Whether rollout engines outside the trainer start on dummy weights, so the trainer must
    send the weights once before the first rollout (colocated engines are filled at start by
    `from_model`)."""
    return not colocated and resolve_load_format(rollout, colocated=colocated) == "dummy"


def parse_engine_version(engine_version: str | None) -> Version | None:
    if engine_version is None:
        return None
    try:
        return Version(engine_version)
    except InvalidVersion as exc:
        raise ValueError(f"engine version '{engine_version}' is not a version number "
                         "(expected e.g. 0.5.12)") from exc


def check_launch(rollout: RolloutConfig, platform: Platform, *, colocated: bool) -> None:
    """Layouts no engine can launch, refused with one line naming the fix. Every builder runs it
    first, so the dry run (which calls the builders) and the launch (the factory calls them too)
    cannot disagree."""
    tp = rollout.tensor_parallel_size
    if tp > 1 and colocated:
        raise ValueError(f"rollout.tensor_parallel_size={tp} with rollout.placement=colocated: a colocated "
                         "engine runs on its trainer rank's one device; use "
                         "rollout.placement=disaggregated for tensor parallelism")
    if rollout.quantization == "fp8" and platform.name == "cpu":
        raise ValueError(f"rollout.quantization=fp8 needs a GPU (FP8 kernels); the {rollout.backend} "
                         "engine on this CPU platform has none: unset rollout.quantization")


def check_replica_layout(rollout: RolloutConfig) -> None:
    """A job's rollout replicas as `polyrl train` and its dry run accept them: tensor parallelism
    needs a GPU engine. Not part of `check_launch`: the built-in engine stands in for a TP engine
    on a replica of several CPU ranks (engine on the leader) in the tests of the replica-leader
    weight path, which build the topology directly."""
    from polyrl.backends import capabilities, engines_that

    tp = rollout.tensor_parallel_size
    if tp > 1 and not capabilities(rollout.backend).tensor_parallel:
        raise ValueError(f"rollout.tensor_parallel_size={tp} needs a GPU engine "
                         f"({', '.join(engines_that('tensor_parallel'))}); the {rollout.backend} engine "
                         "runs one rank per replica: set rollout.tensor_parallel_size=1")


def user_kwargs(rollout: RolloutConfig, engine: str) -> dict[str, Any]:
    """The user's kwargs for `engine`, checked for nulls; `load_format` is left out because
    `resolve_load_format` already decided it from the same value. `quantization: fp8` without
    rollout.quantization=fp8 is refused: the engine would quantize its own way (per tensor)
    while polyrl's weight path assumes its block-FP8 layout or none."""
    user = dict(rollout.engine_kwargs.get(engine) or {})
    check_no_nulls(user, f"rollout.engine_kwargs.{engine}")
    user.pop("load_format", None)
    if str(user.get("quantization", "")).lower() == "fp8" and rollout.quantization != "fp8":
        raise ValueError(f"rollout.engine_kwargs.{engine}.quantization=fp8: FP8 rollout is "
                         "rollout.quantization=fp8 (block-FP8 weights sent with every sync); set "
                         "that and remove the key")
    return user


def fp8_hf_overrides(rollout: RolloutConfig) -> dict[str, Any] | None:
    """The quantization config FP8 rollout puts into the engine's view of the HF config."""
    if rollout.quantization != "fp8":
        return None
    import copy

    from polyrl.weights.fp8 import FP8_QUANT_CONFIG

    return {"quantization_config": copy.deepcopy(FP8_QUANT_CONFIG)}  # nested list: never share it


FP8_OVERRIDES_KEY = {"vllm": "hf_overrides", "sglang": "json_model_override_args",
                     "trtllm": "model_kwargs"}
"""Where each engine's launch arguments carry the FP8 quantization config (HF-config overrides)."""


def builds_polyrl_fp8(launch_args: dict[str, Any], engine: str) -> bool:
    """Whether an engine started with `launch_args` expects polyrl's block-FP8 weights: its
    HF-config overrides carry every `FP8_QUANT_CONFIG` entry. Adapters quantize the weights they
    load exactly then; a `quantization` key alone (the engine's own FP8) or a user's different
    quantization config must not make them quantize (issue 28)."""
    import json

    from polyrl.weights.fp8 import FP8_QUANT_CONFIG

    overrides = launch_args.get(FP8_OVERRIDES_KEY[engine]) or {}
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except json.JSONDecodeError:
            return False
    config = overrides.get("quantization_config") if isinstance(overrides, dict) else None
    return isinstance(config, dict) and all(config.get(k) == v for k, v in FP8_QUANT_CONFIG.items())


def with_fp8(rollout: RolloutConfig, user: dict[str, Any], engine: str,
             overrides_key: str) -> dict[str, Any]:
    """`user` with FP8's `quantization` and its HF-config overrides (under `overrides_key`)
    merged in key by key; unchanged without FP8."""
    overrides = fp8_hf_overrides(rollout)
    if overrides is None:
        return user
    fp8: dict[str, Any] = {overrides_key: overrides}
    if engine != "trtllm":  # TRT-LLM reads the quantization from model_kwargs only
        fp8["quantization"] = "fp8"
    return merge_fp8(user, fp8, f"rollout.engine_kwargs.{engine}")


# --- native ---------------------------------------------------------------------------------------

def native_args(rollout: RolloutConfig, model_path: str, platform: Platform,
                engine_version: str | None = None, *,
                colocated: bool) -> dict[str, Any]:
    """`NativeEngine(**args)` (`from_model` takes the same without `model_path`). The user's
    keys override the defaults one by one; a key the engine does not take is an error here,
    not a TypeError inside the rank."""
    check_launch(rollout, platform, colocated=colocated)
    user = user_kwargs(rollout, "native")
    unknown = sorted(set(user) - set(NATIVE_ENGINE_KWARGS))
    if unknown:
        raise ValueError(f"rollout.engine_kwargs.native.{unknown[0]} is not an argument of the "
                         f"built-in engine; it takes {', '.join(NATIVE_ENGINE_KWARGS)}")
    defaults = {"model_path": model_path, "dtype": rollout.dtype,
                "max_model_len": rollout.max_model_len, "max_num_seqs": rollout.max_num_seqs,
                # rollout.batch_invariant: the forward the trainer's log-probs also run
                "batch_invariant": rollout.batch_invariant or None}
    return merge_args(defaults, user)


# --- vLLM (AsyncEngineArgs keyword arguments) -----------------------------------------------------

def vllm_args(rollout: RolloutConfig, model_path: str, platform: Platform,
              engine_version: str | None = None, *,
              colocated: bool) -> dict[str, Any]:
    """`vllm.AsyncEngineArgs(**args)`. FP8 is quantized on the receiving side: the engine is
    built with the block-FP8 quantization config and the worker extension quantizes each bucket
    before `load_weights`.

    `distributed_executor_backend="mp"` for tensor parallelism: inside a Ray placement group
    vLLM would otherwise pick its Ray executor and wait for bundles polyrl's own actors hold,
    ignoring the devices the engine host sees (issue 28). With one device vLLM runs its worker
    in process ("uni") either way."""
    check_launch(rollout, platform, colocated=colocated)
    defaults = {
        "model": model_path,
        "dtype": rollout.dtype,
        "tensor_parallel_size": rollout.tensor_parallel_size,
        "distributed_executor_backend": "mp" if rollout.tensor_parallel_size > 1 else None,
        "gpu_memory_utilization": vllm_memory_share(rollout, platform.name),  # CPU: a share of host RAM
        "max_model_len": rollout.max_model_len,
        "max_num_seqs": rollout.max_num_seqs,
        "enable_prefix_caching": rollout.enable_prefix_caching,
        "enforce_eager": rollout.enforce_eager,
        # rollout.lora_mode=adapter: the base comes from disk, adapters through vLLM's LoRA API
        "load_format": "auto" if rollout.lora_mode == "adapter" else resolve_load_format(rollout, colocated=colocated),
        "enable_lora": rollout.lora_mode == "adapter" or None,
        # colocated: the trainer needs the memory back between rollouts (sleep level 1 keeps
        # weights in host memory, level 2 drops them; see the adapter)
        "enable_sleep_mode": colocated or None,
        "worker_extension_cls": VLLM_WORKER_EXTENSION,
    }
    user = with_fp8(rollout, user_kwargs(rollout, "vllm"), "vllm", "hf_overrides")
    return merge_args(defaults, user)


# --- SGLang (sgl.Engine / ServerArgs keyword arguments) -------------------------------------------

def sglang_attention_backend(platform: Platform, engine_version: str | None,
                             mla: bool = False) -> str | None:
    """aiter on ROCm; on NVIDIA GPUs flashinfer for sglang >= 0.5.12 (FA3 CUDA-graph capture is
    broken there), below it fa3 wherever SGLang's fa3 backend runs and flashinfer elsewhere.
    An unknown version (no sglang installed, no version declared for a dry run) is treated as
    the newest release, i.e. flashinfer: it works on every version and GPU, while fa3 would break
    the newest ones. Platforms without a compute capability (Ascend NPUs) get None: SGLang picks
    its own backend there (`ascend`)."""
    if platform.name == "rocm":
        return "aiter"
    capability = platform.capability
    if capability is None:
        return None
    version = parse_engine_version(engine_version)
    if version is None or version >= SGLANG_FLASHINFER_SINCE:
        return "flashinfer"
    # Where fa3 runs: SGLang asserts `(major == 8 and not use_mla_backend) or major == 9` when it
    # creates the fa3 backend ("FlashAttention v3 Backend requires SM>=80 and SM<=90"), in
    # sgl-project/sglang python/sglang/srt/layers/attention/attention_registry.py,
    # create_flashattention_v3_backend (model_runner.py in older releases).
    major = capability[0]
    return "fa3" if major == 9 or (major == 8 and not mla) else "flashinfer"


def sglang_args(rollout: RolloutConfig, model_path: str, platform: Platform,
                engine_version: str | None = None, *,
                colocated: bool) -> dict[str, Any]:
    """`sglang.Engine(**args)`. FP8 is quantized on the sending side (the adapter), the engine
    only needs the block-FP8 layout (`json_model_override_args`)."""
    import json

    check_launch(rollout, platform, colocated=colocated)
    user = user_kwargs(rollout, "sglang")
    if rollout.quantization == "fp8":
        key = "json_model_override_args"
        user[key] = json_object(user.get(key), f"rollout.engine_kwargs.sglang.{key}")
        user = with_fp8(rollout, user, "sglang", key)
        user[key] = json.dumps(user[key], sort_keys=True)
    defaults = {
        "model_path": model_path,
        "dtype": rollout.dtype,
        "tp_size": rollout.tensor_parallel_size,
        "mem_fraction_static": rollout.gpu_memory_utilization,
        "context_length": rollout.max_model_len,
        "max_running_requests": rollout.max_num_seqs,
        "disable_radix_cache": not rollout.enable_prefix_caching,
        "disable_cuda_graph": rollout.enforce_eager,
        "attention_backend": sglang_attention_backend(platform, engine_version,
                                                      model_uses_mla(model_path)),
        "load_format": resolve_load_format(rollout, colocated=colocated),
        # release/resume_memory_occupation need the memory saver (colocated: sleep between rollouts)
        "enable_memory_saver": colocated or None,
        "log_level": "error",
    }
    return merge_args(defaults, user)


# --- TensorRT-LLM (tensorrt_llm LLM / AsyncLLM keyword arguments) ---------------------------------

def trtllm_args(rollout: RolloutConfig, model_path: str, platform: Platform,
                engine_version: str | None = None, *,
                colocated: bool) -> dict[str, Any]:
    """TRT-LLM's PyTorch-backend `LLM(**args)`, with `kv_cache_config` as ONE merged dict:
    `enable_block_reuse` <- enable_prefix_caching, `free_gpu_memory_fraction` <-
    gpu_memory_utilization, then the user's `kv_cache_config` key by key, so user kwargs never
    replace the whole object (R4). The adapter builds `KvCacheConfig(**args["kv_cache_config"])`.

    Placement (issue 28): TRT-LLM's Ray orchestrator starts one worker actor per TP rank, and
    without placement arguments each asks Ray for a whole GPU that polyrl's actors already hold
    (start hangs, or lands on another device and the IPC device UUIDs mismatch). The workers go
    into the placement group of the actor starting the engine instead, `per_worker_gpu_share` of a device each; the
    adapter adds the group and the bundle indices of the replica at start (`trtllm.placement`).
    Sleep (colocated) is `enable_sleep=True`: 1.1 and 1.2 have no `SleepConfig`."""
    check_launch(rollout, platform, colocated=colocated)
    user = with_fp8(rollout, user_kwargs(rollout, "trtllm"), "trtllm", "model_kwargs")
    user_kv = user.pop("kv_cache_config", None) or {}
    if not isinstance(user_kv, dict):
        raise ValueError("rollout.engine_kwargs.trtllm.kv_cache_config must be a mapping of "
                         f"KvCacheConfig fields, got {type(user_kv).__name__}")
    kv_cache_config = merge_args({"enable_block_reuse": rollout.enable_prefix_caching,
                                  "free_gpu_memory_fraction": rollout.gpu_memory_utilization},
                                 user_kv)
    tp = rollout.tensor_parallel_size
    defaults = {
        "model": model_path,
        "backend": "pytorch",
        "dtype": rollout.dtype,
        "tensor_parallel_size": tp,
        "max_seq_len": rollout.max_model_len,
        "max_batch_size": rollout.max_num_seqs,
        "kv_cache_config": kv_cache_config,
        "load_format": resolve_load_format(rollout, colocated=colocated),
        # colocated: release()/resume() of weights and KV cache between rollouts
        "enable_sleep": colocated or None,
        "per_worker_gpu_share": TRTLLM_WORKER_GPU_SHARE,
        # one Ray-orchestrated executor per replica, extended with the IPC weight-update RPCs
        "orchestrator_type": "ray",
        "ray_worker_extension_cls": TRTLLM_WORKER_EXTENSION,
        # TRT-LLM's own all-reduce breaks convergence with several rollout instances (verl WAR)
        "allreduce_strategy": "NCCL" if tp > 1 else None,
    }
    return merge_args(defaults, user)


def plugin_args(rollout: RolloutConfig, model_path: str) -> dict[str, Any]:
    """The keyword arguments of a plugin engine that runs in the polyrl process and has no builder
    here (docs/engine_plugins.md): polyrl's settings, then its engine_kwargs as given."""
    user = dict(rollout.engine_kwargs.get(rollout.backend) or {})
    check_no_nulls(user, f"rollout.engine_kwargs.{rollout.backend}")
    return {"model_path": model_path, "dtype": rollout.dtype, "max_model_len": rollout.max_model_len,
            "max_num_seqs": rollout.max_num_seqs, **user}


BUILDERS: dict[str, Builder] = {"native": native_args, "vllm": vllm_args, "sglang": sglang_args,
                                "trtllm": trtllm_args}


def engine_launch_args(rollout: RolloutConfig, model_path: str, platform: Platform,
                       engine_version: str | None = None, *, colocated: bool) -> dict[str, Any]:
    """Keyword arguments the engine of `rollout.backend` is constructed with.

    `engine_version` is the engine package's version when known (installed, or declared for a
    dry run); builders whose defaults depend on it document what None means."""
    if rollout.backend not in BUILDERS:
        from polyrl.backends import ROLLOUT_BACKENDS

        if not ROLLOUT_BACKENDS.get(rollout.backend).engine_processes:  # a plugin in polyrl's process
            return plugin_args(rollout, model_path)
        raise ValueError(f"rollout.backend={rollout.backend}: no launch-argument builder; "
                         f"available: {', '.join(sorted(BUILDERS))}")
    return BUILDERS[rollout.backend](rollout, model_path, platform, engine_version, colocated=colocated)
