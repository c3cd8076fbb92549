"""Exact engine launch arguments across simulated platforms, placements, versions and overrides.

Every expected dict is written out in full: a default that appears, changes or disappears
without this file changing is a behaviour change a reviewer should see.
"""

from __future__ import annotations

import json

import pytest

from polyrl.platform import SIMULATED_PROBES, get_platform
from polyrl.rollout.config import RolloutConfig
from polyrl.rollout.launch_args import (
    BUILDERS,
    TRTLLM_WORKER_EXTENSION,
    VLLM_WORKER_EXTENSION,
    engine_launch_args,
    resolve_load_format,
    sglang_attention_backend,
)

MODEL = "/models/Qwen3-0.6B"
FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
       "weight_block_size": [128, 128]}


def platform(hw: str):
    return get_platform(None, SIMULATED_PROBES[hw])


def rollout(**kw) -> RolloutConfig:
    base = {"dtype": "bfloat16", "gpu_memory_utilization": 0.6, "max_num_seqs": 128,
            "max_model_len": 4096}
    return RolloutConfig(**{**base, **kw})


# --- load_format ----------------------------------------------------------------------------------

@pytest.mark.parametrize("placement,quant,given,expected", [
    ("hybrid", None, None, "dummy"),
    ("hybrid", None, "auto", "auto"),
    ("hybrid", None, "dummy", "dummy"),
    ("standalone", None, None, "auto"),
    ("standalone", None, "dummy", "auto"),      # nothing would fill the weights: load from disk
    ("standalone", None, "auto", "auto"),
    ("standalone", "fp8", None, "dummy"),       # fp8 weights arrive with the first sync
    ("standalone", "fp8", "dummy", "dummy"),
    ("hybrid", "fp8", None, "dummy"),
])
def test_load_format(placement, quant, given, expected):
    cfg = rollout(backend="vllm", placement=placement, quantization=quant, load_format=given)
    assert resolve_load_format(cfg) == expected


def test_fp8_config_errors_name_the_field():
    with pytest.raises(ValueError, match="rollout.load_format=dummy"):
        rollout(backend="sglang", quantization="fp8", load_format="auto")
    with pytest.raises(ValueError, match="needs a GPU engine"):
        rollout(backend="native", quantization="fp8")


# --- vLLM -----------------------------------------------------------------------------------------

VLLM_HYBRID = {
    "model": MODEL, "dtype": "bfloat16", "tensor_parallel_size": 1, "gpu_memory_utilization": 0.6,
    "max_model_len": 4096, "max_num_seqs": 128, "enable_prefix_caching": True,
    "enforce_eager": False, "load_format": "dummy", "enable_sleep_mode": True,
    "worker_extension_cls": VLLM_WORKER_EXTENSION,
}


@pytest.mark.parametrize("hw", ["h100", "gb200", "mi300x"])
def test_vllm_hybrid_same_on_every_gpu(hw):
    assert engine_launch_args(rollout(backend="vllm"), MODEL, platform(hw)) == VLLM_HYBRID


def test_vllm_standalone_fp8_and_user_overrides():
    cfg = rollout(backend="vllm", placement="standalone", num_replicas=2, tensor_parallel_size=2,
                  quantization="fp8", enable_prefix_caching=False,
                  engine_kwargs={"vllm": {"enforce_eager": True, "max_model_len": None,
                                          "swap_space": 8}})
    assert engine_launch_args(cfg, MODEL, platform("h100"), "0.11.0") == {
        "model": MODEL, "dtype": "bfloat16", "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.6, "max_num_seqs": 128, "enable_prefix_caching": False,
        "enforce_eager": True, "load_format": "dummy", "quantization": "fp8",
        "hf_overrides": {"quantization_config": FP8},
        "worker_extension_cls": VLLM_WORKER_EXTENSION, "swap_space": 8,
    }


def test_vllm_standalone_plain_loads_from_disk():
    cfg = rollout(backend="vllm", placement="standalone", load_format="dummy")
    args = engine_launch_args(cfg, MODEL, platform("gb200"))
    assert args["load_format"] == "auto" and "enable_sleep_mode" not in args


# --- SGLang ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("hw,version,expected", [
    ("mi300x", None, "aiter"),
    ("mi300x", "0.4.9", "aiter"),
    ("mi300x", "0.5.12", "aiter"),
    ("h100", "0.5.12", "flashinfer"),
    ("h100", "0.6.0", "flashinfer"),
    ("h100", "0.5.11", "fa3"),
    ("h100", "0.5.3rc2", "fa3"),
    ("h100", None, "flashinfer"),      # unknown version: treated as the newest release
    ("gb200", "0.5.11", "flashinfer"),  # FA3 kernels are Hopper-only
    ("gb200", "0.5.12", "flashinfer"),
    ("ascend910", "0.5.12", None),     # SGLang's own choice on Ascend
])
def test_sglang_attention_backend(hw, version, expected):
    assert sglang_attention_backend(platform(hw), version) == expected
    args = engine_launch_args(rollout(backend="sglang"), MODEL, platform(hw), version)
    assert args.get("attention_backend") == expected


@pytest.mark.parametrize("hw", ["mi300x", "h100"])
def test_sglang_user_attention_backend_always_wins(hw):
    cfg = rollout(backend="sglang", engine_kwargs={"sglang": {"attention_backend": "triton"}})
    for version in (None, "0.5.0", "0.5.12"):
        assert engine_launch_args(cfg, MODEL, platform(hw), version)["attention_backend"] == "triton"


def test_sglang_bad_version_names_it():
    with pytest.raises(ValueError, match="'latest' is not a version"):
        engine_launch_args(rollout(backend="sglang"), MODEL, platform("h100"), "latest")


def test_sglang_hybrid_exact():
    assert engine_launch_args(rollout(backend="sglang"), MODEL, platform("mi300x"), "0.5.12") == {
        "model_path": MODEL, "dtype": "bfloat16", "tp_size": 1, "mem_fraction_static": 0.6,
        "context_length": 4096, "max_running_requests": 128, "disable_radix_cache": False,
        "disable_cuda_graph": False, "attention_backend": "aiter", "load_format": "dummy",
        "enable_memory_saver": True, "log_level": "error",
    }


def test_sglang_standalone_fp8_exact():
    cfg = rollout(backend="sglang", placement="standalone", quantization="fp8",
                  enforce_eager=True, max_model_len=None,
                  engine_kwargs={"sglang": {"log_level": "info", "chunked_prefill_size": 4096}})
    assert engine_launch_args(cfg, MODEL, platform("h100"), "0.5.11") == {
        "model_path": MODEL, "dtype": "bfloat16", "tp_size": 1, "mem_fraction_static": 0.6,
        "max_running_requests": 128, "disable_radix_cache": False, "disable_cuda_graph": True,
        "attention_backend": "fa3", "load_format": "dummy", "quantization": "fp8",
        "json_model_override_args": json.dumps({"quantization_config": FP8}, sort_keys=True),
        "log_level": "info", "chunked_prefill_size": 4096,
    }


# --- TensorRT-LLM ---------------------------------------------------------------------------------

def test_trtllm_kv_cache_config_is_one_merged_dict():
    cfg = rollout(backend="trtllm", placement="standalone", tensor_parallel_size=2,
                  enable_prefix_caching=True, gpu_memory_utilization=0.7,
                  engine_kwargs={"trtllm": {"kv_cache_config": {"free_gpu_memory_fraction": 0.85,
                                                                "max_tokens": 65536},
                                            "max_num_tokens": 8192}})
    assert engine_launch_args(cfg, MODEL, platform("gb200")) == {
        "model": MODEL, "backend": "pytorch", "dtype": "bfloat16", "tensor_parallel_size": 2,
        "max_seq_len": 4096, "max_batch_size": 128,
        # the user's keys override one by one; enable_block_reuse survives
        "kv_cache_config": {"enable_block_reuse": True, "free_gpu_memory_fraction": 0.85,
                            "max_tokens": 65536},
        "load_format": "auto", "orchestrator_type": "ray",
        "ray_worker_extension_cls": TRTLLM_WORKER_EXTENSION, "allreduce_strategy": "NCCL",
        "max_num_tokens": 8192,
    }


def test_trtllm_hybrid_fp8_defaults():
    cfg = rollout(backend="trtllm", quantization="fp8", enable_prefix_caching=False)
    assert engine_launch_args(cfg, MODEL, platform("h100")) == {
        "model": MODEL, "backend": "pytorch", "dtype": "bfloat16", "tensor_parallel_size": 1,
        "max_seq_len": 4096, "max_batch_size": 128,
        "kv_cache_config": {"enable_block_reuse": False, "free_gpu_memory_fraction": 0.6},
        "load_format": "dummy", "model_kwargs": {"quantization_config": FP8},
        "sleep_config": {}, "orchestrator_type": "ray", "ray_worker_extension_cls": TRTLLM_WORKER_EXTENSION,
    }


def test_trtllm_user_none_drops_a_kv_default_and_bad_type_is_named():
    cfg = rollout(backend="trtllm",
                  engine_kwargs={"trtllm": {"kv_cache_config": {"enable_block_reuse": None}}})
    args = engine_launch_args(cfg, MODEL, platform("h100"))
    assert args["kv_cache_config"] == {"free_gpu_memory_fraction": 0.6}
    bad = rollout(backend="trtllm", engine_kwargs={"trtllm": {"kv_cache_config": 0.9}})
    with pytest.raises(ValueError, match="engine_kwargs.trtllm.kv_cache_config must be a mapping"):
        engine_launch_args(bad, MODEL, platform("h100"))


# --- every engine ---------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", sorted(BUILDERS))
@pytest.mark.parametrize("hw", ["h100", "gb200", "mi300x", "ascend910", "cpu"])
def test_user_kwargs_win_and_none_is_dropped(backend, hw):
    probe = {"native": {}, "vllm": {}, "sglang": {}, "trtllm": {}}
    plain = engine_launch_args(rollout(backend=backend), MODEL, platform(hw), "0.5.12")
    key = next(k for k, v in plain.items() if k not in ("model", "model_path") and v is not None)
    probe[backend] = {key: None, "extra_flag": 7}
    args = engine_launch_args(rollout(backend=backend, engine_kwargs=probe), MODEL, platform(hw),
                              "0.5.12")
    assert key not in args and args["extra_flag"] == 7
    assert all(v is not None for v in args.values())


def test_native_unchanged():
    cfg = RolloutConfig(max_num_seqs=4)
    assert engine_launch_args(cfg, MODEL, platform("cpu")) == {
        "model_path": MODEL, "dtype": "float32", "max_num_seqs": 4}
