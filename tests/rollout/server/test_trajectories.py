"""The trajectory recorder on its own: closing a trajectory cancels its engine call in flight
(an abandoned agent's), so the engine is idle again and nothing is recorded."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest

from polyrl.rollout.base import RolloutInputError, SamplingParams
from polyrl.rollout.server.trajectories import TrajectoryRecorder, TurnRequest

sys.path.insert(0, str(Path(__file__).parents[2] / "agents"))
from agent_models import build_random_model, byte_level_tokenizer  # noqa: E402


def test_closing_cancels_the_engine_call_in_flight(tmp_path):
    from polyrl.rollout.native.engine import NativeEngine

    tokenizer = byte_level_tokenizer()
    engine = NativeEngine(build_random_model(tmp_path / "m", tokenizer), tokenizer=tokenizer, max_model_len=1024)
    recorder = TrajectoryRecorder()
    recorder.open("t", SamplingParams(temperature=1.0, max_tokens=900, seed=0, ignore_eos=True),
                  seeds=lambda turn: 0, max_turns=2, max_response_tokens=1000)
    result: dict = {}

    def serve() -> None:
        try:
            asyncio.run(recorder.completion_turn("t", engine, [1, 2, 3], None, TurnRequest()))
        except Exception as exc:  # noqa: BLE001 - inspected below
            result["error"] = exc

    thread = threading.Thread(target=serve)
    thread.start()
    deadline = time.monotonic() + 60
    while engine.health()["running"] == 0:  # wait until the request is decoding
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.001)
    record = recorder.close("t")
    assert record.idle.wait(60)
    thread.join(60)
    assert isinstance(result["error"], RolloutInputError) and result["error"].field == "trajectory"
    assert record.turns == [] and engine.health()["running"] == 0
    assert engine.stats["decode_tokens"] < 899  # cut short, not run to its max_tokens
    with pytest.raises(RolloutInputError, match="not an open trajectory"):
        recorder.get("t")
