"""Ctrl-C / SIGTERM during training: finish the step, checkpoint, stop cleanly.

The first signal only raises a flag the loop checks between steps (a step killed halfway would
leave the engine and the optimizer out of step). A second Ctrl-C abandons the step at once.
Outside the loop (start-up: loading data, starting Ray, loading the model) there is no step to
finish, so `abort_on_signals` stops at once with a message. Either way the exit code is the
shell's convention for a signal, 128 + its number (`EXIT_CODES`, docs/training.md).
"""

from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager
from typing import Iterator

logger = logging.getLogger(__name__)


EXIT_CODES = {
    0: "finished: every step ran (summary.json written)",
    1: "crashed: an unexpected error, printed with its traceback (please report it)",
    2: "bad input: config, data, model or set-up error, printed as one line",
    128 + signal.SIGINT: "Ctrl-C (SIGINT): stopped after the current step with a checkpoint, or "
                         "at once on a second Ctrl-C or during start-up",
    128 + signal.SIGTERM: "SIGTERM: stopped after the current step with a checkpoint, or at once "
                          "during start-up",
}
"""Every exit code of `polyrl train`; docs/training.md prints the same table."""


class TrainingInterrupted(RuntimeError):
    def __init__(self, message: str, exit_code: int):
        self.exit_code = exit_code
        super().__init__(message)


class StartupInterrupted(BaseException):
    """A signal outside the training loop. A BaseException, like KeyboardInterrupt, because it
    is raised wherever the main thread happens to be (inside Ray's or transformers' start-up
    code), and an `except Exception` there must not swallow it."""

    def __init__(self, message: str, exit_code: int):
        self.exit_code = exit_code
        super().__init__(message)


class StepAbandoned(StartupInterrupted):
    """A second SIGTERM while a step does not finish: stopped at once, without a checkpoint. A
    BaseException (as StartupInterrupted, which callers already handle), so an `except Exception`
    it lands in cannot swallow it: the second signal may arrive while the first one's handler is
    still inside a logging handler, which catches every Exception."""


class StopFlag:
    def __init__(self):
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)


@contextmanager
def stop_on_signals() -> Iterator[StopFlag]:
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag  # signal handlers can only be installed from the main thread
        return

    def handler(signum, frame):
        if flag.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if flag.requested and signum == signal.SIGTERM:  # the step does not finish (a plugin that hangs)
            raise StepAbandoned("second SIGTERM: abandoned the current step without a checkpoint; rerun "
                                "the same command (trainer.resume=auto) to continue from the last "
                                "checkpoint", 128 + signal.SIGTERM)
        flag.signum = signum
        logger.warning("%s received: finishing the current step, then stopping "
                       "(the same signal again abandons it)", signal.Signals(signum).name)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextmanager
def abort_on_signals() -> Iterator[None]:
    """Until the training loop takes over (`stop_on_signals`, which restores this on exit): a
    Ctrl-C or SIGTERM raises `StartupInterrupted` at once, exit code 128 + the signal."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        name = signal.Signals(signum).name
        raise StartupInterrupted(f"{name} received outside the training loop (during start-up or "
                                  "shut-down): stopped at once, no step was interrupted", 128 + signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
