"""The engine's numbers against a plain transformers forward of the same checkpoint (fp32)."""

from __future__ import annotations

import pytest
import torch

from polyrl.rollout.base import SamplingParams
from polyrl.rollout.native.engine import NativeEngine

ARCHS = ("llama", "qwen2", "qwen3")
PROMPTS = [[5, 17, 33, 2, 90, 64, 7], [40, 41], [3, 9, 27, 81, 115]]


def hf_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return logp[len(prompt) - 1 : -1].gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_match_transformers(arch, model_dirs, hf_models):
    engine = NativeEngine(model_dirs[arch], max_model_len=64)
    sampling = SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=3, ignore_eos=True, top_logprobs=3)
    outs = engine.generate_batch(PROMPTS, sampling)
    for prompt, samples in zip(PROMPTS, outs):
        for out in samples:
            assert len(out.token_ids) == len(out.logprobs) == 12
            ref = hf_logprobs(hf_models[arch], prompt, out.token_ids)
            assert (torch.tensor(out.logprobs) - ref).abs().max().item() <= 1e-4
            # top-k logprobs are the k best of the same distribution
            best = max(out.top_logprobs[0].values())
            assert out.logprobs[0] <= best + 1e-6 and len(out.top_logprobs[0]) == 3


@pytest.mark.parametrize("arch", ARCHS)
def test_filtered_sampling_still_reports_raw_logprobs(arch, model_dirs, hf_models):
    """Temperature / top-k / top-p shape what is sampled, never the reported logprob."""
    engine = NativeEngine(model_dirs[arch], max_model_len=64)
    sampling = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=8, seed=1, ignore_eos=True)
    out = engine.generate_batch([PROMPTS[0]], sampling)[0][0]
    ref = hf_logprobs(hf_models[arch], PROMPTS[0], out.token_ids)
    assert (torch.tensor(out.logprobs) - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_transformers_greedy(arch, model_dirs, hf_models):
    engine = NativeEngine(model_dirs[arch], max_model_len=64)
    outs = engine.generate_batch(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for prompt, (out,) in zip(PROMPTS, outs):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(10):
                ids.append(int(hf_models[arch](torch.tensor([ids])).logits[0, -1].argmax()))
        assert out.token_ids == ids[len(prompt) :]


def test_bfloat16_logprobs_are_close(model_dirs, hf_models):
    engine = NativeEngine(model_dirs["qwen2"], dtype="bfloat16", max_model_len=64)
    out = engine.generate_batch([PROMPTS[0]], SamplingParams(max_tokens=8, seed=0, ignore_eos=True))[0][0]
    ref = hf_logprobs(hf_models["qwen2"], PROMPTS[0], out.token_ids)
    assert (torch.tensor(out.logprobs) - ref).abs().max().item() < 0.1


def test_from_model_matches_loading_from_disk(model_dirs, hf_models):
    disk = NativeEngine(model_dirs["llama"], max_model_len=64, tokenizer=False)
    mem = NativeEngine.from_model(hf_models["llama"], max_model_len=64)
    sampling = SamplingParams(max_tokens=6, seed=11, ignore_eos=True)
    a = disk.generate_batch([PROMPTS[1]], sampling)[0][0]
    b = mem.generate_batch([PROMPTS[1]], sampling)[0][0]
    assert a.token_ids == b.token_ids
