"""The pieces of a weight update the GPU adapters share (engines/common.py: `update_stream`,
`partial_update_guard`) and the vLLM worker's LoRA-wrapper handling (engines/vllm_worker.py),
on real torch modules; the real-vLLM side is tests/rollout/engines/test_vllm_lora.py."""

from __future__ import annotations

import pytest
import torch

from polyrl.rollout.base import WeightUpdateError
from polyrl.rollout.engines.common import partial_update_guard, update_stream
from polyrl.rollout.engines.vllm_worker import forwarded_quant_methods, wrappers_skipped


def test_update_stream_checks_the_version_before_reading_anything():
    read = []

    def source():
        read.append(1)
        yield "w", torch.ones(2)

    with pytest.raises(WeightUpdateError, match="version must be an int, got str"):
        update_stream(source(), "3")
    assert read == []  # refused before the stream was touched


def test_update_stream_detaches_mappings_and_pairs_lazily():
    w = torch.ones(2, 2, requires_grad=True)
    read = []

    def source():
        for name in ("a", "b"):
            read.append(name)
            yield name, w * 2

    stream = update_stream(source(), 1)
    assert read == []  # lazy: nothing read until the pieces are cut
    out = list(stream)
    assert [n for n, _ in out] == ["a", "b"] and not any(t.requires_grad for _, t in out)
    assert [n for n, _ in update_stream({"x": w}, 1)] == ["x"]
    drained = update_stream(source(), 1, drain=True)  # SGLang's order: read on the caller's thread
    assert read == ["a", "b", "a", "b"] and len(list(drained)) == 2


def test_update_stream_quantizes_for_fp8():
    weight = torch.randn(128, 128)
    names = [n for n, _ in update_stream([("model.layers.0.mlp.down_proj.weight", weight)], 1, fp8=True)]
    assert names == ["model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight_scale_inv"]


def test_partial_update_guard_names_the_engine_and_passes_through_what_it_is_told():
    with pytest.raises(WeightUpdateError, match=r"vLLM weight update to version 4 failed part-way \(boom\); "
                                                r"the engine's weights are inconsistent"):
        with partial_update_guard("vLLM", 4):
            raise RuntimeError("boom")
    with pytest.raises(WeightUpdateError, match="^two ranks$"):
        with partial_update_guard("TensorRT-LLM", 4, passthrough=(WeightUpdateError,)):
            raise WeightUpdateError("two ranks")


class _QuantMethod:
    def __init__(self):
        self.processed = []

    def process(self, layer):
        self.processed.append(layer)


class _Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2, 2))
        self.quant_method = _QuantMethod()  # its own, as vLLM's LinearBase sets it


class _ForwardingWrapper(torch.nn.Module):
    """Shaped as vLLM's `BaseLayerWithLoRA` (vllm/lora/layers/base.py): public attribute
    misses go to `base_layer`, and `weight` is a read-only property."""

    def __init__(self, base):
        super().__init__()
        self.base_layer = base

    def __getattr__(self, name):
        if not name.startswith("_") and name != "base_layer":
            return getattr(self._modules["base_layer"], name)
        return super().__getattr__(name)

    @property
    def weight(self):
        return self.base_layer.weight


def _walk(model):
    """What vLLM's process_weights_after_loading does: every module answering quant_method."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process(module)


def test_lora_wrappers_are_skipped_then_restored():
    base = _Linear()
    model = torch.nn.Sequential(_ForwardingWrapper(base), _Linear())
    assert forwarded_quant_methods(model) == [model[0]]
    with wrappers_skipped(model) as skipped:
        _walk(model)
    assert skipped == 1
    assert base.quant_method.processed == [base]  # once, as the base layer; never the wrapper
    assert model[1].quant_method.processed == [model[1]]
    assert model[0].quant_method is base.quant_method  # forwarding is back
    with pytest.raises(KeyError, match="attribute 'weight' already exists"):  # what vLLM's CPU dispatch hit
        model[0].weight = torch.nn.Parameter(torch.empty(0))


class _ModuleQuantMethod(torch.nn.Module):
    """Shaped as vLLM's `FusedMoEMethodBase`: a quant method that is an `nn.Module`."""

    def process(self, layer):
        pass


class _Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.quant_method = _ModuleQuantMethod()  # registered in _modules, not in vars()


def test_a_layer_with_a_submodule_quant_method_is_not_a_wrapper():
    # taking an MoE layer for a wrapper left its experts unprocessed on every vLLM update
    model = torch.nn.Sequential(_Experts(), _ForwardingWrapper(_Linear()))
    assert forwarded_quant_methods(model) == [model[1]]
    with wrappers_skipped(model) as skipped:
        assert isinstance(model[0].quant_method, _ModuleQuantMethod)
    assert skipped == 1
