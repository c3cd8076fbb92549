"""`gather` waits in slices, so a signal reaches its Python handler while ranks hang."""

from __future__ import annotations

import os
import signal

import pytest

from polyrl.distributed.waits import RemoteTimeout, gather


class Signalled(Exception):
    pass


def test_signal_during_a_long_gather_reaches_its_handler(ray_session):
    ray = ray_session

    @ray.remote(num_cpus=0)
    class StuckRank:
        def set_up(self, driver_pid: int) -> None:
            import threading

            os.kill(driver_pid, signal.SIGUSR1)  # the user's Ctrl-C / SIGTERM, while set-up hangs
            threading.Event().wait()  # never set: a rank stuck in set-up

    def raise_signalled(signum, frame):
        raise Signalled()

    previous = signal.signal(signal.SIGUSR1, raise_signalled)
    rank = StuckRank.remote()
    try:
        # one 600 s ray.wait held the handler until the wait returned: this test's timeout
        # (pyproject's 300 s) ended it first
        with pytest.raises(Signalled):
            gather([rank.set_up.remote(os.getpid())], ["rank 0"], phase="set-up", timeout_s=600)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        ray.kill(rank)


def test_timeout_names_the_missing(ray_session):
    ray = ray_session

    @ray.remote(num_cpus=0)
    def hang():
        import threading

        threading.Event().wait()

    ref = hang.remote()
    with pytest.raises(RemoteTimeout, match="rank 3"):
        gather([ref], ["rank 3"], phase="set-up", timeout_s=1.5)
    ray.cancel(ref, force=True)
