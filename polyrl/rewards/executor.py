"""A small thread pool whose calls can time out without blocking the pool or the process.

Why threads and not processes: the built-in scorers take microseconds to milliseconds, so
spawning (or even pickling to) a process per sample would cost more than the scoring. The price is
that a Python thread cannot be killed: a call that runs past its timeout is *abandoned* - its
result is ignored, its worker retires when (if ever) the call returns, and a fresh worker takes its
place so throughput does not degrade. Workers are daemon threads, so a call stuck forever cannot
block interpreter exit (concurrent.futures.ThreadPoolExecutor joins its threads at exit).
The timeout clock of a call starts when a worker picks it up, not when it is queued.

Abandoned threads are bounded: at most `max_stuck` may still be running at once. Past that no
replacement is started, so a scorer that never returns cannot leak one thread per call; while
every worker is stuck, queued calls are cancelled and reported as timed out. A stuck thread that
finally returns frees its place and the pool grows back to `num_workers`.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, Callable

_ids = itertools.count()
logger = logging.getLogger(__name__)


class _Worker(threading.Thread):
    def __init__(self, tasks: "queue.SimpleQueue[Any]"):
        super().__init__(name=f"polyrl-reward-{next(_ids)}", daemon=True)
        self.tasks = tasks
        self.retired = False

    def run(self) -> None:
        while not self.retired:
            item = self.tasks.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            future.worker = self
            future.started_at = time.monotonic()  # set last: the waiter reads it first
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - delivered to the caller
                future.set_exception(exc)


class TimeoutPool:
    def __init__(self, num_workers: int, max_stuck: int | None = None):
        self._tasks: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._stuck: list[_Worker] = []
        self.num_workers = num_workers
        self.max_stuck = 4 * num_workers if max_stuck is None else max_stuck
        self.abandoned = 0
        """Calls that ran past their timeout (their threads may still be running)."""
        self._said_full = False
        for _ in range(num_workers):
            self._spawn()

    @property
    def threads(self) -> int:
        """Threads this pool has alive: working, idle or stuck in an abandoned call."""
        with self._lock:
            self._forget_returned()
            return len(self._workers) + len(self._stuck)

    def _spawn(self) -> None:
        worker = _Worker(self._tasks)
        self._workers.append(worker)
        worker.start()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        self._tasks.put((future, fn, args, kwargs))
        return future

    def run_all(self, futures: list[Future], timeout_s: float) -> list[bool]:
        """Wait for `futures`; returns per future whether it timed out (those are abandoned)."""
        timed_out = [False] * len(futures)
        index = {id(f): i for i, f in enumerate(futures)}
        pending = set(futures)
        poll = min(0.05, timeout_s / 4)
        while pending:
            _, pending = wait(pending, timeout=poll, return_when=FIRST_COMPLETED)
            if not self._replenish():  # every thread stuck: nobody will pick these up
                for future in list(pending):
                    if future.cancel():
                        pending.discard(future)
                        timed_out[index[id(future)]] = True
            now = time.monotonic()
            for future in list(pending):
                started = getattr(future, "started_at", None)
                if started is not None and now - started > timeout_s and not future.done():
                    pending.discard(future)
                    timed_out[index[id(future)]] = True
                    self._abandon(future)
        return timed_out

    def _abandon(self, future: Future) -> None:
        with self._lock:
            self.abandoned += 1
            worker = future.worker
            worker.retired = True  # exits after its stuck call returns
            self._workers.remove(worker)
            self._stuck.append(worker)
        self._replenish()

    def _replenish(self) -> int:
        """Start workers up to `num_workers` while the stuck ones leave room; returns how many
        workers can take calls now."""
        with self._lock:
            self._forget_returned()
            room = self.num_workers + self.max_stuck - len(self._workers) - len(self._stuck)
            for _ in range(max(0, min(self.num_workers - len(self._workers), room))):
                self._spawn()
            if not self._workers and not self._said_full:
                self._said_full = True
                logger.error("%d reward calls are stuck (each past its timeout, its thread still "
                             "running): no more threads are started, and calls score 0 as "
                             "timeouts until one returns; fix the reward function", len(self._stuck))
            return len(self._workers)

    def _forget_returned(self) -> None:
        self._stuck = [w for w in self._stuck if w.is_alive()]

    def shutdown(self) -> None:
        with self._lock:
            for _ in self._workers:
                self._tasks.put(None)
            self._workers.clear()
