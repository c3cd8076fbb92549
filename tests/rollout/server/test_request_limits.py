"""Limits of one request, over a real uvicorn and the official `openai` client: logit_bias ids
outside the vocabulary and requests asking for more sequences (prompts x n) than the server's
cap are 400s naming the field, and the server keeps serving; `polyrl serve` refuses out-of-range
numbers in one line with exit code 2."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from polyrl.cli.main import main
from polyrl.rollout.native.engine import NativeEngine
from polyrl.rollout.server import HTTPServer, build_app
from polyrl.rollout.server.openai_service import MAX_SEQUENCES_PER_REQUEST

MODEL = "tiny"
CAP = 8


@pytest.fixture(scope="module")
def engine(tiny_model):
    return NativeEngine(tiny_model, max_model_len=64, max_num_seqs=16)


def _client(app) -> tuple[HTTPServer, openai.OpenAI]:
    srv = HTTPServer(app, "127.0.0.1", 0).start_in_thread()
    return srv, openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(engine):
    srv, client = _client(build_app(engine, MODEL, max_sequences_per_request=CAP))
    yield client
    srv.stop()


def _param_of_400(call) -> tuple[str, str]:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.status_code == 400
    return info.value.body["param"], info.value.body["message"]


def test_logit_bias_outside_the_vocabulary_is_400(client, engine):
    vocab = engine.spec.vocab_size
    messages = [{"role": "user", "content": "1+1="}]
    calls = [
        lambda: client.completions.create(model=MODEL, prompt="1+1=", max_tokens=2, logit_bias={str(vocab): 5}),
        lambda: client.completions.create(model=MODEL, prompt="1+1=", max_tokens=2,
                                          logit_bias={"10": 1, str(10 * vocab): -5}, stream=True),
        lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                               logit_bias={str(vocab + 7): 5}),
    ]
    for call in calls:
        param, message = _param_of_400(call)
        assert param == "logit_bias" and f"outside the vocabulary [0, {vocab})" in message
    # the last id of the vocabulary is fine, and the server kept serving
    out = client.completions.create(model=MODEL, prompt="1+1=", max_tokens=2, logit_bias={str(vocab - 1): 5})
    assert out.choices[0].finish_reason in ("stop", "length")


def test_more_sequences_than_the_cap_is_400_naming_what_to_shrink(client):
    ok = client.completions.create(model=MODEL, prompt=[[3, 4]] * 4, n=2, max_tokens=1)
    assert len(ok.choices) == CAP
    param, message = _param_of_400(lambda: client.completions.create(
        model=MODEL, prompt=[[3, 4]] * 3, n=3, max_tokens=1))
    assert param == "n" and "3 prompt(s) x n=3 = 9 sequences" in message
    assert f"at most {CAP} per request (polyrl serve --max-sequences-per-request)" in message
    param, _ = _param_of_400(lambda: client.completions.create(model=MODEL, prompt=[[3]] * (CAP + 1),
                                                               max_tokens=1, stream=True))
    assert param == "prompt"
    param, _ = _param_of_400(lambda: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], n=CAP + 1, max_tokens=1))
    assert param == "n"
    assert len(client.completions.create(model=MODEL, prompt="1+1=", max_tokens=1).choices) == 1


def test_the_default_cap_refuses_a_request_that_would_hold_the_engine(engine):
    srv, client = _client(build_app(engine, MODEL))
    try:
        prompts = -(-(MAX_SEQUENCES_PER_REQUEST + 1) // 16)  # n=16 is the engine's max_num_seqs
        param, message = _param_of_400(lambda: client.completions.create(
            model=MODEL, prompt=[[3, 4]] * prompts, n=16, max_tokens=4))
        assert param == "n" and f"at most {MAX_SEQUENCES_PER_REQUEST} per request" in message
    finally:
        srv.stop()


@pytest.mark.parametrize("args, message", [
    (["--port", "99999"], "--port 99999: a port is 0-65535"),
    (["--port", "-1"], "--port -1: a port is 0-65535"),
    (["--max-model-len", "0"], "--max-model-len 0: must be >= 2"),
    (["--max-sequences-per-request", "0"], "--max-sequences-per-request 0: must be >= 1"),
    (["--max-num-seqs", "0"], "--max-num-seqs 0: must be >= 1"),
])
def test_serve_refuses_out_of_range_numbers_in_one_line(args, message):
    # a subprocess with a deadline: were a number accepted, the server would serve forever
    done = subprocess.run([sys.executable, "-m", "polyrl", "serve", *args], capture_output=True,
                          text=True, timeout=120)
    err = done.stderr.strip()
    assert done.returncode == 2 and message in err and len(err.splitlines()) == 1, err


def test_serve_help_states_the_default_cap(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert f"default {MAX_SEQUENCES_PER_REQUEST}" in " ".join(capsys.readouterr().out.split())
