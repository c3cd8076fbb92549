"""The in-place transport hands the native engine a weight stream: specs checked before the
first tensor is produced, one tensor alive at a time, and a stream that breaks midway leaves an
engine that refuses to generate (never a mix of versions) until a complete update."""

from __future__ import annotations

import weakref

import pytest
import torch

from polyrl.rollout.base import SamplingParams, WeightUpdateError
from polyrl.rollout.native.engine import NativeEngine
from polyrl.distributed.topologies import COLOCATED
from polyrl.weights import WeightSyncConfig, build_transport
from polyrl.weights.base import WeightStream

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture()
def engine_and_weights(tiny_model):
    from transformers import AutoModelForCausalLM

    engine = NativeEngine(tiny_model, max_model_len=32)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    g = torch.Generator().manual_seed(3)
    new = {n: (p.detach() + 0.05 * torch.randn(p.shape, generator=g)) for n, p in model.named_parameters()}
    return engine, new


def stream_of(weights: dict, produced: list, live: list, fail_at: str | None = None) -> WeightStream:
    refs: list = []

    def tensors():
        for name, t in weights.items():
            if name == fail_at:
                raise OSError("gather failed: peer rank 1 died")
            fresh = t.clone()
            produced.append(name)
            refs.append(weakref.ref(fresh))
            live.append(sum(r().nbytes for r in refs if r() is not None))
            yield name, fresh
            del fresh
    return WeightStream([(n, tuple(t.shape), t.dtype) for n, t in weights.items()], tensors())


def targets(engine) -> dict[str, torch.Tensor]:
    return {n: v.clone() for n, (v, _) in engine._weights.targets.items()}


def test_streamed_update_loads_one_tensor_at_a_time(engine_and_weights):
    engine, new = engine_and_weights
    transport = build_transport(WeightSyncConfig(), COLOCATED, engine=engine)
    produced, live = [], []
    stats = transport.send(stream_of(new, produced, live), version=3)
    assert engine.weight_version == 3 and stats.num_tensors == len(new)
    assert max(live) == max(t.nbytes for t in new.values())  # never two gathered tensors at once
    now = targets(engine)
    assert all(torch.equal(now[n], t) for n, t in new.items() if n in now)


def test_bad_specs_are_refused_before_any_tensor_is_produced(engine_and_weights):
    engine, new = engine_and_weights
    before = targets(engine)
    bad = {**new, "model.norm.weight": torch.zeros(3)}
    produced: list = []
    with pytest.raises(WeightUpdateError, match="model.norm.weight.*shape"):
        engine.update_weights(stream_of(bad, produced, []), version=1)
    assert produced == [] and engine.weight_version == 0
    assert all(torch.equal(before[n], v) for n, v in targets(engine).items())
    engine.generate_batch([[5, 6, 7]], GREEDY)  # still serving the old weights


def test_a_broken_stream_stops_generation_until_a_complete_update(engine_and_weights):
    engine, new = engine_and_weights
    names = list(new)
    with pytest.raises(OSError, match="peer rank 1 died"):
        engine.update_weights(stream_of(new, [], [], fail_at=names[len(names) // 2]), version=1)
    with pytest.raises(WeightUpdateError, match="version 1 broke off midway.*complete weight update"):
        engine.generate_batch([[5, 6, 7]], GREEDY)
    engine.update_weights({"model.norm.weight": new["model.norm.weight"]}, version=2)  # not every weight
    with pytest.raises(WeightUpdateError, match="version 1 broke off midway"):
        engine.generate_batch([[5, 6, 7]], GREEDY)
    engine.update_weights(stream_of(new, [], []), version=2)
    out = engine.generate_batch([[5, 6, 7]], GREEDY)[0][0]
    assert out.weight_version == 2
