"""polyrl's vLLM adapter against the real vLLM (its CPU build in CI: scripts/vllm_tier.sh),
on the bundled tiny model: generation, weight updates through `collective_rpc`, log-probs
against the trainer's, abort, sleep. Nothing here is a fake of the engine."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from polyrl.builtin import resolve
from polyrl.rollout.base import SamplingParams, WeightUpdateError

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=True, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(vllm_available):
    from polyrl.rollout.config import RolloutConfig
    from polyrl.rollout.factory import build_disaggregated_engine

    cfg = RolloutConfig(backend="vllm", placement="standalone", dtype="float32", max_model_len=64,
                        max_num_seqs=64, enforce_eager=True)
    eng = build_disaggregated_engine(cfg, "builtin:tiny-arith", torch.device("cpu"))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def disk_weights():
    from safetensors.torch import load_file

    return load_file(resolve("builtin:tiny-arith") + "/model.safetensors")


def _tokens(outs):
    return [[o.token_ids for o in group] for group in outs]


def test_generate_sync_and_async_agree_greedy(engine):
    sync = engine.generate_batch(PROMPTS, GREEDY)
    assert all(len(g[0].token_ids) == 12 and g[0].stop_reason == "length" for g in sync)
    assert all(len(g[0].logprobs) == 12 for g in sync)

    async def both():
        return await asyncio.gather(*(engine.generate(p, GREEDY) for p in PROMPTS))

    assert _tokens(asyncio.run(both())) == _tokens(sync)


def test_n_samples_seeds_and_top_logprobs(engine):
    sampling = SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True, top_logprobs=3)
    first = engine.generate_batch([PROMPTS[0]], sampling)[0]
    again = engine.generate_batch([PROMPTS[0]], sampling)[0]
    assert len(first) == 4
    assert [o.token_ids for o in first] == [o.token_ids for o in again]  # same seed: same samples
    top = first[0].top_logprobs
    assert top is not None and len(top) == 10 and all(len(rec) >= 3 for rec in top)
    other = engine.generate_batch([PROMPTS[0]], SamplingParams(n=4, max_tokens=10, temperature=1.0,
                                                                seed=8, ignore_eos=True))[0]
    assert [o.token_ids for o in other] != [o.token_ids for o in first]


def test_stop_strings_end_the_sample(engine):
    free = engine.generate_batch([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0][0]
    assert free.text, "the tiny model produced no text to stop on"
    stop = free.text[len(free.text) // 2:][:1]
    out = engine.generate_batch([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0,
                                                             ignore_eos=True, stop=[stop]))[0][0]
    assert out.stop_reason == "stop" and stop not in out.text
    assert len(out.token_ids) < len(free.token_ids)


def test_update_weights_round_trip_versions_and_failure(engine, disk_weights):
    before = engine.generate_batch(PROMPTS, GREEDY)
    version = engine.weight_version + 1
    engine.update_weights(disk_weights, version)  # the same weights through collective_rpc
    same = engine.generate_batch(PROMPTS, GREEDY)
    assert _tokens(same) == _tokens(before)
    assert all(o.weight_version == version for g in same for o in g)

    torch.manual_seed(0)
    noisy = {k: v + 0.5 * torch.randn_like(v) for k, v in disk_weights.items()}
    engine.update_weights(noisy, version + 1)
    changed = engine.generate_batch(PROMPTS, GREEDY)
    assert _tokens(changed) != _tokens(before)

    engine.update_weights(disk_weights, version + 2)
    bad = {"model.embed_tokens.weight": torch.zeros(3, dtype=torch.int64)}
    with pytest.raises(WeightUpdateError):
        engine.update_weights(bad, version + 3)
    assert engine.weight_version == version + 2
    still = engine.generate_batch(PROMPTS, GREEDY)
    assert _tokens(still) == _tokens(before)
    assert all(o.weight_version == version + 2 for g in still for o in g)


def test_engine_logprobs_match_the_trainer_fp32(engine, disk_weights):
    """The engine's sampled-token log-probs against a plain forward of the same weights."""
    from transformers import AutoModelForCausalLM

    engine.update_weights(disk_weights, engine.weight_version + 1)
    model = AutoModelForCausalLM.from_pretrained(resolve("builtin:tiny-arith"), torch_dtype=torch.float32).eval()
    outs = engine.generate_batch(PROMPTS, SamplingParams(max_tokens=12, temperature=1.0, seed=3,
                                                         logprobs=True, ignore_eos=True))
    worst = 0.0
    for prompt, group in zip(PROMPTS, outs):
        out = group[0]
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
        trainer = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        worst = max(worst, (trainer - torch.tensor(out.logprobs)).abs().max().item())
    print(f"vLLM vs trainer log-prob max abs diff (fp32): {worst:.2e}")
    assert worst < 1e-3


def test_abort_all_with_requests_in_flight(engine):
    long = SamplingParams(n=8, max_tokens=55, temperature=1.0, ignore_eos=True)
    started = threading.Event()
    result = {}

    def run():
        started.set()
        result["outs"] = engine.generate_batch([PROMPTS[0]] * 8, long)

    worker = threading.Thread(target=run)
    worker.start()
    started.wait()
    aborted = 0
    while worker.is_alive() and aborted == 0:  # retry until the requests are registered
        aborted = engine.abort_all()
        worker.join(0.01)
    worker.join()
    reasons = [o.stop_reason for g in result["outs"] for o in g]
    assert aborted == 8 and reasons.count("aborted") >= 1
    assert engine.health()["running"] == 0
    assert engine.generate_batch([PROMPTS[0]], GREEDY)[0][0].stop_reason == "length"


def test_abort_all_reaches_requests_still_entering_the_engine(engine, monkeypatch):
    """vLLM's add_request awaits input processing before it registers a request id, and its
    abort ignores ids it does not know: an abort_all landing in that gap used to leave the
    request running to its end. The adapter's own step into vLLM (`_generate_one`) is held until
    abort_all's first abort has reached vLLM, so every request registers after that abort."""
    long = SamplingParams(n=2, max_tokens=55, temperature=1.0, ignore_eos=True)
    prompts = [PROMPTS[0]] * 4
    first_abort_sent = asyncio.Event()  # set and awaited on the engine's loop only
    all_tracked = threading.Event()
    entered = []
    real_abort, real_generate_one = engine.engine.abort, engine._generate_one

    async def abort_then_release(request_ids, *args, **kwargs):
        await real_abort(request_ids, *args, **kwargs)  # the real abort, observed
        first_abort_sent.set()

    async def enter_after_first_abort(prompt, sampling, request_id):
        entered.append(request_id)
        if len(entered) == len(prompts):
            all_tracked.set()
        await first_abort_sent.wait()
        return await real_generate_one(prompt, sampling, request_id)

    monkeypatch.setattr(engine.engine, "abort", abort_then_release)
    monkeypatch.setattr(engine, "_generate_one", enter_after_first_abort)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("outs", engine.generate_batch(prompts, long)))
    worker.start()
    assert all_tracked.wait(timeout=120), "the requests never reached the adapter's engine step"
    aborted = engine.abort_all()
    running_after = engine.health()["running"]
    worker.join()
    outs = [o for g in result["outs"] for o in g]
    assert aborted == len(prompts) and len(outs) == 2 * len(prompts)
    assert [o.stop_reason for o in outs] == ["aborted"] * len(outs)
    assert all(len(o.token_ids) < long.max_tokens for o in outs)
    assert running_after == 0  # abort_all returns once every request it aborted has ended


def test_sleep_on_the_cpu_build_stops_generation_until_wake(engine):
    if engine.sleep_frees_memory:
        pytest.skip("this vLLM build has a real sleep mode (a GPU build)")
    with pytest.raises(RuntimeError, match="enable_sleep_mode"):  # standalone: not asked for
        engine.sleep()
    engine.launch_args["enable_sleep_mode"] = True  # what a hybrid launch asks for
    try:
        engine.sleep()
        with pytest.raises(RuntimeError, match="sleeping"):
            engine.generate_batch([PROMPTS[0]], GREEDY)
        engine.wake_up()
        assert engine.generate_batch([PROMPTS[0]], GREEDY)[0][0].token_ids
    finally:
        engine.launch_args.pop("enable_sleep_mode")
