"""Weight updates, sleep / wake-up, abort, health and bad input."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from polyrl.rollout.base import RolloutInputError, SamplingParams, WeightUpdateError
from polyrl.rollout.native.engine import NativeEngine

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = [12, 34, 56]


def snapshot(engine) -> dict[str, torch.Tensor]:
    return {n: v.clone() for n, (v, _) in engine._weights.targets.items()}


def test_update_weights_is_all_or_nothing(engine):
    before_tokens = engine.generate_batch([PROMPT], GREEDY)[0][0].token_ids
    before = snapshot(engine)
    q = "model.layers.0.self_attn.q_proj.weight"
    k = "model.layers.1.self_attn.k_proj.weight"
    good = {q: torch.randn_like(before[q]), k: torch.randn_like(before[k])}

    with pytest.raises(WeightUpdateError, match="model.layers.9.mlp.up_proj.weight"):
        engine.update_weights({**good, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)}, version=1)
    with pytest.raises(WeightUpdateError, match="shape"):
        engine.update_weights({**good, "model.norm.weight": torch.zeros(3)}, version=1)
    after = snapshot(engine)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert engine.weight_version == 0

    engine.update_weights(good, version=7)
    assert engine.weight_version == 7
    assert torch.equal(engine._weights.targets[q][0], good[q])
    out = engine.generate_batch([PROMPT], GREEDY)[0][0]
    assert out.weight_version == 7 and out.token_ids != before_tokens


def test_full_update_from_another_checkpoint_matches_it(model_dirs, tmp_path):
    from native_models import build_model_dir

    other_dir = build_model_dir("qwen3", tmp_path / "other", seed=1)
    engine = NativeEngine(model_dirs["qwen3"], max_model_len=64)
    other = NativeEngine(other_dir, max_model_len=64)
    from safetensors.torch import load_file

    state = load_file(str(Path(other_dir) / "model.safetensors"))
    engine.update_weights(state.items(), version=2)  # (name, tensor) pairs work too
    assert engine.generate_batch([PROMPT], GREEDY)[0][0].token_ids == other.generate_batch([PROMPT], GREEDY)[0][0].token_ids


def test_version_change_mid_request_is_reported(engine):
    async def main():
        task = asyncio.create_task(engine.generate(PROMPT, SamplingParams(max_tokens=60, ignore_eos=True), "r"))
        while engine.stats["decode_steps"] < 3:
            await asyncio.sleep(0.001)
        name = "model.norm.weight"
        engine.update_weights({name: engine._weights.targets[name][0].clone()}, version=4)
        return await task

    out = asyncio.run(main())[0]
    assert out.weight_version == 4
    assert out.extra == {"min_weight_version": 0, "max_weight_version": 4}


def test_abort_all_returns_partial_outputs(engine):
    async def main():
        tasks = [asyncio.create_task(engine.generate(PROMPT, SamplingParams(max_tokens=100, n=2, ignore_eos=True), f"r{i}"))
                 for i in range(2)]
        while engine.stats["decode_steps"] < 5:
            await asyncio.sleep(0.001)
        aborted = engine.abort_all()
        return aborted, await asyncio.gather(*tasks)

    aborted, outs = asyncio.run(main())
    assert aborted == 2
    for samples in outs:
        assert len(samples) == 2
        for o in samples:
            assert o.stop_reason == "aborted" and 0 < len(o.token_ids) < 100
            assert len(o.logprobs) == len(o.token_ids)
    assert engine.health()["running"] == 0
    # the engine keeps serving afterwards
    assert engine.generate_batch([PROMPT], GREEDY)[0][0].stop_reason == "length"


def test_abort_from_another_thread_is_not_starved_by_a_stepping_thread(engine):
    """A trainer-side thread loops generate_batch steps; an abort from another thread (an async
    replica's weight update) must land mid-generation, not after it (a plain Lock is unfair)."""
    import threading

    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("r", engine.generate_batch(
        [PROMPT], SamplingParams(max_tokens=120, n=2, ignore_eos=True))))
    start = engine.stats["decode_steps"]
    worker.start()
    while engine.stats["decode_steps"] - start < 3 and worker.is_alive():
        pass
    aborted = engine.abort_all()
    worker.join(timeout=60)
    assert aborted == 1
    for o in out["r"][0]:
        assert o.stop_reason == "aborted" and 0 < len(o.token_ids) < 120


def test_sleep_frees_the_cache_and_wake_up_restores_it(engine):
    ref = engine.generate_batch([PROMPT], GREEDY)[0][0].token_ids
    assert engine.health()["kv_cache_bytes"] > 0
    engine.sleep()
    health = engine.health()
    assert health["sleeping"] and health["kv_cache_bytes"] == 0
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.generate_batch([PROMPT], GREEDY)

    async def queued_while_sleeping():
        task = asyncio.create_task(engine.generate(PROMPT, GREEDY, "s"))
        for _ in range(100_000):  # yield until the request reached the engine's queue
            if engine.health()["waiting"]:
                break
            await asyncio.sleep(0)
        assert not task.done() and engine.health()["waiting"] == 1
        engine.wake_up()
        assert engine.health()["kv_cache_bytes"] > 0
        return await task

    assert asyncio.run(queued_while_sleeping())[0].token_ids == ref


def test_health_reports_state(engine):
    from polyrl.rollout.base import ROLLOUT_ENGINES, RolloutEngine

    assert isinstance(engine, RolloutEngine)
    assert ROLLOUT_ENGINES.get("native") is NativeEngine
    h = engine.health()
    assert h["ok"] and h["weight_version"] == 0 and h["running"] == 0 and h["waiting"] == 0
    assert h["sleeping"] is False


@pytest.mark.parametrize(
    "prompt,sampling,field",
    [
        ([], SamplingParams(), "prompt_ids"),
        ([1] * 128, SamplingParams(), "prompt_ids"),
        ([1, 128], SamplingParams(), "prompt_ids"),
        ([1, -1], SamplingParams(), "prompt_ids"),
        (["a"], SamplingParams(), "prompt_ids"),
        ([1], SamplingParams(temperature=-1), "temperature"),
        ([1], SamplingParams(top_p=0), "top_p"),
        ([1], SamplingParams(n=0), "n"),
        ([1], SamplingParams(n=33), "n"),
        ([1], SamplingParams(max_tokens=0), "max_tokens"),
    ],
)
def test_bad_input_names_the_field_and_engine_keeps_serving(engine, prompt, sampling, field):
    with pytest.raises(RolloutInputError) as err:
        engine.generate_batch([prompt], sampling)
    assert err.value.field == field
    with pytest.raises(RolloutInputError):
        asyncio.run(engine.generate(prompt, sampling, "bad"))
    assert engine.health()["waiting"] == 0
    assert len(engine.generate_batch([PROMPT], GREEDY)[0][0].token_ids) == 8


def test_stop_strings_need_a_tokenizer(qwen3_dir):
    engine = NativeEngine(qwen3_dir, max_model_len=32, tokenizer=False)
    with pytest.raises(RolloutInputError) as err:
        engine.generate_batch([PROMPT], SamplingParams(stop=["x"]))
    assert err.value.field == "stop"
    assert engine.generate_batch([PROMPT], GREEDY)[0][0].text is None


def test_unsupported_architecture_names_the_supported_ones(qwen3_dir, tmp_path):
    cfg = json.loads((Path(qwen3_dir) / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*Qwen3ForCausalLM"):
        NativeEngine(str(tmp_path))


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        NativeEngine(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        NativeEngine(str(tmp_path))


def test_logit_bias_outside_the_vocabulary_is_refused(tmp_path):
    """An out-of-vocabulary logit_bias id is a RolloutInputError naming the field (it was an
    IndexError inside sampling on every path but the HTTP server's)."""
    from polyrl.builtin import resolve
    from polyrl.rollout.base import RolloutInputError, SamplingParams
    from polyrl.rollout.native.engine import NativeEngine

    engine = NativeEngine(resolve("builtin:tiny-arith"), max_model_len=32, tokenizer=False)
    with pytest.raises(RolloutInputError, match="logit_bias"):
        engine.generate_batch([[5, 6]], SamplingParams(max_tokens=2, logit_bias={10**6: 1.0}))
