"""The TensorRT-LLM adapter's weight staging, log-prob reading and worker extension (issue 39).

TensorRT-LLM needs a GPU and its wheels are not on PyPI, so what is checked here is the adapter's
own logic on real torch tensors and modules. Where TRT-LLM's behaviour matters it is encoded in a
class named for it, as read in TRT-LLM's sources (1.2 / main, 2026):
`ModelLoaderRules` is `ModelLoader.reload` / `_call_load_weights` (passes
`allow_partial_loading` only to a `load_weights` that declares it, asserts it is False
otherwise), `StockExtensionRules` is `rlhf_utils.WorkerExtension.update_weights` (reloads
every flush with `allow_partial_loading=True`). The names the adapter calls are checked against
the real releases in tests/rollout/engines/test_contract_trtllm.py.
"""

from __future__ import annotations

import inspect
import logging
import math
from types import SimpleNamespace

import pytest
import torch

from polyrl.rollout.base import SamplingParams
from polyrl.rollout.engines.trtllm import TRTLLMEngine, push_rank_weights, stage_on_device
from polyrl.rollout.engines.trtllm_worker import (
    EXTENSION_NAME,
    PartialLoadingAware,
    accepts_partial_loading,
    whole_state_reload,
)


# --- host tensors reach TRT-LLM through the device, one flush at a time --------------------------------

class ReplicaLeader:
    """The leader adapter's side of `push_rank_weights`: records every flush it applies."""

    def __init__(self):
        self.applied: list[dict] = []
        self.finished = False

    def _before_update(self):
        pass

    def _apply(self, handles):
        if handles is None:
            self.finished = True
        else:
            self.applied.append(handles)

    def supports_partial_loading(self):
        return True


def test_host_tensors_are_staged_on_the_device_flush_by_flush():
    # what the standalone transports hand over: host tensors (broadcast staging, object store)
    read: list[str] = []

    def host_weights():
        for i in range(5):
            read.append(f"w{i}")
            yield f"w{i}", torch.from_numpy(torch.full((256,), float(i)).numpy())  # 1 KiB each

    staged_when_applied: list[tuple[list[str], set[str], int]] = []

    def payload(piece):  # the IPC serializer's place: needs device tensors
        staged_when_applied.append(([n for n, _ in piece], {t.device.type for _, t in piece}, len(read)))
        return {"device-uuid": piece}

    leader = ReplicaLeader()
    # "meta" stands for the accelerator: a real device type that is not host memory
    result = push_rank_weights(host_weights(), 3, engine=leader, group=None, fp8=False, budget_bytes=2048,
                               hf_config=None, device=torch.device("meta"), make_payload=payload)
    assert result.rounds == 3 and leader.finished
    assert [names for names, _, _ in staged_when_applied] == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    assert all(devices == {"meta"} for _, devices, _ in staged_when_applied)
    # lazily: a flush is cut when the next tensor would overflow it, never the whole model first
    assert [n for _, _, n in staged_when_applied] == [3, 5, 5]


def test_staging_passes_device_tensors_through_and_leaves_host_ones_without_a_device():
    on_device = torch.empty(2, device="meta")
    host = torch.zeros(2)
    out = list(stage_on_device([("a", on_device), ("b", host)], torch.device("meta")))
    assert out[0][1] is on_device and out[1][1].device.type == "meta"
    assert list(stage_on_device([("b", host)], None))[0][1] is host  # serialize_handles names it


# --- a log-prob record without the sampled token --------------------------------------------------------

@pytest.fixture
def adapter():
    engine = TRTLLMEngine.__new__(TRTLLMEngine)  # everything but AsyncLLM's own start
    engine._init_adapter({"model": "/no/model"}, "model", False, 0, 1, 30.0)
    engine._warned_logprobs = False
    yield engine
    engine._loop.close()


def _result(tokens, records):
    Logprob = lambda lp: SimpleNamespace(logprob=lp, rank=1)  # noqa: E731
    return SimpleNamespace(outputs=[SimpleNamespace(
        token_ids=tokens, logprobs=[{t: Logprob(lp) for t, lp in r.items()} for r in records],
        finish_reason="length", text="")])


def test_a_top_k_record_without_the_sampled_token_is_nan_counted_and_warned_once(adapter, caplog):
    # a TRT-LLM whose PyTorch sampler returns only the top-k record (before its change to always
    # include the sampled token; which release is not pinned here): a non-greedy token may be missing
    result = _result([11, 12, 13], [{11: -0.5}, {99: -0.1}, {13: -0.7}])
    with caplog.at_level(logging.WARNING, logger="polyrl.rollout.engines.trtllm"):
        out = adapter._outputs(result, SamplingParams(logprobs=True))[0]  # before issue 39: RuntimeError
        adapter._outputs(result, SamplingParams(logprobs=True))
    assert out.logprobs[0] == -0.5 and math.isnan(out.logprobs[1]) and out.logprobs[2] == -0.7
    assert out.extra["missing_logprobs"] == 1
    assert len([r for r in caplog.records if "without the sampled token" in r.getMessage()]) == 1
    whole = adapter._outputs(_result([11], [{11: -0.5}]), SamplingParams(logprobs=True))[0]
    assert "missing_logprobs" not in whole.extra


# --- the worker extension: partial loading only where the model's load_weights takes it ---------------

class TextModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.calls: list[dict] = []

    def load_weights(self, weights, weight_mapper=None, allow_partial_loading=False):
        self.calls.append({"names": sorted(weights), "partial": allow_partial_loading})


class VisionLanguageModel(TextModel):
    def load_weights(self, weights, weight_mapper=None):  # no allow_partial_loading
        self.calls.append({"names": sorted(weights), "partial": None})


class ModelLoaderRules:
    """TRT-LLM's ModelLoader.reload as it passes allow_partial_loading on."""

    def reload(self, model, weights, allow_partial_loading=False):
        kwargs = {"weight_mapper": None}
        if "allow_partial_loading" in inspect.getfullargspec(model.load_weights).args:
            kwargs["allow_partial_loading"] = allow_partial_loading
        else:
            assert allow_partial_loading is False, "allow_partial_loading is not supported for this model"
        model.load_weights(weights, **kwargs)


class StockExtensionRules:
    """TRT-LLM's rlhf_utils.WorkerExtension.update_weights as far as loading goes (the handles
    are rebuilt into tensors there; here they are the tensors)."""

    def update_weights(self, ipc_handles=None):
        if ipc_handles is not None:
            engine = self.engine.model_engine
            engine.model_loader.reload(engine.model, dict(ipc_handles["uuid"]), allow_partial_loading=True)


class PolyrlExtension(PartialLoadingAware, StockExtensionRules):
    def __init__(self, model):
        self.engine = SimpleNamespace(model_engine=SimpleNamespace(model=model, model_loader=ModelLoaderRules()))


def test_the_extension_answers_whether_the_model_loads_in_parts():
    assert PolyrlExtension(TextModel()).supports_partial_loading()
    assert not PolyrlExtension(VisionLanguageModel()).supports_partial_loading()
    assert not hasattr(StockExtensionRules, "supports_partial_loading")  # the adapter's old answer: no


def test_a_vision_language_model_reloads_its_whole_state_without_partial_loading():
    handles = {"uuid": [("a", torch.zeros(1)), ("b", torch.zeros(1))]}
    stock = StockExtensionRules()
    stock.engine = PolyrlExtension(VisionLanguageModel()).engine
    with pytest.raises(AssertionError, match="allow_partial_loading is not supported"):
        stock.update_weights(handles)  # TRT-LLM's own extension on such a model
    vlm = VisionLanguageModel()
    ext = PolyrlExtension(vlm)
    ext.update_weights(handles)
    assert vlm.calls == [{"names": ["a", "b"], "partial": None}]
    assert "reload" not in vars(ext.engine.model_engine.model_loader)  # the loader is left as it was
    text = TextModel()
    PolyrlExtension(text).update_weights(handles)
    assert text.calls == [{"names": ["a", "b"], "partial": True}]


def test_whole_state_reload_restores_an_instance_attribute():
    loader = ModelLoaderRules()
    own = loader.reload
    loader.reload = own
    with whole_state_reload(loader):
        assert loader.reload is not own
    assert loader.reload is own
    assert accepts_partial_loading(TextModel().load_weights)


def test_the_extension_is_what_the_launch_arguments_name_and_imports_without_trtllm():
    import polyrl.rollout.engines.trtllm_worker as worker
    from polyrl.rollout.launch_args import TRTLLM_WORKER_EXTENSION

    assert TRTLLM_WORKER_EXTENSION == f"{worker.__name__}.{EXTENSION_NAME}"
    with pytest.raises(ModuleNotFoundError, match="tensorrt_llm"):
        getattr(worker, EXTENSION_NAME)  # built from TRT-LLM's own class, inside its workers


def test_a_nan_rollout_log_prob_neither_poisons_the_loss_nor_the_mismatch_metric():
    # where those NaNs go: the off-policy correction and rollout/logprob_diff_* (issue 39)
    from polyrl.algorithms.off_policy import off_policy_correction
    from polyrl.batch import Ragged
    from polyrl.algorithms.off_policy_config import OffPolicyConfig
    from polyrl.workers.actor import LogprobMismatch

    prox = torch.tensor([[-0.5, -1.0, -0.2]])
    rollout = torch.tensor([[-0.4, math.nan, -0.2]])
    mask = torch.ones(1, 3)
    corr = off_policy_correction(prox, rollout, mask, OffPolicyConfig(is_level="token", mask_level="token"))
    assert torch.isfinite(corr.weights).all() and corr.weights[0, 1] == 1.0  # unknown: counted on-policy
    padded = LogprobMismatch(SimpleNamespace(world_size=1))
    padded.add_padded(prox, rollout, mask, torch.tensor([True]))
    ragged = LogprobMismatch(SimpleNamespace(world_size=1))
    rows = lambda t: Ragged.from_rows([t[0].tolist()], torch.float32)  # noqa: E731
    ragged.add_ragged(rows(prox), rows(rollout), rows(mask), torch.tensor([True]))
    for m in (padded, ragged):
        assert m.metrics() == pytest.approx({"rollout/logprob_diff_mean": 0.05, "rollout/logprob_diff_max": 0.1})
