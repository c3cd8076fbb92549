"""The engine-independent parts of the GPU adapters: stop reasons, prompt checks, log-prob
extraction, the engine loop thread, and each engine's sampling mapping (pure functions of
polyrl's SamplingParams; the adapters pass their output to the engine unchanged)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest

from polyrl.rollout.base import RolloutInputError, SamplingParams
from polyrl.rollout.engines.common import EngineLoop, check_prompt, map_stop_reason, sampled_logprobs
from polyrl.rollout.engines.sglang import sglang_request, sglang_sampling_params
from polyrl.rollout.engines.trtllm import trtllm_sampling_kwargs
from polyrl.rollout.engines.vllm import vllm_sampling_kwargs
from tests.rollout.colocation import colocated


@pytest.mark.parametrize("raw,expected", [
    ("stop", "stop"), ("length", "length"), ("abort", "aborted"),      # vLLM
    ({"type": "stop", "matched": 2}, "stop"), ({"type": "length", "length": 8}, "length"),
    ({"type": "abort", "message": "x"}, "aborted"),                    # SGLang
    ("cancelled", "aborted"), ("timeout", "aborted"),                  # TensorRT-LLM
    (None, "aborted"),                                                 # unfinished: cut short
])
def test_stop_reasons(raw, expected):
    assert map_stop_reason(raw) == expected


def test_unknown_stop_reason_is_an_error():
    with pytest.raises(ValueError, match="unknown engine finish reason 'exploded'"):
        map_stop_reason("exploded")


def test_prompt_checks_name_the_field():
    assert check_prompt((1, 2, 3)) == [1, 2, 3]
    for bad in ([], [1, -1], [1, 2.0], [True]):
        with pytest.raises(RolloutInputError) as err:
            check_prompt(bad)
        assert err.value.field == "prompt"


def test_sampled_logprobs_reads_the_sampled_token():
    records = [{5: -0.5, 9: -1.0}, {7: -0.25}]
    assert sampled_logprobs([5, 7], records, True, lambda rec, tok: rec[tok]) == [-0.5, -0.25]
    assert sampled_logprobs([5, 7], None, False, lambda rec, tok: rec[tok]) == []
    with pytest.raises(RuntimeError, match="1 log-prob records for 2 tokens"):
        sampled_logprobs([5, 7], records[:1], True, lambda rec, tok: rec[tok])


# --- the loop thread ------------------------------------------------------------------------------

def test_engine_loop_runs_coroutines_from_threads_and_loops():
    loop = EngineLoop("test-engine")
    try:
        async def where():
            await asyncio.sleep(0)
            return threading.current_thread().name

        assert loop.run(where(), 5, "probe") == "test-engine"

        async def from_another_loop():
            return await asyncio.gather(*(loop.run_async(where()) for _ in range(3)))

        assert asyncio.run(from_another_loop()) == ["test-engine"] * 3
        with pytest.raises(TimeoutError, match="slow op did not finish within 0 s"):
            loop.run(asyncio.sleep(10), 0.2, "slow op")
    finally:
        loop.close()


# --- sampling mapped per engine -------------------------------------------------------------------

FULL = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_tokens=32, n=2,
                      stop_token_ids=(7,), stop=("\n\n",), seed=11, logprobs=True, top_logprobs=0)


def test_vllm_sampling():
    assert vllm_sampling_kwargs(FULL) == {
        "n": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_tokens": 32,
        "stop_token_ids": [7], "stop": ["\n\n"], "ignore_eos": False, "logprobs": 0, "seed": 11}
    plain = vllm_sampling_kwargs(SamplingParams(logprobs=False))
    assert "logprobs" not in plain and "top_k" not in plain and "seed" not in plain
    assert vllm_sampling_kwargs(SamplingParams(top_logprobs=3))["logprobs"] == 3


def test_sglang_request_one_request_per_sample():
    req = sglang_request([1, 2, 3], FULL, "r")
    assert req == {
        "input_ids": [[1, 2, 3], [1, 2, 3]],
        "sampling_params": [sglang_sampling_params(FULL, 0), sglang_sampling_params(FULL, 1)],
        "return_logprob": True, "rid": ["r-0", "r-1"], "logprob_start_len": 2}
    assert sglang_sampling_params(FULL, 1) == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 32,
        "stop_token_ids": [7], "stop": ["\n\n"], "ignore_eos": False, "sampling_seed": 12}
    plain = sglang_sampling_params(SamplingParams(), 0)
    assert plain["top_k"] == -1 and "sampling_seed" not in plain and "stop" not in plain
    assert sglang_request([1], SamplingParams(top_logprobs=2), "x")["top_logprobs_num"] == 2


def test_trtllm_sampling():
    assert trtllm_sampling_kwargs(FULL) == {
        "n": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_tokens": 32,
        "stop_token_ids": [7], "stop": ["\n\n"], "ignore_eos": False, "seed": 11, "logprobs": 1}
    plain = trtllm_sampling_kwargs(SamplingParams(logprobs=False))
    assert plain["top_k"] == 0 and "logprobs" not in plain and "seed" not in plain


# --- registry -------------------------------------------------------------------------------------

def test_engines_are_registered_without_importing_them():
    code = ("import sys; from polyrl.rollout.base import ROLLOUT_ENGINES as R;"
            "assert R.names() == ['native', 'vllm', 'sglang', 'trtllm'], R.names();"
            "assert not [m for m in sys.modules if m.startswith('polyrl.rollout.engines')];"
            "assert not [m for m in ('vllm', 'sglang', 'tensorrt_llm') if m in sys.modules]")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_trtllm_ipc_handles_refuse_host_tensors(tmp_path):
    import torch

    from polyrl.rollout.base import WeightUpdateError
    from polyrl.rollout.engines.trtllm import read_hf_config, serialize_handles

    with pytest.raises(WeightUpdateError, match="parameter 'lm_head.weight' is in host memory"):
        serialize_handles([("lm_head.weight", torch.zeros(2, 2))])
    assert read_hf_config(str(tmp_path)) is None
    (tmp_path / "config.json").write_text('{"vision_config": {"depth": 2}}')
    assert read_hf_config(str(tmp_path)) == {"vision_config": {"depth": 2}}


def test_trtllm_quantizes_only_for_polyrl_fp8():
    # a user's own quantization_config (pre-quantized checkpoint) must not make the adapter
    # quantize what it sends; polyrl's FP8 merged with user keys still counts (issue 15)
    from polyrl.platform import SIMULATED_PROBES, get_platform
    from polyrl.rollout.config import RolloutConfig
    from polyrl.rollout.engines.trtllm import quantizes_fp8
    from polyrl.rollout.launch_args import engine_launch_args

    h100 = get_platform(None, SIMULATED_PROBES["h100"])
    user = {"model_kwargs": {"quantization_config": {"quant_method": "awq", "bits": 4}}}
    plain = RolloutConfig(backend="trtllm", engine_kwargs={"trtllm": user})
    assert not quantizes_fp8(engine_launch_args(plain, "/m", h100, colocated=colocated(plain)))
    merged = RolloutConfig(backend="trtllm", quantization="fp8", engine_kwargs={"trtllm": {
        "model_kwargs": {"quantization_config": {"modules_to_not_convert": ["lm_head"]}}}})
    assert quantizes_fp8(engine_launch_args(merged, "/m", h100, colocated=colocated(merged)))
