"""Version floors as data (issue 39): a capability that needs a newer engine than its backend's
supported range starts at declares its floor on the backend's capabilities
(`EngineCapabilities.since`, polyrl/backends.py); the engine factory, the pre-flight and
`polyrl doctor` refuse or flag it below that floor in one line. The names each floor stands for
are checked in the real releases at the floor (tests/rollout/engines/test_contract_vllm.py).

The installed engine version is what the checks are handed here (vLLM's GPU build is not
installed on a CPU machine): the checks read it through `installed_engine_version`, which the
tests set.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from tiny_vl import tiny_vl_config

from polyrl.backends import (
    ENGINE_CONTRACTS,
    EngineCapabilities,
    capabilities,
    feature_version_problem,
    features_below_floor,
)
from polyrl.config import ConfigError, load_config
from polyrl.job import JobConfig


def test_the_vllm_floors_are_declared_as_data():
    caps = capabilities("vllm")
    assert caps.minimum_version("fp8") == "0.16.0" and caps.minimum_version("images") == "0.17.0"
    assert caps.minimum_version("tensor_parallel") is None
    assert caps.as_dict()["since"] == {"fp8": "0.16.0", "images": "0.17.0", "routed_experts": "0.14.0"}
    # every floor has the names it needs in the contract, tagged with it and its version
    for capability, floor in caps.since:
        uses = [u for u in ENGINE_CONTRACTS["vllm"] if u.feature == capability]
        assert uses and all(u.versions == f">={floor}" for u in uses)


def test_a_floor_names_a_capability_and_a_version():
    with pytest.raises(ValueError, match="'speed' is not a capability"):
        EngineCapabilities(fp8=True, since={"speed": "1.0"})
    with pytest.raises(ValueError, match=r"since\['fp8'\]: 'soon' is not a version"):
        EngineCapabilities(fp8=True, since={"fp8": "soon"})
    assert EngineCapabilities(since={"fp8": "1.0"}) == EngineCapabilities(since=(("fp8", "1.0"),))


def test_below_the_floor_is_one_line_with_the_pip_command():
    line = feature_version_problem("vllm", "fp8", "0.10.1", "rollout.quantization=fp8")
    assert line == ("rollout.quantization=fp8: rollout.backend=vllm serves fp8 from vllm 0.16.0 on, 0.10.1 "
                    "is installed: pip install \"vllm>=0.16.0,<0.34\"")
    assert feature_version_problem("vllm", "fp8", "0.16.0") is None
    assert feature_version_problem("vllm", "fp8", "0.16.0rc1.dev3+cu128") is None  # a build of 0.16.0
    assert feature_version_problem("vllm", "fp8", None) is None  # unknown: the engine's own check
    assert feature_version_problem("sglang", "fp8", "0.5.6") is None  # no floor declared
    assert features_below_floor("vllm", "0.16.2") == [("images", "0.17.0")]


def test_the_engine_factory_refuses_fp8_below_its_floor(monkeypatch):
    from polyrl.rollout import factory
    from polyrl.rollout.config import RolloutConfig

    monkeypatch.setattr(factory, "installed_version", lambda backend: "0.10.1")
    with pytest.raises(factory.EngineUnavailable, match=r"^rollout.quantization=fp8: .*vllm>=0.16.0,<0.34"):
        factory.check_engine_features(RolloutConfig(backend="vllm", quantization="fp8"))
    factory.check_engine_features(RolloutConfig(backend="vllm"))  # bf16 serves on 0.10.1
    monkeypatch.setattr(factory, "installed_version", lambda backend: "0.32.0")
    factory.check_engine_features(RolloutConfig(backend="vllm", quantization="fp8"))


def test_preflight_refuses_image_rows_below_the_floor(monkeypatch):
    import polyrl.backends as backends
    from polyrl.trainer.preflight import check_vision

    rows = [SimpleNamespace(prompt_ids=[1, 2], images=object())]
    cfg = load_config(JobConfig, overrides=["rollout.backend=vllm"])
    monkeypatch.setattr(backends, "installed_engine_version", lambda name: "0.10.1")
    with pytest.raises(ConfigError) as err:
        check_vision(cfg, rows, None, tiny_vl_config())
    (line,) = err.value.problems
    assert line.startswith("image prompts: rollout.backend=vllm serves images from vllm 0.17.0 on")
    check_vision(cfg, [SimpleNamespace(prompt_ids=[1], images=None)], None, tiny_vl_config())  # text rows
    monkeypatch.setattr(backends, "installed_engine_version", lambda name: "0.17.0")
    check_vision(cfg, rows, None, tiny_vl_config())


def test_doctor_flags_an_installed_engine_below_a_floor():
    from polyrl.cli.doctor import capability_findings

    found = capability_findings({"vllm": "0.10.1"}, "vllm")
    (warn,) = [f for f in found if f.level == "warn" and f.topic == "vllm engine"]
    assert warn.message == ("vllm 0.10.1 is below the version floor of: fp8 (needs >=0.16.0), images "
                            "(needs >=0.17.0), routed_experts (needs >=0.14.0); runs asking for them are refused")
    assert not [f for f in capability_findings({"vllm": "0.32.0"}, "vllm") if f.level == "warn"]


# --- the vLLM worker: FP8 through vLLM's own layerwise reload, refused without it -------------------

class LayerwiseReloadRules:
    """vLLM >= 0.16's reload as its GPU worker drives it: initialize_layerwise_reload(model),
    then model.load_weights under the device, then finalize_layerwise_reload(model,
    model_config). Records the order of the calls."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    def initialize(self, model):
        self.calls.append("initialize")

    def finalize(self, model, model_config):
        self.calls.append("finalize")


def _worker(api):
    import torch

    from polyrl.rollout.engines.vllm_worker import PolyrlWorkerExtension, encode_tensor

    calls = api.calls if api else []

    class Model(torch.nn.Module):
        def load_weights(self, weights):
            calls.append("load_weights")
            return {n for n, _ in weights}

    class Worker(PolyrlWorkerExtension):
        device = torch.device("cpu")
        model_config = object()
        model_runner = SimpleNamespace(model=Model())

        def _polyrl_reload_api(self):
            return (api.initialize, api.finalize) if api else None

    return Worker(), encode_tensor


def test_an_fp8_update_goes_through_vllms_layerwise_reload():
    import torch

    api = LayerwiseReloadRules()
    worker, encode = _worker(api)
    worker.polyrl_begin_update(True)
    weight = torch.randn(128, 128)
    assert worker.polyrl_load_bucket([("model.layers.0.mlp.down_proj.weight", encode(weight))]) == 2  # + scale
    assert worker.polyrl_finish_update(3) == 2
    # before issue 39: process_weights_after_loading only, no initialize / finalize
    assert api.calls == ["initialize", "load_weights", "finalize"]


def test_an_fp8_update_on_a_vllm_without_layerwise_reload_is_one_line():
    worker, _ = _worker(None)
    with pytest.raises(RuntimeError, match=r'^rollout.quantization=fp8: this vLLM has no layerwise weight '
                                           r'reload, which FP8 weight updates need: pip install "vllm>=0.16.0"$'):
        worker.polyrl_begin_update(True)
