"""Engines declare what they can do (`EngineCapabilities`, polyrl/backends.py), and the trainer,
its pre-flight and `polyrl doctor` ask the declaration, not the backend's name: a plugin that
declares what the built-in engine declares is treated as the built-in engine is.

Plugins here are real modules in tmp_path on sys.path, named by import path as a user names
them in a config (`rollout.backend: package.module:Name`). Each test uses module names of its
own: a module is imported once per process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from polyrl.backends import (
    ENGINE_MEMBERS,
    ROLLOUT_BACKENDS,
    EngineCapabilities,
    backend_names,
    capabilities,
    check_backend,
)
from polyrl.config import ConfigError, load_config
from polyrl.job import JobConfig
from polyrl.rollout.config import RolloutConfig
from tests.rollout.colocation import colocated

NATIVE = "polyrl.rollout.native.engine:NativeEngine"


def plugin(tmp_path, monkeypatch, name: str, source: str) -> str:
    """A module `name` holding `source`, importable from here on."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def job(*overrides: str) -> JobConfig:
    return load_config(JobConfig, overrides=list(overrides))


# --- the declaration ------------------------------------------------------------------------------

def test_built_in_capabilities_are_read_without_importing_any_engine():
    code = ("import json, sys; from polyrl.backends import capabilities, backend_names;"
            "caps = {n: capabilities(n).as_dict() for n in backend_names()};"
            "print(json.dumps({'caps': caps, 'loaded': sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('torch', 'vllm', 'sglang', 'tensorrt_llm') or m.startswith('polyrl.rollout'))}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["loaded"] == []
    native, vllm = got["caps"]["native"], got["caps"]["vllm"]
    assert native["trainer_logprob_dtypes"] == ["float32"] and not native["tensor_parallel"]
    assert native["batch_invariant"] and native["partial_rollout"] and native["sleep"]
    assert vllm["tensor_parallel"] and vllm["lora_adapters"] and vllm["fp8"] and vllm["trainer_logprob_dtypes"] == []
    assert [c["tensor_parallel"] for c in got["caps"].values()] == [False, True, True, True]


def test_capabilities_default_to_what_is_safe_and_refuse_unknown_dtypes():
    nothing = EngineCapabilities()
    assert not any(v for v in nothing.as_dict().values())
    assert not nothing.logprobs_match_trainer("float32", "float32", "float32")
    fp32 = EngineCapabilities(trainer_logprob_dtypes={"float32"})  # a set is taken, kept frozen
    assert fp32.logprobs_match_trainer("float32", "float32", "float32")
    assert not fp32.logprobs_match_trainer("float32", "float32", "bfloat16")
    assert not fp32.logprobs_match_trainer("bfloat16", "bfloat16", "bfloat16")
    with pytest.raises(ValueError, match="trainer_logprob_dtypes: \\['fp32'\\]"):
        EngineCapabilities(trainer_logprob_dtypes={"fp32"})


def test_the_engine_members_a_plugin_is_checked_for_are_the_protocols():
    from polyrl.rollout.base import RolloutEngine

    protocol = {n for n, v in vars(RolloutEngine).items()
                if not n.startswith("_") and (callable(v) or isinstance(v, (property, classmethod)))}
    assert set(ENGINE_MEMBERS) == protocol


# --- a plugin named by import path ----------------------------------------------------------------

def test_an_engine_class_declares_its_own_capabilities_not_its_bases(tmp_path, monkeypatch):
    module = plugin(tmp_path, monkeypatch, "caps_own_engine", f'''
        from polyrl.backends import EngineCapabilities
        from polyrl.rollout.native.engine import NativeEngine

        class Declared(NativeEngine):
            capabilities = EngineCapabilities(trainer_logprob_dtypes={{"float32"}}, partial_rollout=True)

        class Inherits(Declared):
            """Changes what its base did, maybe: declares nothing, so nothing is assumed."""
        ''')
    assert RolloutConfig(backend=f"{module}:Declared").backend == f"{module}:Declared"
    assert capabilities(f"{module}:Declared") == EngineCapabilities(trainer_logprob_dtypes={"float32"},
                                                                   partial_rollout=True)
    assert capabilities(f"{module}:Inherits") == EngineCapabilities()
    assert capabilities(NATIVE) == EngineCapabilities()  # the class itself declares nothing
    assert f"{module}:Declared" not in backend_names()  # valid without being listed
    assert ROLLOUT_BACKENDS.get(f"{module}:Declared").engine_class().__name__ == "Declared"


def test_a_spec_declares_capabilities_without_its_engine_being_imported(tmp_path, monkeypatch):
    plugin(tmp_path, monkeypatch, "caps_heavy_engine", '''
        raise RuntimeError("the heavy engine module was imported")
        ''')
    spec = plugin(tmp_path, monkeypatch, "caps_light_spec", '''
        from polyrl.backends import EngineCapabilities, RolloutBackend

        BACKEND = RolloutBackend("heavy", "caps_heavy_engine:HeavyEngine", engine_processes=True,
                                 capabilities=EngineCapabilities(tensor_parallel=True, fp8=True))
        ''')
    name = f"{spec}:BACKEND"
    check_backend(name)
    backend = ROLLOUT_BACKENDS.get(name)
    assert backend.name == name and backend.engine_processes
    assert capabilities(name).tensor_parallel and capabilities(name).fp8
    assert "caps_heavy_engine" not in sys.modules


def test_a_plugin_running_engine_processes_is_refused_at_launch_as_in_the_dry_run(tmp_path, monkeypatch):
    """Its launch arguments are built per backend (polyrl/rollout/launch_args.py); without a
    builder the dry run shows an error, and the launch refuses it with the same line instead of
    starting the engine on arguments meant for an in-process one."""
    from polyrl.platform import get_platform
    from polyrl.rollout.factory import check_engine_launch
    from polyrl.rollout.launch_args import engine_launch_args

    spec = plugin(tmp_path, monkeypatch, "caps_gpu_spec", f'''
        from polyrl.backends import RolloutBackend

        BACKEND = RolloutBackend("gpu", "{NATIVE}", engine_processes=True)
        ''')
    cfg = RolloutConfig(backend=f"{spec}:BACKEND", max_model_len=64)
    with pytest.raises(ValueError, match="no launch-argument builder") as dry_run:
        engine_launch_args(cfg, "/m", get_platform("cpu"), colocated=colocated(cfg))
    with pytest.raises(ValueError) as launch:
        check_engine_launch(cfg, "builtin:tiny-arith", get_platform("cpu"), colocated=colocated(cfg))
    assert str(launch.value) == str(dry_run.value)


@pytest.mark.parametrize("source,target,needle", [
    ("", "caps_bad_missing_mod.engine:E", "no module 'caps_bad_missing_mod' here; put the directory"),
    ("X = 1\n", "caps_bad_attr:Engine", "caps_bad_attr has no attribute 'Engine'"),
    ("X = 1\n", "caps_bad_kind:X", "is int, not a rollout engine class or a RolloutBackend"),
    ("class Engine:\n    def generate(self): ...\n", "caps_bad_class:Engine",
     "is not a rollout engine: Engine lacks abort_all, eos_token_ids, from_model, generate_batch"),
    ("raise KeyError('boom')\n", "caps_bad_import:Engine", "importing caps_bad_import raised KeyError: 'boom'"),
    ("from polyrl.rollout.native.engine import NativeEngine\n"
     "class Engine(NativeEngine):\n    capabilities = {'tensor_parallel': True}\n", "caps_bad_caps:Engine",
     "capabilities must be an EngineCapabilities (polyrl.backends), got dict"),
])
def test_a_bad_import_path_is_one_line_naming_rollout_backend(tmp_path, monkeypatch, source, target, needle):
    if source:
        plugin(tmp_path, monkeypatch, target.partition(":")[0], source)
    with pytest.raises(ConfigError) as err:
        job(f"rollout.backend={target}")
    (problem,) = err.value.problems
    assert problem.startswith(f"rollout.backend: '{target}'") and needle in problem, problem
    assert "\n" not in problem


def test_a_misspelt_import_path_says_how_to_write_one():
    with pytest.raises(ValueError, match="'mypkg.engine.MyEngine' is not one of native, vllm, sglang, trtllm; "
                                         "a plugin by import path is package.module:name"):
        check_backend("mypkg.engine.MyEngine")


# --- the loop, the pre-flight and doctor ask the declaration ---------------------------------------

def test_old_logprobs_come_from_the_rollout_when_the_engine_declares_the_trainers_numerics(tmp_path, monkeypatch):
    from polyrl.trainer.loop import use_rollout_logprobs

    module = plugin(tmp_path, monkeypatch, "caps_logprob_engine", '''
        from polyrl.backends import EngineCapabilities
        from polyrl.rollout.native.engine import NativeEngine

        class Exact(NativeEngine):
            capabilities = EngineCapabilities(trainer_logprob_dtypes={"float32"})

        class Undeclared(NativeEngine):
            pass
        ''')
    assert use_rollout_logprobs(job("rollout.backend=native"))
    assert use_rollout_logprobs(job(f"rollout.backend={module}:Exact"))  # was: native only, by name
    assert not use_rollout_logprobs(job(f"rollout.backend={module}:Undeclared"))
    assert not use_rollout_logprobs(job("rollout.backend=native", "rollout.dtype=bfloat16",
                                        "actor.param_dtype=bfloat16", "actor.compute_dtype=bfloat16"))
    assert not use_rollout_logprobs(job("rollout.backend=vllm"))
    assert not use_rollout_logprobs(job(f"rollout.backend={module}:Exact", "rollout.placement=standalone",
                                        "trainer.mode=async"))
    assert use_rollout_logprobs(job(f"rollout.backend={module}:Undeclared", "actor.old_logprobs=rollout"))


def test_preflight_refuses_partial_rollout_on_an_engine_that_declares_none(tmp_path, monkeypatch):
    from polyrl.trainer.preflight import check_engine_capabilities

    module = plugin(tmp_path, monkeypatch, "caps_async_engine", '''
        from polyrl.rollout.native.engine import NativeEngine

        class NoPartial(NativeEngine):
            pass
        ''')
    run = ("rollout.placement=standalone", "trainer.mode=async")
    with pytest.raises(ConfigError) as err:
        check_engine_capabilities(job(f"rollout.backend={module}:NoPartial", *run))
    assert err.value.problems == [
        f"async.partial_rollout=abort: the {module}:NoPartial engine declares no partial_rollout (abort_all "
        "returning each request's tokens so far, continued later); set async.partial_rollout=wait"]
    check_engine_capabilities(job(f"rollout.backend={module}:NoPartial", *run, "async.partial_rollout=wait"))
    check_engine_capabilities(job("rollout.backend=native", *run))


def test_doctor_lists_what_each_engine_can_do(tmp_path, monkeypatch, capsys):
    from polyrl.cli.main import main

    module = plugin(tmp_path, monkeypatch, "caps_doctor_engine", '''
        from polyrl.backends import EngineCapabilities
        from polyrl.rollout.native.engine import NativeEngine

        class Mine(NativeEngine):
            capabilities = EngineCapabilities(sleep=True, trainer_logprob_dtypes={"float32", "bfloat16"})
        ''')
    assert main(["doctor", f"rollout.backend={module}:Mine"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert ("info native engine: can: sleep frees memory, partial rollout, batch-invariant; cannot: tensor "
            "parallel, LoRA adapters, FP8; log-probs equal the trainer's in: float32") in out
    assert (f"info {module}:Mine engine: can: sleep frees memory; cannot: tensor parallel, partial rollout, "
            "LoRA adapters, FP8, batch-invariant; log-probs equal the trainer's in: bfloat16, float32") in out


def test_the_rollout_config_asks_a_plugins_capabilities(tmp_path, monkeypatch):
    from polyrl.rollout.launch_args import check_replica_layout

    module = plugin(tmp_path, monkeypatch, "caps_config_engine", '''
        from polyrl.backends import EngineCapabilities
        from polyrl.rollout.native.engine import NativeEngine

        class Able(NativeEngine):
            capabilities = EngineCapabilities(tensor_parallel=True, lora_adapters=True, fp8=True,
                                              batch_invariant=True)
        ''')
    able = f"{module}:Able"
    RolloutConfig(backend=able, batch_invariant=True)
    RolloutConfig(backend=able, lora_mode="adapter")
    RolloutConfig(backend=able, placement="standalone", quantization="fp8")
    RolloutConfig(backend=able, engine_kwargs={able: {"max_prefill_tokens": 64}})
    check_replica_layout(RolloutConfig(backend=able, placement="standalone", tensor_parallel_size=2))
    # the dry run shows a plugin's arguments as the factory builds them (was: "no launch-argument builder")
    from polyrl.platform import get_platform
    from polyrl.rollout.launch_args import engine_launch_args

    args = engine_launch_args(RolloutConfig(backend=able, max_model_len=64, engine_kwargs={able: {"seed": 3}}),
                              "/m", get_platform("cpu"), colocated=True)
    assert args == {"model_path": "/m", "dtype": "float32", "max_model_len": 64, "max_num_seqs": 256, "seed": 3}
