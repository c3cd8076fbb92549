"""Partial rollouts inside one replica: a real native engine generating in one thread while a
weight update arrives from another, through the WeightGate (no mocks)."""

from __future__ import annotations

import pytest
import torch

from polyrl.rollout.base import ROLLOUT_ENGINES, SamplingParams
from polyrl.workers.partial_rollout import (
    WeightGate,
    continuation_seed,
    generate_resumable,
)
from weight_gate_hooks import publish_mid_turn

MAX_TOKENS = 120  # far more decode steps than the 5 before the update: the update lands mid-request


@pytest.fixture(scope="module")
def engine(tiny_model):
    torch.set_num_threads(1)
    return ROLLOUT_ENGINES.get("native")(tiny_model, max_model_len=128)


@pytest.fixture(scope="module")
def weights(tiny_model):
    """The model's weights in HF names, with the (tied) embedding scaled: a different policy."""
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    state = {k: v.clone() for k, v in state.items() if k != "lm_head.weight"}
    state["model.embed_tokens.weight"] *= 1.5
    return state


def params(n=2, seed=7):
    return [SamplingParams(n=n, max_tokens=MAX_TOKENS, seed=seed, ignore_eos=True),
            SamplingParams(n=n, max_tokens=MAX_TOKENS, seed=seed + 1, ignore_eos=True)]


def run_with_update(engine, gate, weights, version, after_steps=5):
    """Generate two prompts; `weights` arrive through the gate once `after_steps` decode steps ran
    (the engine's step waits for the update to pause the gate: tests/weight_gate_hooks.py)."""
    step = engine._step
    try:
        publisher, applied, _ = publish_mid_turn(engine, gate, weights, engine.stats["decode_steps"] + after_steps,
                                                 version=version)
        out = generate_resumable(engine, gate, [[5, 6, 7], [8, 9]], params())
        publisher.join(timeout=60)
        assert applied.is_set()
    finally:
        engine._step = step
    return out


def test_abort_continues_from_the_tokens_so_far(engine, weights):
    v0 = engine.weight_version
    gate = WeightGate(engine, "abort")
    outs = run_with_update(engine, gate, weights, v0 + 1)
    assert gate.aborted_requests >= 1
    for per_prompt in outs:
        assert len(per_prompt) == 2
        for o in per_prompt:
            assert o.stop_reason == "length" and len(o.token_ids) == MAX_TOKENS
            assert len(o.logprobs) == MAX_TOKENS
            assert o.extra["continuations"] >= 1
            # its first tokens came from the old policy, the rest from the new one
            assert (o.extra["min_weight_version"], o.extra["max_weight_version"]) == (v0, v0 + 1)
    assert engine.weight_version == v0 + 1


def test_wait_finishes_on_the_old_weights_first(engine, weights):
    v = engine.weight_version
    gate = WeightGate(engine, "wait")
    outs = run_with_update(engine, gate, weights, v + 1)
    assert gate.aborted_requests == 0
    for per_prompt in outs:
        for o in per_prompt:
            assert len(o.token_ids) == MAX_TOKENS and "continuations" not in o.extra
            assert (o.extra["min_weight_version"], o.extra["max_weight_version"]) == (v, v)
    assert engine.weight_version == v + 1


def test_without_updates_seeds_reproduce_and_continuation_seeds_are_stable(engine):
    gate = WeightGate(engine, "abort")
    a = generate_resumable(engine, gate, [[5, 6, 7]], params()[:1])
    b = generate_resumable(engine, gate, [[5, 6, 7]], params()[:1])
    assert [o.token_ids for o in a[0]] == [o.token_ids for o in b[0]]
    assert continuation_seed(7, 1, 10) == continuation_seed(7, 1, 10) != continuation_seed(7, 1, 11)
    assert continuation_seed(None, 0, 3) is None


def test_bad_policy_names_the_field(engine):
    with pytest.raises(ValueError, match="async.partial_rollout"):
        WeightGate(engine, "drop")
