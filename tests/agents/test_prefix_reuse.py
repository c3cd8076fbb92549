"""KV-cache prefix reuse across turns in the native engine: a next-turn prompt that extends a
finished sequence prefills only its new tokens, with the same tokens and log-probs as a full
re-prefill."""

from __future__ import annotations

import asyncio

import pytest
import torch

from conftest import native
from polyrl.agents import AgentConfig, run_trajectories_sync
from polyrl.rollout.base import SamplingParams
from test_environments import rows, sampling


def test_reuse_gives_the_same_trajectories_and_prefills_less(tokenizer, random_dir):
    cfg = AgentConfig(max_turns=4, max_response_tokens=200)
    out = {}
    for budget in (0, 4096):
        engine = native(random_dir, tokenizer, prefix_cache_tokens=budget)
        out[budget] = (run_trajectories_sync(engine, tokenizer, rows(tokenizer, ["test_countdown"] * 3),
                                             sampling(tokenizer, n=2), cfg, seeds=[4, 5, 6]), engine.stats)
    (plain, plain_stats), (reuse, reuse_stats) = out[0], out[4096]
    assert reuse.batch.response_ids.tolist() == plain.batch.response_ids.tolist()
    assert torch.allclose(reuse.batch.rollout_logprobs.values, plain.batch.rollout_logprobs.values, atol=1e-4)
    later_turns = sum(t.stats.turns - 1 for t in plain.trajectories)
    assert later_turns > 0 and plain_stats["prefix_reused_tokens"] == 0
    assert reuse_stats["prefix_reused_tokens"] > 0
    # every token is computed once: reused + prefilled with reuse == prefilled without
    assert reuse_stats["prefill_tokens"] + reuse_stats["prefix_reused_tokens"] == plain_stats["prefill_tokens"]


def test_a_weight_update_forgets_stashed_prefixes(tokenizer, random_dir):
    engine = native(random_dir, tokenizer, prefix_cache_tokens=4096)
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    first = engine.generate_batch([[5, 6, 7, 8]], sp)[0][0]
    follow = [5, 6, 7, 8] + first.token_ids + [9, 10]
    before = engine.engine._sched.cache.nbytes
    engine.update_weights({}, version=1)
    assert engine.engine._sched.cache.nbytes < before
    engine.generate_batch([follow], sp)
    assert engine.stats["prefix_reused_tokens"] == 0


@pytest.mark.parametrize("n", [1, 3])
def test_extend_matches_a_full_prefill(tokenizer, random_dir, n):
    reuse = native(random_dir, tokenizer, prefix_cache_tokens=4096)
    plain = native(random_dir, tokenizer)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = reuse.generate_batch([[5, 6, 7, 8, 9]], sp)[0][0]
    follow = [5, 6, 7, 8, 9] + first.token_ids + [11, 12, 13]
    multi = SamplingParams(temperature=1.0, max_tokens=6, n=n, seed=3, ignore_eos=True)
    got = asyncio.run(reuse.generate(follow, multi))
    want = asyncio.run(plain.generate(follow, multi))
    assert reuse.stats["prefix_reused_tokens"] == 5 + 6 - 1  # the last sampled token was never cached
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
