"""A partial rollout of a mixture-of-experts policy keeps the routes of every segment
(polyrl/workers/partial_rollout.py `merge`, polyrl/batch/routes.py `joined`): a real native
engine aborted mid-generation by a weight update and resumed records, over the whole response,
the routes an uninterrupted run records (docs/moe.md, "Rollout routing replay")."""

from __future__ import annotations

import pytest
import torch

from moe_models import build_moe_model
from polyrl.batch.routes import cut, joined, not_routed
from polyrl.rollout.base import SamplingParams
from polyrl.rollout.native.engine import NativeEngine
from polyrl.workers.generation import to_batch
from polyrl.workers.partial_rollout import WeightGate, generate_resumable
from weight_gate_hooks import publish_mid_turn

PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]
TOKENS = 40  # far more decode steps than the 6 before the update: it lands mid-request


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return build_moe_model(tmp_path_factory.mktemp("moe"), "qwen3_moe")


@pytest.fixture(scope="module")
def engine(moe_path):
    torch.set_num_threads(1)
    return NativeEngine(moe_path, max_model_len=128)


def test_a_resumed_sample_carries_the_routes_of_every_segment(engine):
    # greedy, so the resumed sample draws the tokens the uninterrupted one does
    greedy = [SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
    whole = engine.generate_batch(PROMPTS, greedy)
    gate = WeightGate(engine, "abort")
    step = engine._step
    try:  # the same weights under a new version: the abort and resume are all that differ
        publisher, applied, _ = publish_mid_turn(engine, gate, {}, engine.stats["decode_steps"] + 6,
                                                 version=engine.weight_version + 1)
        resumed = generate_resumable(engine, gate, PROMPTS, greedy)
        publisher.join(timeout=60)
        assert applied.is_set() and gate.aborted_requests >= 1
    finally:
        engine._step = step
    mark = not_routed(torch.uint8)
    for (w,), (r,) in zip(whole, resumed):
        assert r.extra["continuations"] >= 1 and r.token_ids == w.token_ids
        routes = r.extra["routed_experts"]
        assert routes.shape == (TOKENS, 2, 2) and routes.dtype == torch.uint8
        # every fed token routed (the boundary one by the continuation's prefill), the last not
        assert bool((routes[:-1] < 6).all()) and bool((routes[-1] == mark).all())
        assert torch.equal(routes, w.extra["routed_experts"])
    # the batch's column covers every response token of the resumed samples
    batch = to_batch(engine.tokenizer, engine.eos_token_ids, PROMPTS, resumed, [0, 1])
    assert torch.equal(batch.routes.offsets, batch.response_ids.offsets)
    assert torch.equal(batch.routes.values, torch.cat([w.extra["routed_experts"] for (w,) in whole]))


def test_joined_and_cut():
    mark = not_routed(torch.uint8)
    first = torch.tensor([[[0, 1]], [[mark, mark]]], dtype=torch.uint8)  # 2 tokens, the last never fed
    rest = torch.tensor([[[2, 3]], [[mark, mark]]], dtype=torch.uint8)
    both = joined(first, torch.tensor([[4, 5]]), rest)
    assert both.tolist() == [[[0, 1]], [[4, 5]], [[2, 3]], [[mark, mark]]]
    assert joined(first, None, rest)[1].tolist() == [[mark, mark]]  # no boundary routes: the trainer routes it
    assert cut(both, 2).tolist() == [[[0, 1]], [[mark, mark]]]
    assert first[1].tolist() == [[mark, mark]]  # inputs untouched


def test_a_prompt_extending_a_cached_one_gets_the_routes_a_full_prefill_gives(engine, moe_path):
    """The continuation's boundary routes come from its prefill, or from extend.py where its
    prompt extends a cached sequence: both give the prompt's last token the same experts."""
    cached = NativeEngine(moe_path, max_model_len=128, prefix_cache_tokens=4096)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = cached.generate_batch([PROMPTS[1]], greedy)[0][0]
    follow = PROMPTS[1] + first.token_ids + [12, 13]
    extended = cached.generate_batch([follow], greedy)[0][0]
    assert cached.stats["prefix_reused_tokens"] > 0
    full = engine.generate_batch([follow], greedy)[0][0]
    routes = extended.extra["prompt_routed_experts"]
    assert routes.shape == (2, 2) and bool((routes < 6).all())
    assert torch.equal(routes, full.extra["prompt_routed_experts"])
