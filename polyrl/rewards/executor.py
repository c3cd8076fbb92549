"""A small thread pool whose calls can time out without blocking the pool or the process.

Why threads and not processes: the built-in scorers take microseconds to milliseconds, so
spawning (or even pickling to) a process per sample would cost more than the scoring. The price is
that a Python thread cannot be killed: a call that runs past its timeout is *abandoned* - its
result is ignored, its worker retires when (if ever) the call returns, and a fresh worker takes its
place so throughput does not degrade. Workers are daemon threads, so a call stuck forever cannot
block interpreter exit (concurrent.futures.ThreadPoolExecutor joins its threads at exit).
The timeout clock of a call starts when a worker picks it up, not when it is queued.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, Callable

_ids = itertools.count()


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
    def __init__(self, num_workers: int):
        self._tasks: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self.abandoned = 0
        """Calls that ran past their timeout (their threads may still be running)."""
        for _ in range(num_workers):
            self._spawn()

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
            self._spawn()

    def shutdown(self) -> None:
        with self._lock:
            for _ in self._workers:
                self._tasks.put(None)
            self._workers.clear()
