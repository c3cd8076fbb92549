"""Sampling controls, seeds, shared prefill and continuous batching."""

from __future__ import annotations

import asyncio
import math

import pytest

from polyrl.rollout.base import SamplingParams
from polyrl.rollout.native.engine import NativeEngine

from native_models import EOS


def test_seed_gives_same_tokens_whatever_else_is_batched(engine):
    sampling = SamplingParams(max_tokens=12, seed=1234, ignore_eos=True, n=2)
    alone = engine.generate_batch([[10, 20, 30]], sampling)[0]
    others = SamplingParams(max_tokens=20, ignore_eos=True, n=3)
    batched = engine.generate_batch(
        [[7, 8], [10, 20, 30], [50, 51, 52, 53, 54]], [others, sampling, others]
    )[1]
    assert [o.token_ids for o in alone] == [o.token_ids for o in batched]
    assert alone[0].token_ids != alone[1].token_ids  # the n samples are not copies of each other
    different = engine.generate_batch([[10, 20, 30]], SamplingParams(max_tokens=12, seed=99, ignore_eos=True))
    assert different[0][0].token_ids != alone[0].token_ids


def test_n_samples_share_one_prefill(engine):
    prompt = [4, 5, 6, 7, 8, 9]
    outs = engine.generate_batch([prompt], SamplingParams(n=4, max_tokens=5, top_logprobs=4, ignore_eos=True))[0]
    assert engine.stats["prefill_tokens"] == len(prompt) and engine.stats["prefill_calls"] == 1
    assert len(outs) == 4
    first = [o.top_logprobs[0] for o in outs]  # same prompt KV -> same first-token distribution
    assert all(f == first[0] for f in first)
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_max_tokens_and_stop_token_ids(engine):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = engine.generate_batch([[1 + 2, 4]], greedy)[0][0]
    assert len(ref.token_ids) == 8 and ref.stop_reason == "length"
    stop_at = ref.token_ids[3]
    cut = engine.generate_batch(
        [[3, 4]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_at])
    )[0][0]
    first = ref.token_ids.index(stop_at)
    assert cut.token_ids == ref.token_ids[: first + 1] and cut.stop_reason == "stop"


def test_eos_stops_unless_ignored(engine):
    assert EOS in engine.eos_token_ids
    hot = dict(max_tokens=40, n=8, seed=0, temperature=3.0)  # hot enough that EOS comes up
    ignored = engine.generate_batch([[5, 6]], SamplingParams(**hot, ignore_eos=True))[0]
    assert all(o.stop_reason == "length" and len(o.token_ids) == 40 for o in ignored)
    assert any(EOS in o.token_ids for o in ignored)
    stopped = engine.generate_batch([[5, 6]], SamplingParams(**hot))[0]
    for full, cut in zip(ignored, stopped):  # same seed: the same tokens up to the first EOS
        if EOS in full.token_ids:
            assert cut.token_ids == full.token_ids[: full.token_ids.index(EOS) + 1]
            assert cut.stop_reason == "stop"
        else:
            assert cut.token_ids == full.token_ids


def test_stop_strings_cut_the_text(engine):
    tok = engine.tokenizer
    ref = engine.generate_batch([tok.encode("abc", add_special_tokens=False)],
                                SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0][0]
    stop = ref.text[4:6]
    out = engine.generate_batch([tok.encode("abc", add_special_tokens=False)],
                                SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))[0][0]
    assert out.stop_reason == "stop"
    assert out.text == ref.text[: ref.text.find(stop)]
    assert stop in tok.decode(out.token_ids) and out.token_ids == ref.token_ids[: len(out.token_ids)]


def test_generation_stops_at_max_model_len(qwen3_dir):
    engine = NativeEngine(qwen3_dir, max_model_len=16)
    out = engine.generate_batch([[9] * 10], SamplingParams(max_tokens=50, ignore_eos=True))[0][0]
    assert len(out.token_ids) == 6 and out.stop_reason == "length"


def test_continuous_batching_requests_join_and_leave(engine):
    prompts = [[11, 12, 13], [20, 21], [30, 31, 32, 33], [40], [50, 51]]
    lengths = [30, 5, 18, 9, 24]
    expected = [
        engine.generate_batch([p], SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))[0][0].token_ids
        for p, m in zip(prompts, lengths)
    ]
    before = engine.stats

    async def late(i: int):
        # arrive after 3 * i decode steps: request 0 (30 tokens) is still decoding then
        while engine.stats["decode_steps"] - before["decode_steps"] < 3 * i:
            await asyncio.sleep(0)
        sp = SamplingParams(temperature=0, max_tokens=lengths[i], ignore_eos=True)
        return await engine.generate(prompts[i], sp, request_id=f"r{i}")

    async def main():
        return await asyncio.gather(*(late(i) for i in range(len(prompts))))

    outs = asyncio.run(main())
    assert [o[0].token_ids for o in outs] == expected
    steps = engine.stats["decode_steps"] - before["decode_steps"]
    tokens = engine.stats["decode_tokens"] - before["decode_tokens"]
    assert tokens > steps  # sequences shared decode steps
    assert steps < sum(lengths)
    assert engine.health()["running"] == 0


def test_async_and_sync_paths_agree(engine):
    sp = SamplingParams(max_tokens=10, seed=5, n=3, ignore_eos=True)
    sync = engine.generate_batch([[1, 2, 3]], sp)[0]
    async_ = asyncio.run(engine.generate([1, 2, 3], sp, "x"))
    assert [o.token_ids for o in sync] == [o.token_ids for o in async_]


@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (3, 1.0), (0, 0.08), (4, 0.1)])
def test_top_k_and_top_p_restrict_the_choices(engine, top_k, top_p):
    sp = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, max_tokens=6, n=8, seed=2,
                        top_logprobs=8, ignore_eos=True)
    checked = 0
    for out in engine.generate_batch([[60, 61, 62]], sp)[0]:
        for tok, top in zip(out.token_ids, out.top_logprobs):
            ranked = sorted(top, key=top.get, reverse=True)[: top_k or None]
            # nucleus: keep tokens while the mass ranked above them is < top_p
            allowed, mass = [], 0.0
            for t in ranked:
                if mass >= top_p:
                    break
                allowed.append(t)
                mass += math.exp(top[t])
            if mass >= top_p or top_k:  # the allowed set is fully inside the reported top 8
                assert tok in allowed
                checked += 1
    assert checked >= 24
