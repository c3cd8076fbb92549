"""SIGTERM during training: the step finishes, a checkpoint is written, Ray stops, exit != 0."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time


def test_sigterm_checkpoints_and_exits_nonzero(tiny_model, arith_files, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "polyrl", "train", f"model.path={tiny_model}",
         f"data.train_files=[{arith_files['train']}]", "data.val_files=[]",
         "data.train_batch_size=4", "rollout.n=2", "rollout.response_length=4",
         "trainer.total_steps=100000", "trainer.progress_bar=false", f"trainer.output_dir={out}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped after step" in err and "trainer.resume=auto" in err
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert (out / "checkpoints" / f"step_{last:06d}" / "driver.pt").is_file()
