"""Plugins that never return, in a real `polyrl train`: an advantage estimator hanging on the
driver (no Ray: the driver is what hangs) ends on a second SIGTERM with exit 143 and one line, and
a policy loss hanging in a Ray rank is reported as the update's own timeout, not as the shut-down's
that follows it. The tests wait on log lines and marker lines, never on a clock."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from signal_runs import finish, wait_for

PLUGIN = '''
import sys, threading
def hang(*args, **kwargs):
    print("PLUGIN ENTERED", file=sys.stderr, flush=True)
    threading.Event().wait()  # never returns
'''


def start(tmp_path, *overrides):
    plugin = tmp_path / "hang_plugin.py"
    plugin.write_text(PLUGIN)
    return subprocess.Popen(
        [sys.executable, "-m", "polyrl", "train", "data.train_batch_size=4", "rollout.n=2",
         "rollout.response_length=8", "trainer.total_steps=3", "trainer.progress_bar=false",
         "trainer.val_before_train=false", f"trainer.output_dir={tmp_path / 'out'}",
         *[o.replace("PLUGIN", str(plugin)) for o in overrides]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env={**os.environ, "COLUMNS": "500"})


@pytest.mark.slow  # a real run to its first step (~15 s on 2 busy cores)
def test_a_hanging_estimator_ends_on_a_second_sigterm(tmp_path):
    proc = start(tmp_path, "ray.enabled=false", "algorithm.adv_estimator=PLUGIN:hang")
    seen = wait_for(proc, re.compile("PLUGIN ENTERED"))
    proc.send_signal(signal.SIGTERM)
    seen = wait_for(proc, re.compile("SIGTERM received: finishing the current step"))
    proc.send_signal(signal.SIGTERM)
    err = finish(proc, seen)
    assert proc.returncode == 143, err[-3000:]
    assert "second SIGTERM: abandoned the current step" in err and "Traceback" not in err, err[-3000:]


def test_a_rank_stuck_in_its_update_is_reported_as_the_updates_timeout(ray_session, tmp_path):
    """A rank whose policy loss never returns: the update's gather times out, then the shut-down
    in `Trainer.fit`'s finally times out too (the rank is still busy); the run's error is the
    update's. Real Ray, a real worker group and gather; the rank is a stand-in whose update hangs,
    since a full run would wait 2 x ray.timeout_s (start-up needs the default on 2 busy cores)."""
    import ray

    from polyrl.config import load_config
    from polyrl.distributed.waits import RemoteTimeout
    from polyrl.job import JobConfig
    from polyrl.topology.worker_group import WorkerGroup
    from polyrl.trainer.loop import Trainer

    @ray.remote(num_cpus=0)
    class StuckRank:
        def update(self):
            import threading

            threading.Event().wait()  # the plugin loss that never returns

        def shutdown(self):
            return None

    trainer = Trainer(load_config(JobConfig, overrides=[f"trainer.output_dir={tmp_path}"]))
    group = WorkerGroup([StuckRank.remote()], ["policy rank 0"], timeout_s=3)

    def setup():
        trainer.topology = group

    trainer.setup = setup
    trainer._run = lambda start, stop: group.call("update", phase="update")
    with pytest.raises(RemoteTimeout) as info:
        trainer.fit()
    assert info.value.phase == "update" and "update: no answer after 3s from policy rank 0" in str(info.value)
    assert trainer.topology is None  # shut down all the same (the stuck rank killed)
