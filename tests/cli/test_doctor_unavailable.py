"""`polyrl doctor` names each capability an installed engine declares but cannot provide on this
platform (`EngineCapabilities.unavailable`, polyrl/backends.py), one line each."""

from __future__ import annotations

import importlib.util

import pytest

from polyrl.backends import ROLLOUT_BACKENDS, VLLM_CPU_NO_ROUTES
from polyrl.cli.doctor import capability_findings
from polyrl.cli.main import main

LINE = (f"vllm engine: routed experts unavailable on cpu: {VLLM_CPU_NO_ROUTES}; runs asking for it here "
        "are refused")


def unavailable_lines(found) -> list[str]:
    return [f"{f.topic}: {f.message}" for f in found if "unavailable on" in f.message]


def test_each_capability_an_engine_build_lacks_here_is_one_warning():
    assert ROLLOUT_BACKENDS.get("vllm").capabilities.routed_experts  # declared for its GPU builds
    found = capability_findings({"vllm": "0.32.0"}, "native", "cpu")
    assert unavailable_lines(found) == [LINE]
    assert [f.level for f in found if "unavailable on" in f.message] == ["warn"]
    assert unavailable_lines(capability_findings({"vllm": "0.32.0"}, "native", "cuda")) == []
    # an engine that is not installed is not described, nor what its build lacks
    assert unavailable_lines(capability_findings({"vllm": None}, "native", "cpu")) == []


def test_doctor_on_this_cpu_machine_lists_it(tmp_path, monkeypatch, capsys):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    info = tmp_path / "vllm-0.32.0.dist-info"  # an installed vLLM as importlib.metadata sees it
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("COLUMNS", "400")  # one finding per line
    main(["doctor"])
    out = capsys.readouterr().out
    assert [line.strip() for line in out.splitlines() if "unavailable on" in line] == [f"warn {LINE}"]
