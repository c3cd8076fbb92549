"""Waiting on a real `polyrl train` / `polyrl sft` process the interrupt tests signal: on its log
pipe and metrics file, never on a clock (tests/trainer/test_interrupt.py,
tests/sft/test_sft_interrupt.py)."""

from __future__ import annotations

import re
import select
import subprocess
from pathlib import Path

import pytest


def wait_for(proc: subprocess.Popen, pattern: re.Pattern) -> str:
    """Read the process's log until a line matches `pattern`; what was read comes back."""
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if pattern.search(line):
            return "".join(seen)
    proc.wait()
    pytest.fail(f"exited ({proc.returncode}) before logging {pattern.pattern!r}:\n{''.join(seen)[-4000:]}")


def wait_for_lines(proc: subprocess.Popen, metrics: Path, lines: int) -> str:
    """Drain the process's log until `metrics` holds `lines` lines (one per logged step),
    checking the file whenever the log is quiet for 0.5 s; what was read comes back."""
    seen = []
    while not (metrics.is_file() and metrics.read_text().count("\n") >= lines):
        ready, _, _ = select.select([proc.stderr], [], [], 0.5)
        if ready:
            line = proc.stderr.readline()
            if not line:
                proc.wait()
                pytest.fail(f"exited ({proc.returncode}) before {lines} metrics lines:\n"
                            f"{''.join(seen)[-4000:]}")
            seen.append(line)
    return "".join(seen)


def finish(proc: subprocess.Popen, seen: str) -> str:
    """The rest of the log once the process exits (killed, and the test failed, if it is still
    running 200 s after the signal: never leave a training process behind)."""
    try:
        _, rest = proc.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, rest = proc.communicate()
        pytest.fail(f"still running 200 s after the signal:\n{(seen + rest)[-4000:]}")
    return seen + rest
