"""The tool, environment and black-box agent examples of docs/agents.md run as written on CPU
with the bundled tiny model (one subprocess: the black-box example names its agent `__main__:solve`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a fresh interpreter (torch import) and three rollouts

DOC = Path(__file__).resolve().parents[2] / "docs" / "agents.md"


def examples() -> str:
    text = DOC.read_text()
    levels = text[text.index("## Level 1"):text.index("## Sync and async training")]
    return "\n".join(re.findall(r"```python\n(.*?)```", levels, re.S))


def test_the_three_levels_run_as_written(tmp_path):
    script = tmp_path / "agents_examples.py"
    script.write_text(examples())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(DOC.parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [line for line in done.stdout.splitlines() if line.startswith("{'agent/turns_mean'")]
    assert len(metrics) == 3, done.stdout  # one per level
    assert "'agent/env_reward_mean'" in metrics[1] and "'agent/turns_mean': 2.0" in metrics[2]
