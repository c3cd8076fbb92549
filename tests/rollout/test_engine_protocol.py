"""The RolloutEngine protocol says what callers use, and every built-in engine provides it.

Members are read off the protocol itself, so a method added to it must be added to every engine
(GPU adapters are checked as classes: their packages are not needed for that)."""

from __future__ import annotations

import inspect

import pytest

from polyrl.backends import ROLLOUT_BACKENDS
from polyrl.rollout.base import RolloutEngine, StreamingRolloutEngine

CALLED = {"generate", "generate_batch", "update_weights", "sleep", "wake_up", "abort_all", "health",
          "from_model", "eos_token_ids"}
"""What the trainer, workers and server call (polyrl/workers, polyrl/topology, polyrl/rollout/server)."""


def protocol_members(protocol: type) -> set[str]:
    return {n for n, v in vars(protocol).items()
            if not n.startswith("_") and (callable(v) or isinstance(v, (property, classmethod)))}


def test_the_protocol_lists_what_callers_use():
    assert CALLED <= protocol_members(RolloutEngine)
    assert {"weight_version", "tokenizer"} <= set(RolloutEngine.__annotations__)
    assert protocol_members(StreamingRolloutEngine) == {"generate_stream"}


@pytest.mark.parametrize("backend", ROLLOUT_BACKENDS.names())
def test_every_built_in_engine_implements_it(backend):
    cls = ROLLOUT_BACKENDS.get(backend).engine_class()
    missing = sorted(n for n in protocol_members(RolloutEngine) if not hasattr(cls, n))
    assert not missing, f"{cls.__name__} lacks {missing}"
    assert isinstance(inspect.getattr_static(cls, "from_model"), classmethod)
    assert inspect.iscoroutinefunction(cls.generate)


def test_a_native_engine_instance_is_a_streaming_rollout_engine(tiny_model):
    engine = ROLLOUT_BACKENDS.get("native").engine_class()(tiny_model, max_model_len=32)
    assert isinstance(engine, RolloutEngine) and isinstance(engine, StreamingRolloutEngine)
