"""How many intra-op threads the native engine computes with: the cores that are actually free.

Why. torch's CPU kernels (oneDNN's packed matmuls included, matmul.py) split each op across its
OpenMP threads and wait for all of them at the op's end; an idle OpenMP thread spin-waits for the
next op. When one of the cores is shared with a busy process of equal priority, the thread on it
runs only in the slices the scheduler gives it, and every op, hundreds per decode step, waits for
that thread: the whole engine then runs at the speed of its slowest core's slices. Measured on
the 2-core bench machine (docs/benchmarks.md, "Rollout under contention"), 4M fp32 decode with one
busy loop pinned to core 1: 2 threads 414 tok/s, 1 thread 6,065 tok/s (idle with 1 thread: 9,356).
A process at `nice 19` does not do this (the scheduler gives it ~1.5% of a core against ours),
nor does the engine's own process.

The rule (`threads_for`, a pure function; never a timing of our own kernels). Over a window of
/proc/stat samples, each core this process may run on (`os.sched_getaffinity`) contributes its
idle share, and so does this process's own CPU time (it is the time we are about to reuse). Time
in the `nice` column counts as idle for a process at nice 0 (niced work yields to it), as busy
for a niced one (another niced process is its equal, and one at nice 0 takes ~97% of a core it
shares with a nice-15 one: Ray's default worker niceness, which polyrl's actors do not keep,
the env plan's rule `ray-worker-priority` in polyrl/envplan/rules.py). The sum is the number of
free cores `free`; a core counts when at least `FREE_SHARE` of it is free, so the engine uses
floor(free + 1 - FREE_SHARE) threads, at least 1, at most the cores it may run on, the cgroup's
CPU quota and the thread count the process had when the engine was built (a rank's reservation,
`torch.set_num_threads`). One busy competitor on a 2-core machine gives free ~1.0: one thread, on
whichever core the scheduler finds idle.

When. A daemon thread (one per process, alive while an engine follows the free cores) reads
/proc/stat every `SAMPLE_EVERY_S`; at most every `DECIDE_EVERY_S`, at the start of a scheduler step,
the engine re-decides over the last `WINDOW_S`. A competitor that starts or stops is followed
within about half a second, also right after the engine sat idle (the window is always the
latest one, never one spanning the idle gap). The first decision is made when the engine is built
(over `START_WINDOW_S` of its loading). Where /proc/stat cannot be read (not Linux), the engine
keeps the thread count the process had.

The count does not change the engine's numbers at the bench shapes: its tokens and log-probs were
bit-identical at 1 and 2 threads (30M fp32 and bf16, docs/native_engine.md). A run that must not
depend on the machine's load at all pins it: `NativeEngine(num_threads=N)`
(`rollout.engine_kwargs.native.num_threads`).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

FREE_SHARE = 0.75
"""A core counts as free when at least this share of it was idle (or ours) over the window."""
WINDOW_S = 0.5
"""The window a decision reads (/proc/stat counts 10 ms ticks: a shorter one is too coarse)."""
SAMPLE_EVERY_S = 0.1
DECIDE_EVERY_S = 0.25
"""Flapping between counts costs a thread-pool resize, so decisions are this far apart at least."""
START_WINDOW_S = 0.1
"""The window of the first decision, when an engine is built (waited for if building was quicker)."""
STAT_PATH = "/proc/stat"
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"


@dataclass(frozen=True)
class CpuSample:
    """One reading: monotonic wall seconds, this process's CPU seconds (all threads) and, per core,
    (busy ticks, all ticks) from /proc/stat."""

    wall_s: float
    own_cpu_s: float
    ticks: Mapping[int, tuple[int, int, int]]


def parse_proc_stat(text: str) -> dict[int, tuple[int, int, int]]:
    """Per core (`cpuN` lines): (busy ticks, nice ticks, all ticks). Busy is user + system +
    irq + softirq + steal (a hypervisor's stolen time is not ours to use); idle and iowait are
    free. guest time is already inside user / nice, so it is not added again."""
    out = {}
    for line in text.splitlines():
        if not (line.startswith("cpu") and line[3:4].isdigit()):
            continue
        name, *fields = line.split()
        user, nice, system, idle, iowait, irq, softirq, steal = ([int(f) for f in fields[:8]] + [0] * 8)[:8]
        busy = user + system + irq + softirq + steal
        out[int(name[3:])] = (busy, nice, busy + nice + idle + iowait)
    return out


def free_cores(before: CpuSample, after: CpuSample, allowed: Collection[int], niced: bool) -> float | None:
    """Cores' worth of CPU free for this process between two samples: the idle share of each
    allowed core (the `nice` column idle for a process at nice 0, busy for a `niced` one), plus
    this process's own CPU share (counted busy by the kernel, ours to reuse). None when the
    samples hold none of the allowed cores or no tick passed."""
    wall = after.wall_s - before.wall_s
    free, counted = 0.0, 0
    for cpu in allowed:
        if cpu not in before.ticks or cpu not in after.ticks:
            continue
        busy, nice, total = (a - b for a, b in zip(after.ticks[cpu], before.ticks[cpu]))
        if total <= 0:
            continue
        free += 1.0 - min(max((busy + nice if niced else busy) / total, 0.0), 1.0)
        counted += 1
    if counted == 0 or wall <= 0:
        return None
    free += max(after.own_cpu_s - before.own_cpu_s, 0.0) / wall
    return min(free, float(counted))


def threads_for(free: float | None, allowed: int, limit: int) -> int:
    """The thread count: one per core that is at least `FREE_SHARE` free, at least 1, at most the
    `allowed` cores and `limit` (the quota / the count the process had). `free` None (unknown):
    the most allowed."""
    most = max(1, min(allowed, limit))
    if free is None:
        return most
    return max(1, min(most, math.floor(free + 1.0 - FREE_SHARE + 1e-9)))


def take_sample() -> CpuSample | None:
    try:
        with open(STAT_PATH) as f:
            ticks = parse_proc_stat(f.read())
    except OSError:
        return None
    return CpuSample(time.monotonic(), time.process_time(), ticks) if ticks else None


def allowed_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def cgroup_cpu_limit(path: str | None = None) -> int | None:
    """Whole CPUs the cgroup v2 quota grants (`cpu.max`: "QUOTA PERIOD" or "max PERIOD"), at
    least 1; None without a quota. A thread past the quota is throttled, not run."""
    try:
        with open(path or CGROUP_CPU_MAX) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, int(quota) // max(int(period), 1))


def window_start(samples: Sequence[CpuSample], now: float, length: float) -> CpuSample | None:
    """The newest sample at least `length` seconds before `now` (the samples oldest first)."""
    for sample in reversed(samples):
        if now - sample.wall_s >= length:
            return sample
    return None


class _Sampler:
    """The process's /proc/stat reader: one daemon thread, recording a sample every
    `SAMPLE_EVERY_S` while any `FreeCoreThreads` that follows the free cores is alive."""

    def __init__(self):
        self.samples: deque[CpuSample] = deque(maxlen=int(4 * WINDOW_S / SAMPLE_EVERY_S))
        self.users: weakref.WeakSet = weakref.WeakSet()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def register(self, user: "FreeCoreThreads") -> bool:
        """Start following for `user`; False where /proc/stat cannot be read."""
        first = take_sample()
        if first is None:
            return False
        with self.lock:
            self.users.add(user)
            self.samples.append(first)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="polyrl-free-cores", daemon=True)
                self.thread.start()
        return True

    def _run(self) -> None:
        while True:
            time.sleep(SAMPLE_EVERY_S)
            sample = take_sample()
            with self.lock:
                if not self.users:  # every engine is gone; the next one starts a new thread
                    self.thread = None
                    return
                if sample is not None:
                    self.samples.append(sample)

    def window(self, length: float) -> tuple[CpuSample, CpuSample] | None:
        """(start, now) over the latest `length` seconds, or None before that long has been seen."""
        now = take_sample()
        if now is None:
            return None
        with self.lock:
            start = window_start(list(self.samples), now.wall_s, length)
        return None if start is None else (start, now)


_SAMPLER = _Sampler()


class FreeCoreThreads:
    """The engine's intra-op thread count: `fixed` if given, else the free-core rule above.
    `apply()` sets the calling thread's torch count to it (torch keeps one per thread)."""

    def __init__(self, fixed: int | None = None):
        if fixed is not None and (isinstance(fixed, bool) or not isinstance(fixed, int) or fixed < 1):
            raise ValueError(f"num_threads={fixed!r} must be a positive int, or None to follow the free cores")
        self.fixed = fixed
        self.limit = torch.get_num_threads()  # the reservation the process was given
        quota = cgroup_cpu_limit()
        if quota is not None:
            self.limit = min(self.limit, quota)
        self.allowed = allowed_cpus()
        self.free: float | None = None
        """Free cores at the latest decision (None: none made)."""
        self.count = fixed if fixed is not None else threads_for(None, len(self.allowed), self.limit)
        self.follows = fixed is None and _SAMPLER.register(self)
        self._born = time.monotonic()
        self._decided = float("-inf")

    def start(self) -> None:
        """The first decision, over the engine's loading (at least `START_WINDOW_S`)."""
        if not self.follows:
            return
        wait = START_WINDOW_S - (time.monotonic() - self._born)
        if wait > 0:
            time.sleep(wait)
        self._decide(min(time.monotonic() - self._born, WINDOW_S))

    def refresh(self) -> int:
        """Re-decide if `DECIDE_EVERY_S` has passed; the count in effect."""
        if self.follows and time.monotonic() - self._decided >= DECIDE_EVERY_S:
            self._decide(WINDOW_S)
        return self.count

    def _decide(self, length: float) -> None:
        self._decided = time.monotonic()
        window = _SAMPLER.window(length)
        if window is None:
            return
        free = free_cores(*window, self.allowed, niced=_niceness() > 0)
        if free is not None:
            self.free = free
            self.count = threads_for(free, len(self.allowed), self.limit)

    def apply(self) -> int:
        """Set this thread's torch intra-op count to the current one; the count it had."""
        before = torch.get_num_threads()
        if before != self.count:
            torch.set_num_threads(self.count)
        return before

    @contextlib.contextmanager
    def applied(self):
        """The block runs at the count decided on entry (a training rank's update: one decision
        per update); the thread's own count comes back after it."""
        self.refresh()
        with torch_threads(self.count):
            yield self.count


@contextlib.contextmanager
def torch_threads(count: int | None):
    """The block runs at `count` torch intra-op threads (None: as it is); the calling thread's
    count comes back after it."""
    before = torch.get_num_threads()
    if count is None or count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _niceness() -> int:
    try:
        return os.getpriority(os.PRIO_PROCESS, 0)
    except (AttributeError, OSError):
        return 0
