"""Ctrl-C / SIGTERM during training: finish the step, checkpoint, stop cleanly.

The first signal only raises a flag the loop checks between steps (a step killed halfway would
leave the engine and the optimizer out of step). A second Ctrl-C abandons the step at once.
"""

from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager
from typing import Iterator

logger = logging.getLogger(__name__)


class TrainingInterrupted(RuntimeError):
    def __init__(self, message: str, exit_code: int):
        self.exit_code = exit_code
        super().__init__(message)


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
        flag.signum = signum
        logger.warning("%s received: finishing the current step, then stopping "
                       "(Ctrl-C again to abandon it)", signal.Signals(signum).name)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
