"""Controlled background load for the `--contention` benchmarks, and what the machine looked like.

A competitor is a separate Python process spinning at normal priority (nice 0): the kind of
neighbour that made the native engine collapse (issue 42: Ray workers of another run, a second
training job). Two loads:

- `pinned`: one competitor bound to the last core this process may use (`os.sched_setaffinity`);
- `unpinned`: one competitor the scheduler moves where it likes.

Both take one core's worth of CPU; on a 2-core machine they leave one free core.

A competitor runs in a session of its own (`start_new_session`), as another job on the machine
does. Linux groups a session's processes for the scheduler (autogroup, on by default on desktop
and many server kernels: /proc/sys/kernel/sched_autogroup_enabled), and a machine's CPU time is
shared between the groups first: a competitor inside the benchmark's own session would take half
of the benchmark's group share wherever other jobs load the machine (on an idle one the two are
the same), which no neighbour in another session does.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

LOADS = ("pinned", "unpinned")
_SPIN = "import os, sys\nif sys.argv[1] != '-': os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass\n"
SETTLE_S = 1.0
"""Wait after starting a competitor: it is running, and the engine's free-core window (0.5 s,
polyrl/rollout/native/threads.py) has seen it, before the first timed call."""


@contextlib.contextmanager
def competitor(load: str):
    """Run one busy competitor for the duration of the block (`load` in `LOADS`)."""
    if load not in LOADS:
        raise ValueError(f"load {load!r}: choose from {', '.join(LOADS)}")
    core = str(max(os.sched_getaffinity(0))) if load == "pinned" else "-"
    proc = subprocess.Popen([sys.executable, "-c", _SPIN, core], stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        time.sleep(SETTLE_S)
        if proc.poll() is not None:
            raise RuntimeError(f"the {load} competitor exited at once (code {proc.returncode})")
        yield proc
    finally:
        proc.kill()
        proc.wait()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def machine() -> dict:
    """Date, CPU, its flags and the load average: the header of every contention table."""
    from logprobs import cpu_flags  # the flags every benchmark prints (same directory)

    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": cpu_model(), "cpu_flags": cpu_flags(), "cores": len(os.sched_getaffinity(0)),
            "load_average": [round(x, 2) for x in os.getloadavg()]}
