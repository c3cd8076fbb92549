"""The SGLang adapter's request, weight-update and abort logic against SGLang's own rules (issue 39).

SGLang needs a GPU and is not installed here, so the adapter runs on its real event loop and
request bookkeeping with `TokenizerManagerRules` in place of SGLang's tokenizer manager. That
class encodes what SGLang 0.5.6 to 0.5.23 do, read from their sources
(sglang/srt/managers/tokenizer_manager.py, scheduler.py): an rid is known only once its request
has been tokenized (`rid_to_state`), `abort_request(rid)` of an unknown rid is dropped, and
`abort_all=True` reaches only the requests the scheduler already holds. The scheduler's abort
rule for `logprob_start_len` is read from the releases themselves in
tests/rollout/engines/test_contract_sglang.py.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
import torch

from polyrl.rollout.base import SamplingParams
from polyrl.rollout.engines.sglang import (
    DETERMINISTIC_KEY,
    SGLangEngine,
    push_weight_pieces,
    sglang_request,
    weight_pieces,
)


# --- logprob_start_len ------------------------------------------------------------------------------

@pytest.mark.parametrize("release, aborts", [
    ("0.5.6", lambda start, n: start >= n),   # scheduler.py of 0.5.6
    ("0.5.7", lambda start, n: start > n),    # 0.5.7 to 0.5.23
])
def test_no_release_aborts_the_request_for_its_logprob_start(release, aborts):
    for prompt in ([5], [1, 2, 3], list(range(40))):
        request = sglang_request(prompt, SamplingParams(n=2, logprobs=True), "r")
        assert all(not aborts(request["logprob_start_len"], len(ids)) for ids in request["input_ids"]), release
        # the engine's own default for a generation: only the output's log-probs are computed
        assert request["logprob_start_len"] == len(prompt) - 1


# --- weight updates: one piece of gathered tensors alive at a time ---------------------------------------

class RecordingTokenizerManager:
    """Takes pieces as SGLang < 0.5.21 does (no session); records how many tensors the source
    had produced when each piece arrived, and on which thread the source was read."""

    def __init__(self, produced: list[str]):
        self.produced = produced
        self.seen_at: list[int] = []
        self.flushed = False

    async def update_weights_from_tensor(self, obj, request):
        self.seen_at.append(len(self.produced))
        return True, ""

    async def flush_cache(self):
        self.flushed = True


def test_an_update_holds_one_piece_of_the_stream_at_a_time():
    produced: list[str] = []
    threads: set[str] = set()

    def gathered():  # a hybrid stream: each tensor gathered (collectives) when read
        for i in range(6):
            threads.add(threading.current_thread().name)
            produced.append(f"w{i}")
            yield f"w{i}", torch.zeros(256)  # 1 KiB each

    class Req:
        def __init__(self, **fields):
            self.__dict__.update(fields)

    io = type("IO", (), {"UpdateWeightsFromTensorReqInput": Req, "serialize": staticmethod(repr)})
    tm = RecordingTokenizerManager(produced)
    loop_runs = []

    def run(coro):  # the adapter's _control: the coroutine runs on another loop
        loop_runs.append(1)
        return asyncio.run(coro)

    sent = push_weight_pieces(run, tm, weight_pieces(gathered(), 3, fp8=False, budget_bytes=2048),
                              tp_size=1, session=False, io=io)
    assert sent == 3 and tm.flushed
    # before issue 39 the whole stream was read before the first piece went out: [6, 6, 6]
    assert tm.seen_at == [3, 5, 6]  # a piece is yielded when the next tensor would overflow it
    assert threads == {threading.current_thread().name}


# --- the adapter on its real loop, SGLang's tokenizer manager's rules in place of SGLang -------------

class TokenizerManagerRules:
    """SGLang's tokenizer manager as far as the adapter sees it: a request's rids become known
    only after tokenization, which here completes when the first abort has been sent (the
    race the adapter must survive); an abort of an unknown rid is dropped; a known one ends the
    request with finish reason "abort" and no tokens."""

    def __init__(self):
        self.rid_to_state: dict[str, asyncio.Event] = {}
        self.tokenized = asyncio.Event()
        self.aborts: list[str] = []

    def abort_request(self, rid: str = "", abort_all: bool = False):
        self.aborts.append("*" if abort_all else rid)
        if abort_all:
            for ended in self.rid_to_state.values():
                ended.set()
        elif rid in self.rid_to_state:
            self.rid_to_state[rid].set()
        self.tokenized.set()  # the request finishes tokenizing only now: the first abort missed it


class EngineRules:
    def __init__(self):
        self.tokenizer_manager = TokenizerManagerRules()
        self.requests: list[dict] = []
        self.sent = threading.Event()

    async def async_generate(self, **request):
        self.requests.append(request)
        self.sent.set()
        tm = self.tokenizer_manager
        await tm.tokenized.wait()
        ended = [tm.rid_to_state.setdefault(rid, asyncio.Event()) for rid in request["rid"]]
        for e in ended:
            await e.wait()
        return [{"output_ids": [], "text": "", "meta_info": {"finish_reason": {"type": "abort"},
                                                             "output_token_logprobs": []}}
                for _ in request["rid"]]

    def shutdown(self):
        pass


@pytest.fixture
def adapter():
    engine = SGLangEngine.__new__(SGLangEngine)  # everything but sglang.Engine's own start
    engine._init_adapter({"model_path": "/no/model"}, "model_path", False, 0, 1, 30.0)
    engine.version, engine.fp8, engine.tp_size, engine.weight_session = "0.5.6", False, 1, False
    engine._sample_rids, engine._warned_seed, engine.routes = {}, False, None
    engine.engine = EngineRules()
    engine._tm = engine.engine.tokenizer_manager
    yield engine
    engine.shutdown()


def test_abort_all_waits_for_a_request_still_in_the_tokenizer_manager(adapter):
    request = asyncio.run_coroutine_threadsafe(
        adapter._tracked([1, 2, 3], SamplingParams(n=2, max_tokens=4), "req"), adapter._loop.loop)
    assert adapter.engine.sent.wait(30)  # sent to the engine, not yet tokenized there
    assert adapter.abort_all() == 1
    # before issue 39: one abort_all=True, returned at once while the request kept running
    assert request.done()
    assert [o.stop_reason for o in request.result()] == ["aborted", "aborted"]
    assert {"req-0", "req-1"} <= set(adapter._tm.aborts)  # by each sample's rid


def test_a_seed_sglang_would_ignore_is_warned_once(adapter, caplog):
    adapter._tm.tokenized.set()
    seeded = SamplingParams(max_tokens=2, seed=7, logprobs=False)

    def generate_and_end():
        request = asyncio.run_coroutine_threadsafe(adapter._tracked([1, 2], seeded, "s"), adapter._loop.loop)
        assert adapter.engine.sent.wait(30)
        adapter.engine.sent.clear()
        adapter.abort_all()
        return request.result()

    with caplog.at_level(logging.WARNING, logger="polyrl.rollout.engines.sglang"):
        generate_and_end()
        generate_and_end()
    warned = [r.getMessage() for r in caplog.records if DETERMINISTIC_KEY in r.getMessage()]
    assert len(warned) == 1 and f"rollout.engine_kwargs.sglang.{DETERMINISTIC_KEY}=true" in warned[0]
    assert adapter.engine.requests[0]["sampling_params"][0]["sampling_seed"] == 7

    caplog.clear()
    adapter.launch_args[DETERMINISTIC_KEY] = True
    adapter._warned_seed = False
    with caplog.at_level(logging.WARNING, logger="polyrl.rollout.engines.sglang"):
        generate_and_end()
    assert not [r for r in caplog.records if DETERMINISTIC_KEY in r.getMessage()]
