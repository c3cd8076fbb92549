"""Ray's own start-up timing out is one line naming ray.timeout_s (issue 41, poor 10): under a
load average of ~24 it was a raw traceback. Forced for real with a tiny ray.timeout_s, which
becomes Ray's GCS start-up wait (0 s: Ray gives up at once), without sleeps."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from polyrl.distributed.ray_launch import GCS_START_WAIT_CAP_S, gcs_start_wait


@pytest.mark.slow  # loads the tiny model and data before Ray starts (~15 s on 2 loaded cores)
def test_ray_start_up_timeout_is_one_line_naming_ray_timeout_s(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_gcs_server_port_wait_time_s")}
    run = subprocess.run([sys.executable, "-m", "polyrl.cli.main", "train", "ray.timeout_s=0.001",
                          "trainer.total_steps=1", "trainer.progress_bar=false",
                          f"trainer.output_dir={tmp_path / 'out'}"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 2, run.stderr[-2000:]
    assert "Traceback" not in run.stderr and len(errors) == 1
    assert "Ray did not start in time" in errors[0] and "ray.timeout_s" in errors[0]


def test_the_wait_is_set_only_during_start_up_and_never_over_the_users(monkeypatch):
    name = "RAY_gcs_server_port_wait_time_s"
    monkeypatch.delenv(name, raising=False)
    with gcs_start_wait(600.0):
        assert os.environ[name] == str(GCS_START_WAIT_CAP_S)
    with gcs_start_wait(45.5):
        assert os.environ[name] == "45"
    assert name not in os.environ
    monkeypatch.setenv(name, "7")
    with gcs_start_wait(600.0):
        assert os.environ[name] == "7"
    with gcs_start_wait(None):
        assert os.environ[name] == "7"
