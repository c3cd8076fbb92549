"""A rollout backend from another package really plugs in: installed with an entry point in the
`polyrl.rollout_backends` group, with no change to polyrl, the config accepts it, the factory
builds and runs it, and the environment plan and `polyrl doctor` see it.

The plugin is a real distribution (a dist-info with entry_points.txt) on a fresh interpreter's
path, so discovery goes through importlib.metadata exactly as for a pip-installed plugin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from polyrl.backends import ROLLOUT_BACKENDS, RolloutBackend, register_backend
from polyrl.rollout.config import RolloutConfig

PLUGIN = '''
from polyrl.rollout.native.engine import NativeEngine


class ToyEngine(NativeEngine):
    """A third-party engine: here the built-in engine under another name."""
'''

CHECK = '''
import asyncio, json
import torch
from polyrl.cli.doctor import packages
from polyrl.envplan import BACKENDS, PlanContext, build_plan
from polyrl.platform import get_platform
from polyrl.rollout.base import ROLLOUT_ENGINES, SamplingParams
from polyrl.rollout.config import RolloutConfig
from polyrl.rollout.factory import build_disaggregated_engine, require_backend

cfg = RolloutConfig(backend="toy", max_model_len=64, engine_kwargs={"toy": {}})
require_backend("toy")
engine = build_disaggregated_engine(cfg, "builtin:tiny-arith", torch.device("cpu"), seed=1)
out = asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), "r1"))
plan = build_plan(PlanContext(get_platform("cpu"), "rollout", backend="toy", placement="disaggregated", mode="sync"),
                  {}, {})
print(json.dumps({"engine": type(engine).__name__, "tokens": len(out[0].token_ids),
                  "in_env_choices": "toy" in BACKENDS, "engines": ROLLOUT_ENGINES.names(),
                  "plan_backend": plan.context.backend, "doctor": list(packages())}))
'''


def install_plugin(site: Path) -> None:
    (site / "toy_engine_plugin.py").write_text(textwrap.dedent(PLUGIN))
    info = site / "toy_engine_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-engine-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[polyrl.rollout_backends]\ntoy = toy_engine_plugin:ToyEngine\n")


def test_an_installed_plugin_backend_is_configured_built_and_run(tmp_path):
    install_plugin(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["engine"] == "ToyEngine" and got["tokens"] == 4
    assert got["in_env_choices"] and got["plan_backend"] == "toy" and got["engines"] == ["native", "vllm", "sglang", "trtllm", "toy"]
    assert got["doctor"][:3] == ["torch", "ray", "transformers"]


def test_without_the_plugin_the_backend_is_a_one_line_config_error():
    with pytest.raises(ValueError) as err:
        RolloutConfig(backend="toy")
    assert "'toy' is not one of native, vllm, sglang, trtllm" in str(err.value)


def test_register_backend_wants_a_dotted_path_and_refuses_duplicates():
    with pytest.raises(ValueError, match="dotted path 'module:Class'"):
        register_backend("bad", "toy_engine_plugin.ToyEngine")
    with pytest.raises(KeyError, match="already registered"):
        register_backend("native", "polyrl.rollout.native.engine:NativeEngine")
    assert "bad" not in ROLLOUT_BACKENDS


def test_the_built_in_backends_carry_what_the_derived_lists_need():
    vllm = ROLLOUT_BACKENDS.get("vllm")
    assert vllm == RolloutBackend("vllm", "polyrl.rollout.engines.vllm:VLLMEngine", "vllm", "vllm", True, ">=0.10.1,<0.34",
                                  capabilities=vllm.capabilities)
    assert vllm.capabilities.tensor_parallel and vllm.capabilities.lora_adapters
    native = ROLLOUT_BACKENDS.get("native")
    assert native.package is None and not native.engine_processes
    assert native.engine_class().__name__ == "NativeEngine"
