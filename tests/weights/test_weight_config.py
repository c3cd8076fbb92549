"""WeightSyncConfig, the transport registry and the in-place (colocated) transport."""

from __future__ import annotations

import pytest
import torch

from gloo_world import DictEngine, model_weights, same_weights
from polyrl.config.base import ConfigError, validate
from polyrl.distributed.topologies import COLOCATED, DISAGGREGATED
from polyrl.rollout.base import WeightUpdateError
from polyrl.weights import WEIGHT_TRANSPORTS, WeightSyncConfig, WeightTransport, build_transport
from polyrl.weights.in_place import InPlaceTransport


def test_auto_picks_by_topology_and_mismatches_name_the_fix():
    config = WeightSyncConfig()
    assert isinstance(build_transport(config, COLOCATED, engine=None), InPlaceTransport)
    assert DISAGGREGATED.transport(config.transport) == "broadcast"
    assert WeightSyncConfig(bucket_mb=0.5).bucket_bytes == 1 << 19
    with pytest.raises(ValueError, match="weights.transport=broadcast or object_store"):
        build_transport(WeightSyncConfig(transport="in_place"), DISAGGREGATED)


def test_unknown_transport_lists_the_choices():
    with pytest.raises(ConfigError, match="in_place, broadcast, object_store"):
        validate(WeightSyncConfig, {"transport": "rdma"})
    with pytest.raises(ConfigError, match="bucket_mb"):
        validate(WeightSyncConfig, {"bucket_mb": 0})
    assert WEIGHT_TRANSPORTS.names() == ["in_place", "broadcast", "object_store"]


def test_in_place_transport_applies_and_reports():
    engine = DictEngine(model_weights(seed=0))
    transport = build_transport(WeightSyncConfig(), COLOCATED, engine=engine)
    assert isinstance(transport, InPlaceTransport) and isinstance(transport, WeightTransport)
    new = model_weights(seed=1)
    stats = transport.send(new, version=4)
    assert transport.receive(engine) == 4 and same_weights(engine.weights, new)
    assert stats.version == 4 and stats.bytes == sum(t.numel() * t.element_size() for t in new.values())
    assert stats.bytes_per_s > 0 and stats.metrics()["weight_sync/bytes"] == stats.bytes


def test_in_place_transport_with_the_native_engine(tiny_model):
    from transformers import AutoModelForCausalLM

    from polyrl.rollout.native.engine import NativeEngine

    engine = NativeEngine(tiny_model, tokenizer=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    state = {k: v.detach() + 0.01 for k, v in model.state_dict().items()}
    transport = InPlaceTransport(engine=engine)
    stats = transport.send(state, version=1)
    assert engine.weight_version == 1 and stats.num_tensors == len(state)
    bad = dict(state)
    name = next(iter(bad))
    bad[name] = torch.zeros(3)
    with pytest.raises(WeightUpdateError):
        transport.send(bad, version=2)
    assert engine.weight_version == 1  # all or nothing
