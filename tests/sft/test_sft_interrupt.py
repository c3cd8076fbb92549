"""`polyrl sft` under Ctrl-C / SIGTERM, as docs/training.md's exit-code table says for `polyrl
train`: the current step finishes, a checkpoint is written, one line says where, exit 143 / 130,
and the same command resumes from it. Real processes and real signals; the test waits on the
run's metrics file and log pipe, never on a clock."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from signal_runs import finish, wait_for, wait_for_lines

STARTING = re.compile(r"resolved config:")  # logged once the start-up handlers are in place


def start(out: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "polyrl", "sft", "data.max_samples=256", "data.train_batch_size=16",
         "data.val_files=[]", "trainer.total_steps=100000", "trainer.progress_bar=false",
         "logging.plot_at_end=false", f"trainer.output_dir={out}", *overrides],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "500"})


def wait_for_steps(proc: subprocess.Popen, metrics: Path, steps: int) -> str:
    """Until `metrics` has a record of step `steps` (line 0 holds the data counts)."""
    return wait_for_lines(proc, metrics, steps + 1)


def last_step(out: Path) -> int:
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]


# SIGTERM only: the signal -> exit code mapping (128 + N) is the trainer's shared handler
# (polyrl/trainer/interrupts.py), whose SIGINT path tests/trainer/test_interrupt.py runs
@pytest.mark.parametrize("signum", [signal.SIGTERM])
def test_a_signal_checkpoints_exits_128_plus_it_and_the_run_resumes(tmp_path, signum):
    out = tmp_path / "out"
    proc = start(out)
    seen = wait_for_steps(proc, out / "metrics.jsonl", 2)
    proc.send_signal(signum)
    err = finish(proc, seen)
    assert proc.returncode == 128 + signum, err
    step = last_step(out)
    checkpoint = out / "checkpoints" / f"step_{step:06d}"
    assert f"stopped after step {step} of 100000; wrote checkpoint {checkpoint}" in err, err
    assert "trainer.resume=auto" in err and "Traceback" not in err
    assert (checkpoint / "driver.pt").is_file()

    resumed = subprocess.run(
        [sys.executable, "-m", "polyrl", "sft", "data.max_samples=256", "data.train_batch_size=16",
         "data.val_files=[]", f"trainer.total_steps={step + 1}", "trainer.progress_bar=false",
         "logging.plot_at_end=false", f"trainer.output_dir={out}"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "500"})
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resumed from {checkpoint} (step {step})" in resumed.stderr
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(step + 2))  # no step repeated or lost


def test_sigterm_during_start_up_exits_143_with_a_message(tmp_path):
    proc = start(tmp_path / "out")
    seen = wait_for(proc, STARTING)
    proc.send_signal(signal.SIGTERM)
    err = finish(proc, seen)
    assert proc.returncode == 143, err
    assert "SIGTERM received outside the training loop" in err and "Traceback" not in err


@pytest.mark.slow  # two spawned ranks import torch and transformers
def test_two_ranks_stop_after_the_same_step_with_one_checkpoint(tmp_path):
    out = tmp_path / "out"
    proc = start(out, "actor.world_size=2")
    seen = wait_for_steps(proc, out / "metrics.jsonl", 2)
    proc.send_signal(signal.SIGTERM)
    err = finish(proc, seen)
    assert proc.returncode == 143, err
    step = last_step(out)
    checkpoint = out / "checkpoints" / f"step_{step:06d}"
    assert f"stopped after step {step} of 100000; wrote checkpoint {checkpoint}" in err, err
    assert {p.name for p in checkpoint.glob("rank*.pt")} == {"rank0.pt", "rank1.pt"}
