"""Collectives with a deadline that, on expiry, say who did not arrive and what they were doing.

A stuck collective cannot tell you who is missing: every rank in it just waits. So each rank
also writes a heartbeat to a side channel that does not depend on the collective, the
torch.distributed store (TCPStore / FileStore) the process group was created with:

    <prefix>/last/<rank>            what the rank entered last, anywhere: step, phase, time
    <prefix>/seq/<group>/<rank>     how many collectives the rank has entered on that group

Ranks of a group enter its collectives in the same order, so "arrived" means: the rank's
counter on this group has reached mine. On expiry the ranks that have not are named, each with
its last (step, phase) and how long ago that was. The error is raised instead of hanging; the
group is then unusable (the abandoned operation still sits in the backend), so the caller fails
the step. A backend error (a peer process died) is reported the same way.

Ray waits (remote calls, queues) go through `polyrl.distributed.waits` and `queue_get` below.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch.distributed as dist

from polyrl.distributed.waits import RemoteTimeout, gather  # noqa: F401  (re-exported)

PREFIX = "polyrl/watchdog"


@dataclass(frozen=True)
class Heartbeat:
    rank: int
    step: int
    phase: str
    time: float

    def describe(self, now: float | None = None) -> str:
        ago = (now or time.time()) - self.time
        return f"step {self.step} '{self.phase}' ({ago:.1f}s ago)"


class CollectiveError(RuntimeError):
    """A collective that did not complete. `missing` maps each rank that did not arrive to its
    last heartbeat (None: it never wrote one)."""

    def __init__(self, what: str, phase: str, step: int, members: Sequence[int],
                 missing: dict[int, Heartbeat | None], detail: str,
                 arrived: dict[int, Heartbeat | None] | None = None):
        self.phase, self.step, self.members, self.missing = phase, step, list(members), missing
        if missing:
            names = ", ".join(str(r) for r in sorted(missing))
            tail = f"rank(s) {names} did not arrive (last seen: {_seen(missing)})"
        else:
            seen = f" (last seen: {_seen(arrived)})" if arrived else ""
            tail = f"every rank entered it{seen}; one died inside it or the backend stalled"
        super().__init__(f"{what} at step {step} '{phase}' over ranks {list(members)}: {detail}; {tail}")


def _seen(beats: dict[int, Heartbeat | None]) -> str:
    now = time.time()
    return "; ".join(f"rank {r}: " + (hb.describe(now) if hb else "no heartbeat (never entered a "
                                      "watched collective, or no shared store)")
                     for r, hb in sorted(beats.items()))


class CollectiveTimeout(CollectiveError, TimeoutError):
    """The deadline passed before the collective completed."""


class Watchdog:
    """Heartbeats plus deadline waits for one rank. One per process; cheap to call per op."""

    def __init__(self, store: Any | None, rank: int, *, step: int = 0, prefix: str = PREFIX):
        self.store, self.rank, self.step, self.prefix = store, rank, step, prefix
        self._seq: dict[str, int] = {}
        self._lock = threading.Lock()

    # --- heartbeats --------------------------------------------------------------------------
    def set_step(self, step: int) -> None:
        self.step = step

    def beat(self, phase: str, group_key: str | None = None) -> int:
        """Record that this rank enters `phase` (on `group_key`'s next collective, if given)."""
        with self._lock:
            seq = 0
            if group_key is not None:
                seq = self._seq[group_key] = self._seq.get(group_key, 0) + 1
            if self.store is not None:
                record = json.dumps({"step": self.step, "phase": phase, "time": time.time()})
                self.store.set(f"{self.prefix}/last/{self.rank}", record)
                if group_key is not None:
                    self.store.set(f"{self.prefix}/seq/{group_key}/{self.rank}", str(seq))
            return seq

    def last_seen(self, rank: int) -> Heartbeat | None:
        value = self._read(f"{self.prefix}/last/{rank}")
        if value is None:
            return None
        d = json.loads(value)
        return Heartbeat(rank, int(d["step"]), str(d["phase"]), float(d["time"]))

    def not_arrived(self, members: Sequence[int], group_key: str, seq: int) -> dict[int, Heartbeat | None]:
        """Members whose counter on `group_key` is below `seq`, with their last heartbeat."""
        if self.store is None:  # no side channel: every other member is a suspect
            return {r: None for r in members if r != self.rank}
        missing = {}
        for r in members:
            value = self._read(f"{self.prefix}/seq/{group_key}/{r}")
            if value is None or int(value) < seq:
                missing[r] = self.last_seen(r)
        return missing

    def _read(self, key: str) -> str | None:
        try:  # store.get blocks until the key exists; check first
            if not self.store.check([key]):
                return None
            return self.store.get(key).decode()
        except Exception:  # a dead store must not hide the real error
            return None

    # --- deadline waits ----------------------------------------------------------------------
    def watch(self, group: Any, *, phase: str, timeout_s: float, what: str = "collective") -> "Watch":
        """Enter the next collective(s) on `group`: writes the heartbeat and starts the deadline.
        Wait on each async Work with `watch.wait(work)`."""
        return Watch(self, group, phase, timeout_s, what)

    def run(self, start: Callable[[], Any], *, group: Any, phase: str, timeout_s: float,
            what: str = "collective") -> Any:
        """Start an async collective (`start()` returns its Work, or a list of Works) and wait
        for it with a deadline. Raises CollectiveTimeout / CollectiveError naming the ranks that
        did not arrive."""
        watch = self.watch(group, phase=phase, timeout_s=timeout_s, what=what)
        try:
            works = start()
        except Exception as exc:
            raise watch.error(exc) from exc
        for work in works if isinstance(works, (list, tuple)) else [works]:
            watch.wait(work)
        return works


class Watch:
    """One watched entry into a group: a heartbeat, a deadline, and the error if it passes."""

    def __init__(self, dog: Watchdog, group: Any, phase: str, timeout_s: float, what: str):
        self.dog, self.phase, self.timeout_s, self.what = dog, phase, timeout_s, what
        self.members = dist.get_process_group_ranks(group)
        self.key = group_key(group)
        self.seq = dog.beat(phase, self.key)
        self.deadline = time.monotonic() + timeout_s

    def wait(self, work: Any) -> None:
        if work is None:
            return
        left = max(self.deadline - time.monotonic(), 0.001)
        try:
            work.wait(timeout=datetime.timedelta(seconds=left))
        except Exception as exc:  # gloo: RuntimeError "Operation timed out!" or a peer reset
            raise self.error(exc) from exc

    def error(self, exc: BaseException) -> CollectiveError:
        timed_out = time.monotonic() >= self.deadline or "timed out" in str(exc).lower()
        cls = CollectiveTimeout if timed_out else CollectiveError
        detail = (f"no completion after {self.timeout_s:g}s" if timed_out
                  else f"backend error ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
        missing = self.dog.not_arrived(self.members, self.key, self.seq)
        others = {r: self.dog.last_seen(r) for r in self.members if r != self.dog.rank}
        return cls(self.what, self.phase, self.dog.step, self.members, missing, detail,
                   arrived=None if missing else others)


def group_key(group: Any) -> str:
    """A name for `group` that every member computes identically."""
    name = getattr(group, "group_name", None)
    return str(name) if name else "-".join(map(str, dist.get_process_group_ranks(group)))


# --- one watchdog per process ------------------------------------------------------------------

_DEFAULT: dict[int, Watchdog] = {}


def default_watchdog() -> Watchdog:
    """The process's watchdog, writing heartbeats to the default process group's store.

    Built on first use (never at import) and cached for the life of the default group.
    """
    if not dist.is_initialized():
        raise RuntimeError("the watchdog needs torch.distributed initialised (init_process_group)")
    world = dist.group.WORLD
    key = id(world)
    if key not in _DEFAULT:
        _DEFAULT.clear()
        try:  # the store the default group was created with; private but stable since torch 1.x
            store = dist.distributed_c10d._get_default_store()
        except Exception:
            store = None
        _DEFAULT[key] = Watchdog(store, dist.get_rank())
    return _DEFAULT[key]


def set_default_watchdog(watchdog: Watchdog) -> None:
    """Use `watchdog` (its store, its step counter) for collectives that are not given one."""
    if not dist.is_initialized():
        raise RuntimeError("set_default_watchdog needs torch.distributed initialised")
    _DEFAULT.clear()
    _DEFAULT[id(dist.group.WORLD)] = watchdog


# --- Ray queues ----------------------------------------------------------------------------------

def queue_get(queue: Any, *, phase: str, timeout_s: float, source: str) -> Any:
    """`queue.get()` (a `ray.util.queue.Queue` or `queue.Queue`) with a deadline; on expiry a
    RemoteTimeout names `source`, the producer that did not deliver."""
    import queue as std_queue  # ray.util.queue.Empty subclasses queue.Empty

    try:
        return queue.get(block=True, timeout=timeout_s)
    except std_queue.Empty:
        raise RemoteTimeout(phase, [source], timeout_s) from None
