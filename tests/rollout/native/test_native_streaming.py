"""`NativeEngine.generate_stream`: tokens arrive step by step while the request runs, the
concatenated stream equals `generate`'s output for the same seed, and leaving early cancels."""

from __future__ import annotations

import asyncio

import pytest

from polyrl.rollout.base import RolloutInputError, SamplingParams

PROMPT = [5, 17, 33, 60, 2]


async def _collect(engine, sampling, prompt=PROMPT):
    """(per-sample concatenated deltas, final outputs, number of updates, max running seen)."""
    tokens: dict[int, list[int]] = {}
    logprobs: dict[int, list[float]] = {}
    finished: dict[int, object] = {}
    updates, running_seen, outputs = 0, 0, None
    async with engine.generate_stream(prompt, sampling) as stream:
        async for update in stream:
            updates += 1
            running_seen = max(running_seen, engine.health()["running"])
            for d in update.deltas:
                tokens.setdefault(d.index, []).extend(d.token_ids)
                logprobs.setdefault(d.index, []).extend(d.logprobs)
                if d.finished is not None:
                    finished[d.index] = d.finished
            outputs = update.outputs if update.outputs is not None else outputs
    return tokens, logprobs, finished, outputs, updates, running_seen


def test_stream_concatenates_to_generate_output_with_n_and_seed(engine):
    sampling = SamplingParams(n=3, max_tokens=24, seed=7, ignore_eos=True, top_logprobs=2)

    async def main():
        streamed = await _collect(engine, sampling)
        reference = await engine.generate(PROMPT, sampling)
        return streamed, reference

    (tokens, logprobs, finished, outputs, updates, running_seen), reference = asyncio.run(main())
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    for i, ref in enumerate(reference):
        assert tokens[i] == ref.token_ids and len(ref.token_ids) == 24
        assert logprobs[i] == pytest.approx(ref.logprobs, abs=0)
        assert finished[i].token_ids == ref.token_ids and finished[i].stop_reason == "length"
    # Tokens came in several pieces, and while the request was still running in the engine.
    assert updates > 3
    assert running_seen >= 3


def test_stream_with_stop_string_cuts_text_like_generate(engine):
    # Greedy with a stop string built from the greedy output itself, so it is sure to be hit.
    probe = engine.generate_batch([PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0][0]
    stop = probe.text[6:8]
    assert stop and probe.text.find(stop) >= 0
    sampling = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])

    async def main():
        return await _collect(engine, sampling), await engine.generate(PROMPT, sampling)

    (tokens, _, finished, outputs, _, _), (ref,) = asyncio.run(main())
    assert ref.stop_reason == "stop" and stop not in ref.text
    assert outputs[0].text == ref.text == finished[0].text
    assert tokens[0] == ref.token_ids


def test_closing_a_stream_early_cancels_the_request(engine):
    sampling = SamplingParams(n=2, max_tokens=100, ignore_eos=True)

    async def main():
        stream = engine.generate_stream(PROMPT, sampling)
        first = await stream.__anext__()
        assert engine.health()["running"] == 2
        await stream.aclose()
        # The engine dropped both samples; other requests are still served.
        assert engine.health()["running"] == 0 and engine.health()["waiting"] == 0
        (out,) = await engine.generate(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
        return first, out

    first, out = asyncio.run(main())
    assert sum(len(d.token_ids) for d in first.deltas) < 200
    assert len(out.token_ids) == 3


def test_abort_all_ends_a_stream_with_partial_outputs(engine):
    async def main():
        stream = engine.generate_stream(PROMPT, SamplingParams(max_tokens=100, ignore_eos=True))
        await stream.__anext__()
        assert engine.abort_all() == 1
        return [u async for u in stream]

    updates = asyncio.run(main())
    (out,) = updates[-1].outputs
    assert out.stop_reason == "aborted" and 0 < len(out.token_ids) < 100


def test_bad_input_raises_before_streaming(engine):
    async def main():
        with pytest.raises(RolloutInputError) as info:
            engine.generate_stream([], SamplingParams())
        assert info.value.field == "prompt_ids"
        with pytest.raises(RolloutInputError, match="top_p"):
            engine.generate_stream(PROMPT, SamplingParams(top_p=0))
        assert engine.health()["waiting"] == 0

    asyncio.run(main())
