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
    engine_args,
    installed_version,
    require_backend,
)
from polyrl.rollout.launch_args import engine_launch_args
from tests.rollout.colocation import colocated


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
    assert engine_args(cfg, "/m", platform, colocated=colocated(cfg)) == engine_launch_args(
        cfg, "/m", platform, installed_version(backend), colocated=colocated(cfg))


def test_pyproject_extras_name_the_engines():
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    assert {"vllm", "sglang", "trtllm"} <= set(extras)
    assert extras["vllm"][0].startswith("vllm")
    assert extras["sglang"][0].startswith("sglang")
    assert extras["trtllm"][0].startswith("tensorrt-llm")


# --- issue 28: the launch is planned by the same builders as the dry run ---------------------------

def test_native_engine_kwargs_reach_the_engine_once(tiny_model):
    # was: `max_num_seqs` in engine_kwargs raised "got multiple values", a null a TypeError
    from polyrl.rollout.factory import build_disaggregated_engine

    cfg = RolloutConfig(max_model_len=64, engine_kwargs={"native": {"max_num_seqs": 3,
                                                                    "max_prefill_tokens": 512}})
    engine = build_disaggregated_engine(cfg, tiny_model, "cpu")
    assert engine._sched.max_num_seqs == 3 and engine.max_model_len == 64
    assert not engine.batch_invariant
    invariant = build_disaggregated_engine(RolloutConfig(max_model_len=64, batch_invariant=True),
                                        tiny_model, "cpu")
    assert invariant.batch_invariant  # rollout.batch_invariant reaches the engine
    nulled = RolloutConfig(engine_kwargs={"native": {"max_num_seqs": None}})
    with pytest.raises(ValueError, match=r"^rollout.engine_kwargs.native.max_num_seqs is null"):
        build_disaggregated_engine(nulled, tiny_model, "cpu")


def test_colocated_native_engine_takes_the_same_arguments(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    from polyrl.modeling import load_tokenizer
    from polyrl.rollout.factory import build_colocated_engine

    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    cfg = RolloutConfig(max_model_len=32, engine_kwargs={"native": {"max_num_seqs": 2}})
    engine = build_colocated_engine(cfg, model, load_tokenizer(tiny_model), torch.device("cpu"))
    assert engine._sched.max_num_seqs == 2 and engine.max_model_len == 32


def test_native_tensor_parallel_fails_the_dry_run_and_the_pre_flight_alike():
    """`launch_args.check_replica_layout`: what `polyrl train` refuses before Ray is the dry
    run's plan error (the built-in engine builder itself lets tests stand it in for a TP engine)."""
    from polyrl.job import JobConfig
    from polyrl.rollout.factory import check_engine_launch
    from polyrl.topology.launch_plan import plan_launch

    job = JobConfig.model_validate({"rollout": {"placement": "standalone", "tensor_parallel_size": 2,
                                                "max_model_len": 64}})
    plan = plan_launch(job, get_platform("cpu"))
    with pytest.raises(ValueError) as preflight:
        check_engine_launch(job.rollout, job.model.path, get_platform("cpu"),
                            colocated=job.topology.colocated_engine)
    assert "needs a GPU engine" in str(preflight.value)
    assert plan.errors and plan.errors[0].endswith(str(preflight.value))


@pytest.mark.parametrize("backend", ["vllm", "sglang", "trtllm"])
def test_hybrid_tensor_parallel_fails_the_dry_run_and_the_launch_alike(backend):
    """One check (`launch_args.check_launch`): the dry run's plan error is the launch's error."""
    from polyrl.job import JobConfig
    from polyrl.topology.launch_plan import plan_launch

    h100 = get_platform(None, SIMULATED_PROBES["h100"])
    job = JobConfig.model_validate({"rollout": {"backend": backend, "tensor_parallel_size": 2,
                                                "max_model_len": 64},
                                    "actor": {"world_size": 2, "num_cpus_per_worker": 1}})
    plan = plan_launch(job, h100, "0.5.12")
    assert len(plan.errors) == 2  # both policy ranks host an engine
    with pytest.raises(ValueError) as launch:
        engine_args(job.rollout, "/m", h100, colocated=job.topology.colocated_engine)
    assert plan.errors[0] == f"policy rank 0: {launch.value}"


def _fake_install(root, name: str, version: str) -> None:
    """An installed package as importlib sees one: the module and its dist-info."""
    (root / name).mkdir()
    (root / name / "__init__.py").write_text("")
    info = root / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_an_engine_outside_its_supported_range_is_one_line_naming_the_pip_command(tmp_path, monkeypatch):
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    _fake_install(tmp_path, "sglang", "0.5.4")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert installed_version("sglang") == "0.5.4"
    with pytest.raises(EngineUnavailable) as err:
        require_backend("sglang")
    assert str(err.value) == ('rollout.backend=sglang: sglang 0.5.4 is outside the versions polyrl '
                              'supports (sglang>=0.5.6,<0.6): pip install "sglang>=0.5.6,<0.6"')


def test_supported_ranges_name_each_engine():
    from polyrl.backends import check_engine_version, version_problem

    assert version_problem("vllm", "0.10.0") and not version_problem("vllm", "0.11.2")
    assert not version_problem("sglang", "0.5.23.post1") and version_problem("sglang", "0.6.0")
    assert not version_problem("trtllm", "1.2.0rc3") and version_problem("trtllm", "1.0.0")
    assert version_problem("native", "1.0") is None  # the built-in engine has no package
    check_engine_version("vllm", "0.11.0")
    with pytest.raises(ValueError, match=r'pip install "tensorrt-llm>=1.1,<1.3"'):
        check_engine_version("trtllm", "1.3.0")


def test_the_pre_flight_check_raises_what_the_launch_would():
    from polyrl.rollout.factory import check_engine_launch

    check_engine_launch(RolloutConfig(), "builtin:tiny-arith", colocated=True)
    with pytest.raises(ValueError, match="^rollout.engine_kwargs.native.max_num_seqs is null"):
        check_engine_launch(RolloutConfig(engine_kwargs={"native": {"max_num_seqs": None}}),
                            "builtin:tiny-arith", colocated=True)
    h100 = get_platform(None, SIMULATED_PROBES["h100"])
    with pytest.raises(ValueError, match="needs a GPU engine"):  # the trainer's own refusal, shared
        check_engine_launch(RolloutConfig(tensor_parallel_size=2), "builtin:tiny-arith", h100,
                            colocated=True)
