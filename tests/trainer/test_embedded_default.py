"""The README's first command: `polyrl train` with no config trains the bundled tiny model on
the bundled task on this CPU and held-out accuracy rises >= 30 points. (How long it takes is a
benchmark's question, docs/benchmarks.md; a test never asserts on wall-clock time.)"""

from __future__ import annotations

import json
import subprocess
import sys


def test_polyrl_train_with_no_arguments_learns(tmp_path):
    out = subprocess.run([sys.executable, "-m", "polyrl", "train", "--output-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_accuracy"] - summary["initial_accuracy"] >= 0.30, summary
    assert "held-out accuracy:" in out.stdout
    for name in ("metrics.jsonl", "curves.png", "samples.txt", "config.yaml"):
        assert (tmp_path / name).is_file(), name
    assert (tmp_path / "checkpoints" / f"step_{summary['steps']:06d}" / "policy" / "model.safetensors").is_file()
