"""True token streaming through a real uvicorn server, read with the official `openai` client:
chunks arrive while the engine is still generating, the concatenated stream equals the
non-streamed answer for the same seed (n > 1, several prompts, stop strings), and a client that
disconnects mid-stream gets its request cancelled in the engine."""

from __future__ import annotations

import asyncio
import logging

import time

import openai
import pytest

from polyrl.rollout.native.engine import NativeEngine
from polyrl.rollout.server import HTTPServer, build_app

MODEL = "tiny"
LONG = 110  # tokens: the tiny model's max_model_len is 128


@pytest.fixture(scope="module")
def engine(tiny_model):
    return NativeEngine(tiny_model, max_model_len=128, max_num_seqs=16)


@pytest.fixture(scope="module")
def client(engine):
    srv = HTTPServer(build_app(engine, MODEL), "127.0.0.1", 0).start_in_thread()
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=60)
    srv.stop()


def _wait_idle(engine, timeout_s: float = 10.0) -> None:
    """Until the engine's serving loop (a task on the server's event loop) has run out of work."""
    task = engine._loop_task
    if task is not None and not task.done():
        asyncio.run_coroutine_threadsafe(asyncio.wait([task]), task.get_loop()).result(timeout_s)
    health = engine.health()
    assert not health["running"] and not health["waiting"], f"engine still busy: {health}"


def test_chunks_arrive_while_the_request_is_generating(client, engine):
    _wait_idle(engine)
    steps_before = engine.stats["decode_steps"]
    in_flight_at_first_text, arrivals, text = None, [], ""
    stream = client.completions.create(model=MODEL, prompt="1+2=", max_tokens=LONG, seed=3,
                                       extra_body={"ignore_eos": True}, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.perf_counter())
            text += chunk.choices[0].text
            if in_flight_at_first_text is None:
                in_flight_at_first_text = (engine.health()["running"],
                                           engine.stats["decode_steps"] - steps_before)
    running, steps = in_flight_at_first_text
    # The first text was read while the engine still ran the request, early in its generation.
    assert running == 1 and steps < LONG - 1
    assert len(arrivals) > 10
    assert arrivals[-1] - arrivals[0] > 0  # spread over the generation, not one burst at the end
    full = client.completions.create(model=MODEL, prompt="1+2=", max_tokens=LONG, seed=3,
                                     extra_body={"ignore_eos": True})
    assert text == full.choices[0].text


def _streamed_texts(chunks, n_choices: int, field: str):
    texts, reasons = [""] * n_choices, [None] * n_choices
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += (c.text if field == "text" else c.delta.content) or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    return texts, reasons


def test_completion_stream_equals_non_streamed_with_n_prompts_and_stop(client):
    base = dict(model=MODEL, prompt=["12+7=", "3*3="], max_tokens=40, n=2, seed=21,
                extra_body={"ignore_eos": True})
    probe = client.completions.create(**base)
    stop = probe.choices[0].text[10:12]  # a stop string that sample 0 is sure to meet
    full = client.completions.create(**base, stop=[stop])
    chunks = list(client.completions.create(**base, stop=[stop], stream=True,
                                            stream_options={"include_usage": True}))
    texts, reasons = _streamed_texts(chunks, 4, "text")
    assert texts == [c.text for c in full.choices]
    assert reasons == [c.finish_reason for c in full.choices]
    assert full.choices[0].finish_reason == "stop" and stop not in full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_stream_equals_non_streamed_with_n_stop_and_logprobs(client):
    base = dict(model=MODEL, messages=[{"role": "user", "content": "5+5="}], max_tokens=40, n=3,
                seed=4, extra_body={"ignore_eos": True})
    probe = client.chat.completions.create(**base)
    stop = probe.choices[1].message.content[5:7]
    full = client.chat.completions.create(**base, stop=[stop], logprobs=True)
    chunks = list(client.chat.completions.create(**base, stop=[stop], logprobs=True, stream=True))
    texts, reasons = _streamed_texts(chunks, 3, "delta")
    assert texts == [c.message.content for c in full.choices]
    assert reasons == [c.finish_reason for c in full.choices]
    assert "stop" in reasons
    for i, choice in enumerate(full.choices):
        streamed = [e.logprob for ch in chunks for c in ch.choices if c.index == i and c.logprobs
                    for e in c.logprobs.content]
        assert streamed == pytest.approx([e.logprob for e in choice.logprobs.content], abs=1e-6)


def test_client_disconnect_cancels_the_request_in_the_engine(client, engine, caplog):
    caplog.set_level(logging.INFO)
    _wait_idle(engine)
    tokens_before = engine.stats["decode_tokens"]
    stream = client.completions.create(model=MODEL, prompt="9+9=", max_tokens=LONG, n=2,
                                       extra_body={"ignore_eos": True}, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            break
    assert engine.health()["running"] == 2
    stream.close()  # the client goes away mid-generation
    _wait_idle(engine)
    # The engine stopped both samples well before their 110 tokens each.
    assert engine.stats["decode_tokens"] - tokens_before < 2 * LONG - 20
    # one line says so; nothing is logged as a warning or an error
    said = [r for r in caplog.records if "disconnected mid-stream" in r.getMessage()]
    assert len(said) == 1 and "2 sample(s)" in said[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert client.completions.create(model=MODEL, prompt="1", max_tokens=2).choices
