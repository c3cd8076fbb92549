"""Curves PNG and summary from metrics.jsonl, and `polyrl plot` as a user runs it."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from rich.console import Console

from polyrl.trainer.plots import MetricsFileError, plot_run, print_summary, series, summary_rows


def write_run(run_dir, steps=40, val_every=10, pass_at=4):
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "metrics.jsonl").open("w") as f:
        f.write(json.dumps({"step": 0, "val/acc": 0.1, f"val/pass@{pass_at}": 0.3,
                            "val/response_length": 30.0}) + "\n")
        for s in range(1, steps + 1):
            p = 1 / (1 + math.exp(-(s - steps / 2) / 5))
            record = {"step": s, "reward/score_mean": 0.1 + 0.7 * p, "reward/acc_mean": 0.1 + 0.8 * p,
                      "response/length_mean": 30 - 10 * p, "response/length_max": 64.0,
                      "timing/step": 1.5}
            if s % val_every == 0:
                record.update({"val/acc": 0.1 + 0.8 * p, f"val/pass@{pass_at}": 0.3 + 0.6 * p})
            f.write(json.dumps(record) + "\n")
    return run_dir


def check_png(path):
    import matplotlib.image

    assert path.is_file() and path.stat().st_size > 10_000
    image = matplotlib.image.imread(path)
    height, width, channels = image.shape
    assert width > 800 and height > 500 and channels in (3, 4)
    assert image[..., :3].std() > 0.05  # something was drawn


def test_plot_run_writes_a_readable_png(tmp_path):
    run = write_run(tmp_path / "run")
    out = plot_run(run)
    assert out == run / "curves.png"
    check_png(out)


def test_plot_run_with_few_steps_and_missing_keys(tmp_path):
    run = tmp_path / "short"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "reward/score_mean": 0.5}\n')
    check_png(plot_run(run))
    assert ("last val/acc", "not validated") in summary_rows(run)


def test_series_dedups_steps_and_skips_bad_values():
    records = [{"step": 2, "a": 1.0}, {"step": 1, "a": float("nan")}, {"step": 2, "a": 3.0},
               {"step": 3, "b": 1.0}, {"step": 4, "a": True}]
    assert series(records, "a") == ([2], [3.0])


def test_summary_rows_first_last_best(tmp_path):
    run = write_run(tmp_path / "run", steps=20, val_every=10)
    (run / "summary.json").write_text(json.dumps({"wall_seconds": 125.0}))
    rows = dict(summary_rows(run))
    assert rows["steps logged"] == "20 (last step 20)"
    assert rows["wall time"] == "2m05s"
    assert rows["reward/acc_mean"].startswith("0.2135 -> 0.8046")
    assert "best" in rows["reward/acc_mean"] and "range" in rows["response/length_mean"]
    assert rows["val/acc"].startswith("0.1 (step 0) -> ")
    assert "val/pass@4" in rows
    assert rows["last val/acc"].endswith("at step 20")
    console = Console(record=True, width=120)
    print_summary(run, console)
    assert "reward/score_mean" in console.export_text()


def test_missing_and_empty_metrics_name_the_path(tmp_path):
    with pytest.raises(MetricsFileError, match="metrics.jsonl does not exist"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(MetricsFileError, match=str(tmp_path / "metrics.jsonl")):
        summary_rows(tmp_path)


def polyrl(*args):
    return subprocess.run([sys.executable, "-m", "polyrl", *args], capture_output=True, text=True,
                          timeout=120)


def test_polyrl_plot_cli(tmp_path):
    run = write_run(tmp_path / "run")
    out = polyrl("plot", str(run))
    assert out.returncode == 0, out.stderr
    assert str(run / "curves.png") in out.stdout
    assert "val/acc" in out.stdout and "reward/score_mean" in out.stdout
    check_png(run / "curves.png")



def test_polyrl_plot_bad_dir_is_one_line_error(tmp_path, capsys):
    from polyrl.cli.main import main

    assert main(["plot", str(tmp_path / "nope")]) == 2
    assert "nope is not a directory" in capsys.readouterr().err
    assert main(["plot", str(tmp_path)]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err
