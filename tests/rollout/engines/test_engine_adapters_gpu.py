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
from polyrl.rollout.factory import EXTRAS, build_standalone_engine

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
    eng = build_standalone_engine(cfg, tiny_model, platform.torch_device(0), seed=0)
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
