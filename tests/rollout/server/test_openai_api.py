"""The OpenAI-compatible API, served by a real uvicorn on 127.0.0.1 and spoken to by the official
`openai` client: completions, chat, streaming, n > 1, seeds, log-probs, and 400s naming the field."""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import openai
import pytest

from polyrl.rollout.native.engine import NativeEngine
from polyrl.rollout.server import HTTPServer, Router, build_app

MODEL = "tiny"


@pytest.fixture(scope="module")
def engine(tiny_model):
    return NativeEngine(tiny_model, max_model_len=64, max_num_seqs=16)


@pytest.fixture(scope="module")
def server(engine):
    srv = HTTPServer(build_app(engine, MODEL), "127.0.0.1", 0).start_in_thread()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


def test_completion_text_prompt_with_usage_and_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="1+2=", max_tokens=6, logprobs=2,
                                  temperature=0.7, extra_body={"top_k": 20})
    (choice,) = r.choices
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == 4
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == r.usage.completion_tokens
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert "".join(lp.tokens).startswith(choice.text) or choice.text == ""


def test_completion_token_ids_n_and_seed_determinism(client):
    kwargs = dict(model=MODEL, prompt=[3, 74, 4, 82], max_tokens=8, n=3, seed=11, temperature=1.0,
                  extra_body={"ignore_eos": True})
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert all(c.finish_reason == "length" for c in a.choices)
    assert a.usage.completion_tokens == 24
    assert len({c.text for c in a.choices}) > 1  # the n samples differ from each other


def test_chat_completion_uses_chat_template(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5, logprobs=True, top_logprobs=1)
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert r.usage.prompt_tokens == 2  # the test template renders just the contents: "hi"
    assert len(choice.logprobs.content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 1 for t in choice.logprobs.content)


def test_streaming_completion_and_chat_match_non_streaming(client):
    kwargs = dict(model=MODEL, max_tokens=6, seed=5)
    full = client.completions.create(prompt="ab", **kwargs)
    chunks = list(client.completions.create(prompt="ab", stream=True,
                                            stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens

    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(messages=messages, **kwargs)
    stream = list(client.chat.completions.create(messages=messages, stream=True, **kwargs))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == chat.choices[0].finish_reason


def test_models_list_and_health(client, server):
    (card,) = client.models.list().data
    assert card.id == MODEL
    health = httpx.get(f"{server.url}/health", timeout=10).json()
    assert health["ok"] and health["running"] == 0


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"model": "no-such-model"}, "model"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x" * 80}, "prompt"),  # longer than max_model_len=64
    ({"extra_body": {"top_k": "many"}}, "top_k"),  # a pydantic type error
    ({"extra_body": {"temprature": 0.5}}, "temprature"),  # a misspelt field is not ignored
    ({"best_of": 3}, "best_of"),
    ({"logit_bias": {"five": 10}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"logprobs": 6}, "logprobs"),  # OpenAI's cap is 5
])
def test_bad_completion_input_is_400_naming_the_field(client, kwargs, field):
    args = {"model": MODEL, "prompt": "1+1=", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**args)
    assert info.value.status_code == 400
    assert info.value.body["param"] == field
    assert info.value.body["type"] == "invalid_request_error"
    assert field in str(info.value)
    # ...and the server keeps serving
    assert client.completions.create(model=MODEL, prompt="1+1=", max_tokens=2).choices


def test_no_op_values_of_unsupported_fields_are_accepted(client):
    out = client.completions.create(model=MODEL, prompt="1+1=", max_tokens=2, best_of=1,
                                    frequency_penalty=0, presence_penalty=0.0, logit_bias={}, logprobs=5)
    assert 1 <= len(out.choices[0].logprobs.top_logprobs[0]) <= 5  # keyed by text: ties merge


def test_logit_bias_reaches_the_engine(client):
    def forced(token: int) -> list[str]:
        out = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, temperature=0,
                                        logprobs=0, logit_bias={str(token): 100})
        return out.choices[0].logprobs.tokens

    nine, ten = forced(9), forced(10)
    assert len(set(nine)) == 1 and len(set(ten)) == 1 and nine != ten


def test_chat_top_logprobs_capped_at_20_and_unknown_fields_refused(client):
    messages = [{"role": "user", "content": "1+1="}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, logprobs=True,
                                       top_logprobs=21)
    assert info.value.body["param"] == "top_logprobs"
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, logprobs=True,
                                         top_logprobs=20)
    assert len(out.choices[0].logprobs.content[0].top_logprobs) == 20
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       extra_body={"max_token": 3})
    assert info.value.body["param"] == "max_token" and "unknown field 'max_token'" in str(info.value)
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])


def test_malformed_json_names_the_position_not_a_field(server):
    out = httpx.post(f"{server.url}/v1/completions", content=b'{"model": "tiny", "prompt": ',
                     headers={"content-type": "application/json"}, timeout=30)
    assert out.status_code == 400
    error = out.json()["error"]
    assert error["param"] is None
    assert error["message"] == "the request body is not valid JSON: Expecting value at position 28"


def test_bad_chat_input_is_400(client):
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[{"content": "no role"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       temperature=-0.5, stream=True)


def test_aborted_request_finishes_with_abort(client, engine):
    """A request queued while the engine sleeps, then aborted (as before a weight sync)."""
    engine.sleep()
    result: list = []
    queued, submit = threading.Event(), engine._submit

    def submit_and_tell(*args, **kwargs):  # the request is in the scheduler's queue
        submit(*args, **kwargs)
        queued.set()

    engine._submit = submit_and_tell
    try:
        worker = threading.Thread(target=lambda: result.append(
            client.completions.create(model=MODEL, prompt="1+1=", max_tokens=8)))
        worker.start()
        assert queued.wait(30)
        assert engine.abort_all() == 1
        worker.join(30)
    finally:
        engine._submit = submit
        engine.wake_up()
    (choice,) = result[0].choices
    assert choice.finish_reason == "abort" and choice.text == ""
    assert client.completions.create(model=MODEL, prompt="1+1=", max_tokens=2).choices


def _refused_url() -> str:
    """A URL nothing listens on: bind a port, then close it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_router_over_http_replicas_fails_over_a_refused_one(server):
    async def main():
        router = Router([_refused_url(), server.url], timeout_s=60)
        outs = await asyncio.gather(*[router.generate([3, 4, 5], {"max_tokens": 3, "top_logprobs": 1})
                                      for _ in range(4)])
        return router.metrics(), outs

    metrics, outs = asyncio.run(main())
    assert all(len(o) == 1 and len(o[0].token_ids) >= 1 for o in outs)
    assert all(isinstance(k, int) for k in outs[0][0].top_logprobs[0])
    assert metrics["retries"] >= 1 and metrics["requests"] == 4
    assert len(metrics["unhealthy"]) == 1 and metrics["unhealthy"][0] != server.url
