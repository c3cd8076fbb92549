"""Same seed, same run: two `polyrl train` processes give identical metrics and weights.

Each run is its own process tree (driver, Ray, policy actor with its engine), so nothing a
process decides for itself (such as which matmul kernel a weight shape gets,
polyrl/rollout/native/matmul.py `packing_pays`) may depend on timing or other noise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

VOLATILE = ("timing/", "perf/", "time/")


def start_train(out, tiny_model, arith_files) -> subprocess.Popen:
    args = [sys.executable, "-m", "polyrl", "train", f"model.path={tiny_model}",
            f"data.train_files=[{arith_files['train']}]", "data.val_files=[]",
            "data.train_batch_size=4", "rollout.n=4", "rollout.response_length=6", "actor.lr=0.01",
            "trainer.total_steps=3", "trainer.seed=7", "trainer.progress_bar=false",
            "ray.address=local",  # a Ray of its own even when another cluster runs on this machine
            f"trainer.output_dir={out}"]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ))


def wait_ok(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]


def stable_metrics(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in rows]


def final_weights(out):
    (step_dir,) = sorted((out / "checkpoints").glob("step_*"))[-1:]
    return load_file(str(step_dir / "policy" / "model.safetensors"))


@pytest.mark.slow
def test_two_runs_with_the_same_seed_match_bit_for_bit(tiny_model, arith_files, tmp_path):
    """The two runs overlap in time, so they also see different CPU contention and scheduling."""
    first, second = tmp_path / "first", tmp_path / "second"
    procs = [start_train(out, tiny_model, arith_files) for out in (first, second)]
    for proc in procs:
        wait_ok(proc)
    assert stable_metrics(first) == stable_metrics(second)
    a, b = final_weights(first), final_weights(second)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs between same-seed runs"
