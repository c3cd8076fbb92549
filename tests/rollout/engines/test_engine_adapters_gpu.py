"""The adapters on the real engines: generate (sync and async), version stamping, a weight update
that round-trips, abort. Each engine's tests run only where that engine is installed and a GPU
is present (skipped otherwise, never faked). FP8 and full training runs: scripts/gpu_check.sh.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from polyrl.platform import current_platform
from polyrl.rollout.base import SamplingParams
from polyrl.rollout.config import RolloutConfig
from polyrl.rollout.factory import EXTRAS, build_disaggregated_engine

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=sorted(EXTRAS))
def engine(request):
    pytest.importorskip(EXTRAS[request.param][0])
    platform = current_platform()
    if platform.capability is None and platform.name != "rocm":
        pytest.skip("needs a GPU")
    tiny_model = request.getfixturevalue("tiny_model")
    cfg = RolloutConfig(backend=request.param, placement="standalone", dtype="bfloat16",
                        gpu_memory_utilization=0.3, max_model_len=128, max_num_seqs=16,
                        enforce_eager=True)
    eng = build_disaggregated_engine(cfg, tiny_model, platform.torch_device(0), seed=0)
    yield eng
    eng.shutdown()


PROMPT = [5, 6, 7, 8, 9]


def test_generate_batch_returns_sampled_logprobs(engine):
    outs = engine.generate_batch([PROMPT, PROMPT[:3]], SamplingParams(n=2, max_tokens=8, seed=3))
    assert [len(o) for o in outs] == [2, 2]
    for out in (o for group in outs for o in group):
        assert 1 <= len(out.token_ids) <= 8 and len(out.logprobs) == len(out.token_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in out.logprobs)
        assert out.stop_reason in ("stop", "length") and out.weight_version == engine.weight_version
        if out.stop_reason == "length":
            assert len(out.token_ids) == 8


def test_async_generate(engine):
    outs = asyncio.run(engine.generate(PROMPT, SamplingParams(n=1, max_tokens=4, temperature=0)))
    assert len(outs) == 1 and outs[0].prompt_tokens == len(PROMPT)


def test_weight_update_round_trips_and_stamps_the_version(engine, tiny_model):
    from safetensors.torch import load_file

    greedy = SamplingParams(max_tokens=6, temperature=0)
    before = engine.generate_batch([PROMPT], greedy)[0][0]
    device = current_platform().torch_device(0)
    state = {k: v.to(device=device, dtype=torch.bfloat16)
             for k, v in load_file(f"{tiny_model}/model.safetensors").items()}
    engine.update_weights(state, 7)
    after = engine.generate_batch([PROMPT], greedy)[0][0]
    assert engine.weight_version == 7 and after.weight_version == 7
    assert after.token_ids == before.token_ids  # the same weights again: the same greedy tokens
    zeros = {k: torch.zeros_like(v) for k, v in state.items()}
    engine.update_weights(zeros, 8)
    changed = engine.generate_batch([PROMPT], greedy)[0][0]
    assert changed.weight_version == 8 and set(changed.logprobs) != set(before.logprobs)
    engine.update_weights(state, 9)


def test_abort_all_when_idle(engine):
    assert engine.abort_all() == 0
    assert engine.health()["ok"] is True


@pytest.fixture(scope="module")
def vllm_lora_engine(tiny_model):
    pytest.importorskip("vllm")
    platform = current_platform()
    if platform.capability is None and platform.name != "rocm":
        pytest.skip("needs a GPU")
    cfg = RolloutConfig(backend="vllm", placement="standalone", dtype="bfloat16", lora_mode="adapter",
                        gpu_memory_utilization=0.25, max_model_len=128, max_num_seqs=16, enforce_eager=True)
    eng = build_disaggregated_engine(cfg, tiny_model, platform.torch_device(0), seed=0)
    yield eng
    eng.shutdown()


def test_vllm_lora_adapter_path(vllm_lora_engine, tiny_model):
    """rollout.lora_mode=adapter: an update of adapter tensors loads as a vLLM LoRA adapter that
    every request then uses; its log-probs are the merged model's (transformers, fp32) within
    bf16 precision, and the next version's adapter replaces it."""
    from transformers import AutoModelForCausalLM

    from polyrl.training.lora import LoraConfig, adapter_named_tensors, apply_lora, merged_named_weights

    engine = vllm_lora_engine
    greedy = SamplingParams(max_tokens=6, temperature=0)
    base = engine.generate_batch([PROMPT], greedy)[0][0]
    outs = {}
    for version, seed in ((1, 1), (2, 2)):
        torch.manual_seed(seed)
        policy = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model), LoraConfig(lora_rank=8))
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn_like(p) * 0.2)
        engine.update_weights(list(adapter_named_tensors(policy)), version)
        out = engine.generate_batch([PROMPT], greedy)[0][0]
        assert engine.weight_version == version and out.weight_version == version
        merged = AutoModelForCausalLM.from_pretrained(tiny_model)
        merged.load_state_dict(dict(merged_named_weights(policy)), strict=False)
        ids = torch.tensor([PROMPT + out.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(merged(ids).logits[0, len(PROMPT) - 1:-1].float(), -1)
        want = logp.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=0.1, rtol=0.05)
        outs[version] = out
    assert outs[1].logprobs != base.logprobs and outs[2].logprobs != outs[1].logprobs
