"""Exact engine launch arguments across simulated platforms, placements, versions and overrides.

Every expected dict is written out in full: a default that appears, changes or disappears
without this file changing is a behaviour change a reviewer should see.
"""

from __future__ import annotations

import json
import logging

import pytest

from polyrl.platform import SIMULATED_PROBES, get_platform, simulated_probe
from polyrl.rollout.engines import launch_merge
from polyrl.rollout.config import RolloutConfig
from polyrl.rollout.launch_args import (
    BUILDERS,
    TRTLLM_WORKER_EXTENSION,
    VLLM_WORKER_EXTENSION,
    engine_launch_args,
    needs_first_sync,
    resolve_load_format,
    sglang_attention_backend,
)
from tests.rollout.colocation import colocated

MODEL = "/models/Qwen3-0.6B"
FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
       "weight_block_size": [128, 128]}


def platform(hw: str):
    if hw == "a100":  # no simulated A100 machine: CUDA at capability 8.0
        return get_platform("cuda", simulated_probe("cuda", (8, 0)))
    return get_platform(None, SIMULATED_PROBES[hw])


def launch(cfg: RolloutConfig, model_path: str, platform, engine_version: str | None = None) -> dict:
    """The launch arguments with `colocated` as the launch plan passes it for cfg's placement."""
    return engine_launch_args(cfg, model_path, platform, engine_version, colocated=colocated(cfg))


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
    assert resolve_load_format(cfg, colocated=colocated(cfg)) == expected


@pytest.mark.parametrize("backend", ["vllm", "sglang", "trtllm"])
@pytest.mark.parametrize("placement,quant,given,expected,first_sync", [
    ("standalone", None, "dummy", "auto", False),   # was: dummy reached the engine, no sync
    ("standalone", "fp8", "dummy", "dummy", True),
    ("hybrid", None, "dummy", "dummy", False),       # from_model fills a hybrid engine at start
    ("standalone", None, "safetensors", "safetensors", False),
])
def test_load_format_in_engine_kwargs_follows_the_same_rule(backend, placement, quant, given,
                                                             expected, first_sync):
    # issue 15: engine_kwargs.<backend>.load_format=dummy bypassed the rule, so the first
    # standalone rollout sampled from random weights
    cfg = rollout(backend=backend, placement=placement, quantization=quant,
                  engine_kwargs={backend: {"load_format": given}})
    assert resolve_load_format(cfg, colocated=colocated(cfg)) == expected
    assert launch(cfg, MODEL, platform("h100"), "0.5.11")["load_format"] == expected
    assert needs_first_sync(cfg, colocated=colocated(cfg)) is first_sync


def test_fp8_with_a_disk_load_format_in_engine_kwargs_names_the_key():
    cfg = rollout(backend="vllm", placement="standalone", quantization="fp8",
                  engine_kwargs={"vllm": {"load_format": "auto"}})
    with pytest.raises(ValueError, match=r"rollout.engine_kwargs.vllm.load_format=auto: "
                                         r"rollout.quantization=fp8 has no FP8 checkpoint"):
        launch(cfg, MODEL, platform("h100"))


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
    assert launch(rollout(backend="vllm"), MODEL, platform(hw)) == VLLM_HYBRID


def test_vllm_standalone_fp8_and_user_overrides():
    cfg = rollout(backend="vllm", placement="standalone", num_replicas=2, tensor_parallel_size=2,
                  quantization="fp8", enable_prefix_caching=False,
                  engine_kwargs={"vllm": {"enforce_eager": True, "swap_space": 8}})
    assert launch(cfg, MODEL, platform("h100"), "0.11.0") == {
        "model": MODEL, "dtype": "bfloat16", "tensor_parallel_size": 2,
        "distributed_executor_backend": "mp", "gpu_memory_utilization": 0.6, "max_model_len": 4096, "max_num_seqs": 128,
        "enable_prefix_caching": False,
        "enforce_eager": True, "load_format": "dummy", "quantization": "fp8",
        "hf_overrides": {"quantization_config": FP8},
        "worker_extension_cls": VLLM_WORKER_EXTENSION, "swap_space": 8,
    }


def test_vllm_standalone_plain_loads_from_disk():
    cfg = rollout(backend="vllm", placement="standalone", load_format="dummy")
    args = launch(cfg, MODEL, platform("gb200"))
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
    ("gb200", "0.5.11", "flashinfer"),  # SGLang's fa3 backend asserts SM 8.x / 9.x
    ("a100", "0.5.11", "fa3"),          # issue 15: the seed's fa3, and fa3 runs on SM 8.x
    ("a100", "0.5.12", "flashinfer"),
    ("gb200", "0.5.12", "flashinfer"),
    ("ascend910", "0.5.12", None),     # SGLang's own choice on Ascend
])
def test_sglang_attention_backend(hw, version, expected):
    assert sglang_attention_backend(platform(hw), version) == expected
    args = launch(rollout(backend="sglang"), MODEL, platform(hw), version)
    assert args.get("attention_backend") == expected


@pytest.mark.parametrize("hw,expected", [("a100", "flashinfer"), ("h100", "fa3")])
def test_sglang_mla_model_gets_fa3_only_on_sm90(tmp_path, hw, expected):
    # SGLang's fa3 backend takes MLA models on SM 9.x only
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3",
                                                      "kv_lora_rank": 512}))
    args = launch(rollout(backend="sglang"), str(tmp_path), platform(hw), "0.5.11")
    assert args["attention_backend"] == expected
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    args = launch(rollout(backend="sglang"), str(tmp_path), platform(hw), "0.5.11")
    assert args["attention_backend"] == "fa3"


@pytest.mark.parametrize("hw", ["mi300x", "h100"])
def test_sglang_user_attention_backend_always_wins(hw):
    cfg = rollout(backend="sglang", engine_kwargs={"sglang": {"attention_backend": "triton"}})
    for version in (None, "0.5.0", "0.5.12"):
        assert launch(cfg, MODEL, platform(hw), version)["attention_backend"] == "triton"


def test_sglang_bad_version_names_it():
    with pytest.raises(ValueError, match="'latest' is not a version"):
        launch(rollout(backend="sglang"), MODEL, platform("h100"), "latest")


def test_sglang_hybrid_exact():
    assert launch(rollout(backend="sglang"), MODEL, platform("mi300x"), "0.5.12") == {
        "model_path": MODEL, "dtype": "bfloat16", "tp_size": 1, "mem_fraction_static": 0.6,
        "context_length": 4096, "max_running_requests": 128, "disable_radix_cache": False,
        "disable_cuda_graph": False, "attention_backend": "aiter", "load_format": "dummy",
        "enable_memory_saver": True, "log_level": "error",
    }


def test_sglang_standalone_fp8_exact():
    cfg = rollout(backend="sglang", placement="standalone", quantization="fp8",
                  enforce_eager=True, max_model_len=None,
                  engine_kwargs={"sglang": {"log_level": "info", "chunked_prefill_size": 4096}})
    assert launch(cfg, MODEL, platform("h100"), "0.5.11") == {
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
    assert launch(cfg, MODEL, platform("gb200")) == {
        "model": MODEL, "backend": "pytorch", "dtype": "bfloat16", "tensor_parallel_size": 2,
        "max_seq_len": 4096, "max_batch_size": 128,
        # the user's keys override one by one; enable_block_reuse survives
        "kv_cache_config": {"enable_block_reuse": True, "free_gpu_memory_fraction": 0.85,
                            "max_tokens": 65536},
        "load_format": "auto", "per_worker_gpu_share": 0.5, "orchestrator_type": "ray",
        "ray_worker_extension_cls": TRTLLM_WORKER_EXTENSION, "allreduce_strategy": "NCCL",
        "max_num_tokens": 8192,
    }


def test_trtllm_hybrid_fp8_defaults():
    cfg = rollout(backend="trtllm", quantization="fp8", enable_prefix_caching=False)
    assert launch(cfg, MODEL, platform("h100")) == {
        "model": MODEL, "backend": "pytorch", "dtype": "bfloat16", "tensor_parallel_size": 1,
        "max_seq_len": 4096, "max_batch_size": 128,
        "kv_cache_config": {"enable_block_reuse": False, "free_gpu_memory_fraction": 0.6},
        "load_format": "dummy", "model_kwargs": {"quantization_config": FP8},
        "enable_sleep": True, "per_worker_gpu_share": 0.5, "orchestrator_type": "ray",
        "ray_worker_extension_cls": TRTLLM_WORKER_EXTENSION,
    }


def test_trtllm_null_in_kv_cache_config_and_bad_type_are_named():
    # `kv_cache_config: {max_tokens:65536}` in YAML: one key "max_tokens:65536" with no value
    cfg = rollout(backend="trtllm",
                  engine_kwargs={"trtllm": {"kv_cache_config": {"max_tokens:65536": None}}})
    with pytest.raises(ValueError, match=r"rollout.engine_kwargs.trtllm.kv_cache_config."
                                         r"max_tokens:65536 is null \(YAML reads"):
        launch(cfg, MODEL, platform("h100"))
    bad = rollout(backend="trtllm", engine_kwargs={"trtllm": {"kv_cache_config": 0.9}})
    with pytest.raises(ValueError, match="engine_kwargs.trtllm.kv_cache_config must be a mapping"):
        launch(bad, MODEL, platform("h100"))


# --- every engine ---------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", sorted(BUILDERS))
@pytest.mark.parametrize("hw", ["h100", "gb200", "mi300x", "ascend910", "cpu"])
def test_user_kwargs_win_and_a_null_is_an_error_naming_the_key(backend, hw):
    plain = launch(rollout(backend=backend), MODEL, platform(hw), "0.5.12")
    key = next(k for k, v in plain.items() if k not in ("model", "model_path") and v is not None)
    extra = "prefix_cache_tokens" if backend == "native" else "extra_flag"  # native: its own keys
    probe = {backend: {key: "user-value", extra: 7}}
    args = launch(rollout(backend=backend, engine_kwargs=probe), MODEL, platform(hw),
                              "0.5.12")
    assert args[key] == "user-value" and args[extra] == 7
    # issue 15: a null was dropped silently (`{max_tokens:1024}` in YAML is such a null)
    nulled = {backend: {key: None}}
    with pytest.raises(ValueError, match=rf"rollout.engine_kwargs.{backend}.{key} is null; give it"):
        launch(rollout(backend=backend, engine_kwargs=nulled), MODEL, platform(hw), "0.5.12")


# --- FP8 merged into the user's dicts key by key (issue 15) ---------------------------------------

@pytest.fixture
def fresh_warnings(caplog):
    launch_merge._warned.clear()
    with caplog.at_level(logging.WARNING, logger="polyrl.rollout.engines.launch_merge"):
        yield caplog
    launch_merge._warned.clear()


def test_vllm_user_hf_overrides_keep_fp8(fresh_warnings):
    user = {"hf_overrides": {"rope_scaling": {"type": "yarn"}, "quantization_config": {
        "activation_scheme": "static", "modules_to_not_convert": ["lm_head"]}}}
    cfg = rollout(backend="vllm", placement="standalone", quantization="fp8",
                  engine_kwargs={"vllm": user})
    args = launch(cfg, MODEL, platform("h100"))
    assert args["quantization"] == "fp8"
    assert args["hf_overrides"] == {"rope_scaling": {"type": "yarn"}, "quantization_config": {
        **FP8, "modules_to_not_convert": ["lm_head"]}}
    [warning] = [r.getMessage() for r in fresh_warnings.records]
    assert "rollout.engine_kwargs.vllm.hf_overrides.quantization_config.activation_scheme" in warning
    assert user["hf_overrides"]["quantization_config"]["activation_scheme"] == "static"  # not mutated


def test_trtllm_user_model_kwargs_keep_fp8(fresh_warnings):
    cfg = rollout(backend="trtllm", quantization="fp8",
                  engine_kwargs={"trtllm": {"model_kwargs": {"num_hidden_layers": 2}}})
    args = launch(cfg, MODEL, platform("h100"))
    assert args["model_kwargs"] == {"num_hidden_layers": 2, "quantization_config": FP8}
    assert fresh_warnings.records == []  # nothing conflicted


def test_sglang_user_overrides_and_quantization_conflict(fresh_warnings):
    cfg = rollout(backend="sglang", placement="standalone", quantization="fp8",
                  engine_kwargs={"sglang": {"quantization": "awq",
                                            "json_model_override_args": '{"max_position_embeddings": 8192}'}})
    args = launch(cfg, MODEL, platform("h100"), "0.5.11")
    assert args["quantization"] == "fp8"
    assert json.loads(args["json_model_override_args"]) == {"max_position_embeddings": 8192,
                                                            "quantization_config": FP8}
    [warning] = [r.getMessage() for r in fresh_warnings.records]
    assert "rollout.engine_kwargs.sglang.quantization='awq'" in warning
    bad = rollout(backend="sglang", quantization="fp8",
                  engine_kwargs={"sglang": {"json_model_override_args": "[1]"}})
    with pytest.raises(ValueError, match="json_model_override_args must be a JSON object"):
        launch(bad, MODEL, platform("h100"))


def test_without_fp8_user_dicts_pass_unchanged():
    cfg = rollout(backend="sglang", engine_kwargs={"sglang": {"json_model_override_args": '{"a": 1}'}})
    assert launch(cfg, MODEL, platform("h100"))["json_model_override_args"] == '{"a": 1}'


def test_native_unchanged():
    cfg = RolloutConfig(max_num_seqs=4)
    assert launch(cfg, MODEL, platform("cpu")) == {
        "model_path": MODEL, "dtype": "float32", "max_num_seqs": 4}


# --- issue 28: launch checks shared by the dry run and the launch ---------------------------------

def test_vllm_tensor_parallel_runs_its_workers_as_processes():
    # in a placement-group actor vLLM picked its Ray executor for TP > 1 and waited for bundles
    # polyrl's actors hold; mp spawns the TP workers on the devices the engine host sees
    tp2 = rollout(backend="vllm", placement="standalone", tensor_parallel_size=2)
    assert launch(tp2, MODEL, platform("h100"))["distributed_executor_backend"] == "mp"
    tp1 = rollout(backend="vllm", placement="standalone")
    assert "distributed_executor_backend" not in launch(tp1, MODEL, platform("h100"))
    mine = rollout(backend="vllm", placement="standalone", tensor_parallel_size=2,
                   engine_kwargs={"vllm": {"distributed_executor_backend": "ray"}})
    assert launch(mine, MODEL, platform("h100"))["distributed_executor_backend"] == "ray"


def test_trtllm_places_its_workers_and_sleeps_without_sleep_config():
    # TRT-LLM 1.1 / 1.2 export no SleepConfig; its workers asked Ray for whole GPUs polyrl holds
    hybrid = launch(rollout(backend="trtllm"), MODEL, platform("h100"))
    assert hybrid["enable_sleep"] is True and "sleep_config" not in hybrid
    assert hybrid["per_worker_gpu_share"] == 0.5
    standalone = launch(rollout(backend="trtllm", placement="standalone"), MODEL,
                                    platform("h100"))
    assert "enable_sleep" not in standalone and standalone["per_worker_gpu_share"] == 0.5


@pytest.mark.parametrize("backend", ["vllm", "sglang", "trtllm", "native"])
def test_hybrid_tensor_parallel_is_refused_by_every_builder(backend):
    cfg = rollout(backend=backend, tensor_parallel_size=2)
    expected = "placement=colocated: a colocated engine runs on its trainer rank's one device"
    with pytest.raises(ValueError, match=expected):
        launch(cfg, MODEL, platform("h100"), "0.5.12")


def test_native_kwargs_go_through_the_launch_checks():
    # issue 28: a null was a TypeError and max_num_seqs "got multiple values" inside the rank
    cfg = rollout(engine_kwargs={"native": {"max_num_seqs": 8, "prefix_cache_tokens": 64}})
    assert launch(cfg, MODEL, platform("cpu")) == {
        "model_path": MODEL, "dtype": "bfloat16", "max_model_len": 4096, "max_num_seqs": 8,
        "prefix_cache_tokens": 64}
    with pytest.raises(ValueError, match=r"rollout.engine_kwargs.native.max_num_seqs is null"):
        launch(rollout(engine_kwargs={"native": {"max_num_seqs": None}}), MODEL,
                           platform("cpu"))
    with pytest.raises(ValueError, match=r"rollout.engine_kwargs.native.device is not an argument "
                                         r"of the built-in engine; it takes max_prefill_tokens"):
        launch(rollout(engine_kwargs={"native": {"device": "cuda"}}), MODEL,
                           platform("cpu"))


def test_native_kwargs_are_the_engines_own_arguments():
    import inspect

    from polyrl.rollout.launch_args import NATIVE_ENGINE_KWARGS
    from polyrl.rollout.native.engine import NativeEngine

    params = inspect.signature(NativeEngine.__init__).parameters
    assert set(NATIVE_ENGINE_KWARGS) <= set(params)


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_fp8_through_engine_kwargs_is_refused(backend):
    # the engine quantized per tensor on its own while polyrl's worker block-quantized for it
    cfg = rollout(backend=backend, placement="standalone",
                  engine_kwargs={backend: {"quantization": "fp8"}})
    with pytest.raises(ValueError, match=rf"rollout.engine_kwargs.{backend}.quantization=fp8: FP8 "
                                         r"rollout is rollout.quantization=fp8"):
        launch(cfg, MODEL, platform("h100"), "0.5.12")
    other = rollout(backend=backend, engine_kwargs={backend: {"quantization": "awq"}})
    assert launch(other, MODEL, platform("h100"), "0.5.12")["quantization"] == "awq"


def test_fp8_on_a_cpu_build_is_one_line():
    cfg = rollout(backend="vllm", placement="standalone", quantization="fp8")
    with pytest.raises(ValueError, match=r"^rollout.quantization=fp8 needs a GPU \(FP8 kernels\); "
                                         r"the vllm engine on this CPU platform has none"):
        launch(cfg, MODEL, platform("cpu"))


def test_batch_invariant_reaches_the_built_in_engine():
    cfg = RolloutConfig(max_num_seqs=4, batch_invariant=True)
    assert launch(cfg, MODEL, platform("cpu")) == {
        "model_path": MODEL, "dtype": "float32", "max_num_seqs": 4, "batch_invariant": True}
