"""`polyrl env` and `polyrl doctor` as a user runs them: one real subprocess of each (the env
table, the doctor on this machine); the other runs go in-process through polyrl.cli.main.main,
the function `python -m polyrl` exits with (the same code path without a new interpreter
importing torch, ~4 s of CPU each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from polyrl.cli.doctor import check_environment
from polyrl.distributed.topologies import COLOCATED, DISAGGREGATED
from polyrl.platform import SIMULATED_PROBES, get_platform


def polyrl(*args, env=None):
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "polyrl", *args], capture_output=True,
                          text=True, env=full_env, timeout=120)


@pytest.fixture
def polyrl_here(capsys, monkeypatch):
    """`polyrl ARGS` in this process, with `env` set in os.environ for the call."""
    from polyrl.cli.main import main

    def run(*args, env=None):
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        code = main(list(args))
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    return run


def test_env_json_rocm_sglang_keeps_user_value(polyrl_here):
    out = polyrl_here("env", "--platform", "rocm", "--backend", "sglang", "--json",
                 env={"SGLANG_USE_AITER": "0"})
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["SGLANG_USE_AITER"]["value"] == "0"
    assert plan["SGLANG_USE_AITER"]["source"] == "user-env"
    assert plan["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] == {
        "value": "0", "source": "platform-default",
        "reason": plan["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"]["reason"],
        "link": "https://github.com/verl-project/verl/pull/6664"}
    for entry in plan.values():
        assert set(entry) >= {"value", "source", "reason"}


def test_env_capability_simulation_and_config_env(polyrl_here, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("env:\n  NCCL_NVLS_ENABLE: '1'\n")
    out = polyrl_here("env", "--role", "job", "--capability", "10.0", "--json", "-c", str(cfg),
                 env={"TLLM_DISABLE_NVLS_MNNVL": "1"})
    plan = json.loads(out.stdout)
    assert plan["NCCL_NVLS_ENABLE"]["source"] == "config"
    assert plan["NCCL_MNNVL_ENABLE"]["source"] == "rule:blackwell-nvls-mnnvl-off"


def test_env_table_and_bad_flags(polyrl_here):
    out = polyrl("env", "--platform", "cuda", "--backend", "vllm", "--placement", "standalone")
    assert out.returncode == 0
    assert "NCCL_CUMEM_ENABLE" in out.stdout and "rule:nccl-cumem-off" in out.stdout
    # a reason's brackets are text, not rich markup (the CPU plan's malloc rule names a shape)
    cpu = polyrl_here("env", "--platform", "cpu", env={"COLUMNS": "400"})
    assert "[batch, response, vocab]" in cpu.stdout

    def bad(*args) -> str:
        out = polyrl_here("env", *args)
        assert out.returncode == 2
        return out.stderr

    assert "--capability" in bad("--capability", "ten")
    assert "registered platforms: cpu, cuda, rocm, npu" in bad("--platform", "tpu")
    assert "rollout.backend: 'vlm' is not one of native, vllm, sglang, trtllm" in bad("rollout.backend=vlm")


def test_doctor_on_this_machine():
    out = polyrl("doctor")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "platform: cpu" in out.stdout
    assert "torch:" in out.stdout


def test_doctor_exits_nonzero_on_errors(polyrl_here):
    out = polyrl_here("doctor", env={"RAY_ADDRESS": "127.0.0.1:1"})
    assert out.returncode == 1
    assert "not reachable" in out.stdout


def test_doctor_known_bad_combinations():
    cuda = get_platform(None, SIMULATED_PROBES["h100"])
    found = check_environment(cuda, {"NCCL_CUMEM_ENABLE": "1"}, DISAGGREGATED, "vllm")
    assert [f.level for f in found] == ["warn"]
    assert check_environment(cuda, {"NCCL_CUMEM_ENABLE": "1"}, COLOCATED, "vllm") == []
    assert check_environment(cuda, {"CUDA_VISIBLE_DEVICES": ""}, COLOCATED)[0].level == "error"
    rocm = get_platform(None, SIMULATED_PROBES["mi300x"])
    assert check_environment(rocm, {"HIP_VISIBLE_DEVICES": ""}, COLOCATED)[0].level == "error"
    gb200 = get_platform(None, SIMULATED_PROBES["gb200"])
    assert check_environment(gb200, {"TLLM_DISABLE_NVLS_MNNVL": "1"}, COLOCATED)[0].level == "warn"
    assert check_environment(cuda, {"TLLM_DISABLE_NVLS_MNNVL": "1"}, COLOCATED)[0].level == "info"


def test_doctor_names_an_engine_outside_its_supported_range(polyrl_here, tmp_path, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    info = tmp_path / "sglang-0.5.4.dist-info"  # an installed sglang 0.5.4 as importlib sees it
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.4\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    line = ('rollout.backend=sglang: sglang 0.5.4 is outside the versions polyrl supports '
            '(sglang>=0.5.6,<0.6): pip install "sglang>=0.5.6,<0.6"')
    out = polyrl_here("doctor")  # another backend runs: a warning
    assert out.returncode == 0, out.stdout
    assert f"warn sglang: {line}" in " ".join(out.stdout.split())  # rich wraps long lines
    out = polyrl_here("doctor", "rollout.backend=sglang")  # the run's own engine: an error
    assert out.returncode == 1
    assert f"error sglang: {line}" in " ".join(out.stdout.split())
