"""How the user's `rollout.engine_kwargs.<engine>` meet polyrl's launch defaults (pure functions).

Used by `polyrl/rollout/launch_args.py`. Three rules, each from a bug class users hit:

- A null value is an error naming the key. In YAML `{max_tokens:1024}` (no space after the
  colon) is the key "max_tokens:1024" with a null value; dropping it silently launched the engine
  without the setting the user meant to give.
- FP8 rollout's quantization settings are merged key by key into the user's dicts (vLLM
  `hf_overrides`, SGLang `json_model_override_args`, TRT-LLM `model_kwargs`), never replaced by
  them: a user dict that replaced the whole object turned FP8 off silently (TRT-LLM) or left the
  engine unbuilt for the FP8 weights the worker sends (vLLM) — the bug class verl PR 6344 fixed
  for TRT-LLM's `KvCacheConfig` (R4 in docs/architecture.md). On a conflicting key FP8 wins,
  with a warning naming the key.
- Whether the model uses multi-head latent attention (MLA), which decides SGLang's attention
  backend on SM 8.x.
- vLLM's memory share on its CPU build (`vllm_memory_share`): there `gpu_memory_utilization` is
  a share of host RAM, so the GPU default would reserve half the machine.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any, Mapping

logger = logging.getLogger(__name__)

_warned: set[str] = set()


def check_no_nulls(value: Any, path: str) -> None:
    """Raise ValueError naming the first key under `path` whose value is null."""
    if not isinstance(value, Mapping):
        return
    for key, item in value.items():
        where = f"{path}.{key}"
        if item is None:
            hint = (" (YAML reads `key:value` without a space after the colon as one key with no "
                    "value: write `key: value`)" if ":" in str(key) else "")
            raise ValueError(f"{where} is null{hint}; give it a value or remove the key")
        check_no_nulls(item, where)


def merge_fp8(user: Mapping[str, Any] | None, fp8: Mapping[str, Any], path: str) -> dict[str, Any]:
    """`user` with `fp8` merged in key by key (nested dicts too): the user's other keys stay,
    FP8 wins a conflicting key and a warning names it."""
    merged = copy.deepcopy(dict(user or {}))
    for key, value in fp8.items():
        where = f"{path}.{key}"
        mine = merged.get(key)
        if isinstance(mine, Mapping) and isinstance(value, Mapping):
            merged[key] = merge_fp8(mine, value, where)
            continue
        if key in merged and mine != value:
            _warn_once(where, f"{where}={mine!r} conflicts with rollout.quantization=fp8, which "
                              f"needs {value!r}; using FP8's value")
        merged[key] = copy.deepcopy(value)
    return merged


def json_object(value: Any, path: str) -> dict[str, Any]:
    """A JSON-object string (SGLang's `json_model_override_args`) or a mapping, as a dict."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    try:
        decoded = json.loads(value)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} must be a JSON object string or a mapping, got {value!r}") from exc
    if not isinstance(decoded, dict):
        raise ValueError(f"{path} must be a JSON object, got {value!r}")
    return decoded


def model_uses_mla(model_path: str) -> bool:
    """Whether the model's HF config describes multi-head latent attention (DeepSeek-V2/V3,
    Kimi-K2, MiniCPM3 carry `kv_lora_rank`). A path without a readable config.json (a hub id,
    a dry run for a model not on this machine) counts as not MLA."""
    config = Path(model_path) / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
    return bool(text.get("kv_lora_rank"))


def _warn_once(key: str, message: str) -> None:
    # builders run once per actor and in every dry run: one warning per key and process
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


VLLM_CPU_MEMORY_SHARE = 0.1
"""vLLM's `gpu_memory_utilization` on its CPU build when the user chose none: a tenth of host RAM
for the engine's worker (weights, activations, KV cache)."""


def vllm_memory_share(rollout: Any, platform_name: str) -> float:
    """vLLM's `gpu_memory_utilization` for `rollout` on `platform_name`.

    On the CPU build it is a share of the node's *host RAM* that the worker reserves at start
    (vllm/v1/worker/cpu_worker.py: total memory x the share, refused when above the free
    memory), most of it for the KV cache. The GPU default (`rollout.gpu_memory_utilization`,
    0.5) reserved 11.2 of 23.5 GiB for the bundled tiny model's KV cache, whose allocation and
    warm-up took 28.7 s of the engine's start, against 1.5 s at 0.1 (docs/gpu_engines.md), and
    in colocated placement the trainer shares that RAM. So on CPU an unset value means
    `VLLM_CPU_MEMORY_SHARE`; a value the user set (`rollout.gpu_memory_utilization`, which
    pydantic records in `model_fields_set`) is kept, as is
    `engine_kwargs.vllm.gpu_memory_utilization` (merged over the defaults)."""
    if platform_name == "cpu" and "gpu_memory_utilization" not in rollout.model_fields_set:
        return VLLM_CPU_MEMORY_SHARE
    return rollout.gpu_memory_utilization
