"""Engine construction: missing engines name their extra in one line; GPU engines get the same
launch arguments the dry run prints."""

from __future__ import annotations

import importlib.util

import pytest

from polyrl.platform import SIMULATED_PROBES, get_platform
from polyrl.rollout.config import RolloutConfig
from polyrl.rollout.factory import (
    EXTRAS,
    EngineUnavailable,
    _is_gpu_adapter,
    gpu_engine_args,
    installed_version,
    require_backend,
)
from polyrl.rollout.launch_args import engine_launch_args


@pytest.mark.parametrize("backend", sorted(EXTRAS))
def test_missing_engine_is_one_line_naming_the_extra(backend):
    module, extra = EXTRAS[backend]
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here")
    with pytest.raises(EngineUnavailable) as err:
        require_backend(backend)
    message = str(err.value)
    assert message == f'rollout.backend={backend} needs the {module} package: pip install "polyrl[{extra}]"'
    assert "\n" not in message
    assert installed_version(backend) is None


def test_native_needs_nothing_and_unknown_lists_choices():
    require_backend("native")
    assert installed_version("native") is None
    with pytest.raises(EngineUnavailable, match="available: native, vllm, sglang, trtllm"):
        require_backend("tgi")


def test_gpu_adapters_are_told_apart_from_native():
    from polyrl.rollout.engines.sglang import SGLangEngine
    from polyrl.rollout.engines.trtllm import TRTLLMEngine
    from polyrl.rollout.engines.vllm import VLLMEngine
    from polyrl.rollout.native.engine import NativeEngine

    assert all(_is_gpu_adapter(c) for c in (VLLMEngine, SGLangEngine, TRTLLMEngine))
    assert not _is_gpu_adapter(NativeEngine)


@pytest.mark.parametrize("backend", ["vllm", "sglang", "trtllm"])
def test_gpu_engine_args_are_the_dry_run_args(backend):
    cfg = RolloutConfig(backend=backend, dtype="bfloat16")
    platform = get_platform(None, SIMULATED_PROBES["h100"])
    assert gpu_engine_args(cfg, "/m", platform) == engine_launch_args(
        cfg, "/m", platform, installed_version(backend))


def test_pyproject_extras_name_the_engines():
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    assert {"vllm", "sglang", "trtllm"} <= set(extras)
    assert extras["vllm"][0].startswith("vllm")
    assert extras["sglang"][0].startswith("sglang")
    assert extras["trtllm"][0].startswith("tensorrt-llm")
