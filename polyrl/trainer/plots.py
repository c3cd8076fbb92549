"""Training curves and a summary table from a run's `metrics.jsonl`.

    polyrl plot outputs/polyrl        # writes outputs/polyrl/curves.png, prints the summary

`plot_run` draws four panels with matplotlib's Agg canvas, so it works on a headless machine and
never changes pyplot's backend: for an RL run (`polyrl train`) reward, train accuracy, validation
accuracy and response length; for an SFT run (`polyrl sft`, recognised by `train/loss` without
rewards) loss (train and held-out), held-out token accuracy, learning rate and gradient norm.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

Series = tuple[list[int], list[float]]

PASS_AT_K = re.compile(r"^val/pass@\d+$")


class MetricsFileError(ValueError):
    """A run directory without readable metrics; the message names the path."""


# --- reading -----------------------------------------------------------------------------------


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of `run_dir/metrics.jsonl`, in file order (unreadable lines are skipped)."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise MetricsFileError(f"{run_dir} is not a directory (expected a run's trainer.output_dir)")
    if not path.is_file():
        raise MetricsFileError(f"{path} does not exist: is {run_dir} a polyrl run directory "
                               "(trainer.output_dir)?")
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    if not records:
        raise MetricsFileError(f"{path} holds no metrics yet (the run has not logged a step)")
    return records


def series(records: list[dict[str, Any]], key: str) -> Series:
    """(steps, values) of one key, sorted by step; the last value wins when a step repeats
    (the final validation shares the last training step); non-finite values are dropped."""
    by_step: dict[int, float] = {}
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            by_step[r["step"]] = float(v)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def keys(records: list[dict[str, Any]]) -> list[str]:
    return sorted({k for r in records for k in r if k != "step"})


def smooth(values: list[float], weight: float) -> list[float]:
    """Bias-corrected exponential moving average (TensorBoard's smoothing)."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight**i))
    return out


# --- the figure --------------------------------------------------------------------------------


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Write the run's curves to `out` (default `run_dir/curves.png`) and return the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    all_keys = keys(records)
    fig = Figure(figsize=(12, 7.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)  # Agg drawing for this figure only; pyplot's global backend is untouched
    if is_sft(records):
        _sft_panels(fig, records)
    else:
        _rl_panels(fig, records, all_keys)

    last = max(r["step"] for r in records)
    fig.suptitle(f"{run_dir.resolve().name}: {last} step{'s' * (last != 1)}", fontsize=13)
    out = Path(out) if out is not None else run_dir / "curves.png"
    fig.savefig(out)
    return out


def is_sft(records: list[dict[str, Any]]) -> bool:
    """An SFT run logs a training loss and no rewards."""
    present = {k for r in records for k in r}
    return "train/loss" in present and "reward/score_mean" not in present


def _sft_panels(fig, records) -> None:
    ax_loss, ax_acc, ax_lr, ax_grad = fig.subplots(2, 2).flat
    _panel(ax_loss, records, "Loss (NLL per assistant token)", "loss",
           [("train/loss", "train", True), ("val/loss", "held-out", False)])
    _panel(ax_acc, records, "Held-out token accuracy", "accuracy",
           [("val/token_acc", "val/token_acc", True)], unit_range=True, markers=True)
    _panel(ax_lr, records, "Learning rate", "lr", [("actor/lr", "actor/lr", True)])
    _panel(ax_grad, records, "Gradient norm (before clipping)", "norm",
           [("actor/grad_norm", "actor/grad_norm", True)])


def _rl_panels(fig, records, all_keys) -> None:
    ax_reward, ax_acc, ax_val, ax_len = fig.subplots(2, 2).flat

    _panel(ax_reward, records, "Reward (train)", "score",
           [("reward/score_mean", "reward/score_mean", True)])
    per_source = [k for k in all_keys if k.startswith("reward/acc/")]
    _panel(ax_acc, records, "Accuracy (train)", "accuracy",
           [("reward/acc_mean", "reward/acc_mean", True)]
           + [(k, k.removeprefix("reward/acc/"), False) for k in per_source], unit_range=True)
    passes = sorted((k for k in all_keys if PASS_AT_K.match(k)), key=lambda k: int(k.split("@")[1]))
    _panel(ax_val, records, "Validation accuracy", "accuracy",
           [("val/acc", "val/acc", True)] + [(k, k, False) for k in passes],
           unit_range=True, markers=True)
    _panel(ax_len, records, "Response length", "tokens",
           [("response/length_mean", "mean (train)", True), ("response/length_max", "max (train)", False),
            ("val/response_length", "mean (val)", False)])


def _panel(ax, records, title: str, ylabel: str, lines: list[tuple[str, str, bool]],
           unit_range: bool = False, markers: bool = False) -> None:
    """Draw each (key, label, main) line present; `main` lines get a smoothed overlay when long."""
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 2.5, 5, 10]))
    drawn = 0
    for key, label, main in lines:
        steps, values = series(records, key)
        if not steps:
            continue
        color = f"C{drawn}"
        few = len(steps) <= 30
        marker = "o" if markers or few else None
        if main and len(steps) > 30:  # noisy per-step values: faint raw line, smoothed on top
            ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
            ax.plot(steps, smooth(values, 0.8), color=color, linewidth=2, label=f"{label} (smoothed)")
        else:
            ax.plot(steps, values, color=color, marker=marker, markersize=4,
                    linewidth=2 if main else 1.2, label=label)
        if markers:  # the number people look for: the latest validation score
            ax.annotate(f"{values[-1]:.3f}", (steps[-1], values[-1]), textcoords="offset points",
                        xytext=(5, -3), va="top", fontsize=8, color=color)
        drawn += 1
    if not drawn:
        ax.text(0.5, 0.5, f"no data\n({', '.join(k for k, _, _ in lines[:2])})", ha="center",
                va="center", transform=ax.transAxes, color="gray")
        return
    if unit_range:
        ax.set_ylim(-0.03, 1.05)
    if markers:
        ax.margins(x=0.1)  # room for the labels right of the last points
    ax.legend(loc="best", fontsize=8)


# --- the summary -------------------------------------------------------------------------------


SUMMARY_KEYS = ("reward/score_mean", "reward/acc_mean", "response/length_mean", "actor/entropy",
                "train/loss")
HIGHER_IS_BETTER = {"reward/score_mean", "reward/acc_mean", "val/token_acc"}


def summary_rows(run_dir: Path) -> list[tuple[str, str]]:
    """(what, value) rows: steps, wall time, first -> last (best) of the key metrics, validation."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    steps = sorted({r["step"] for r in records})
    trained = [s for s in steps if s > 0]
    rows = [("run", str(run_dir)), ("steps logged", f"{len(trained)} (last step {steps[-1]})")]
    summary = run_dir / "summary.json"
    if summary.is_file():
        try:
            wall = json.loads(summary.read_text()).get("wall_seconds")
        except json.JSONDecodeError:
            wall = None
        if isinstance(wall, (int, float)):
            rows.append(("wall time", _duration(wall)))
    for key in SUMMARY_KEYS:
        s, v = series(records, key)
        if not s:
            continue
        if key in HIGHER_IS_BETTER:
            best = max(range(len(v)), key=v.__getitem__)
            extra = f"best {_num(v[best])} at step {s[best]}"
        else:
            extra = f"range {_num(min(v))} .. {_num(max(v))}"
        rows.append((key, f"{_num(v[0])} -> {_num(v[-1])}  ({extra})"))
    s, v = series(records, "timing/step")
    if s:
        rows.append(("seconds per step", f"{sum(v) / len(v):.2f} mean, {max(v):.2f} max"))
    val_keys = ["val/acc", *sorted(k for k in keys(records) if PASS_AT_K.match(k)),
                "val/loss", "val/token_acc"]
    for key in val_keys:
        s, v = series(records, key)
        if not s:
            continue
        if len(s) > 1:
            pick = max if key in HIGHER_IS_BETTER or key == "val/acc" or PASS_AT_K.match(key) else min
            best = pick(range(len(v)), key=v.__getitem__)
            rows.append((key, f"{_num(v[0])} (step {s[0]}) -> {_num(v[-1])} (step {s[-1]}), "
                              f"best {_num(v[best])} at step {s[best]}"))
        else:
            rows.append((key, f"{_num(v[0])} (step {s[0]})"))
    if is_sft(records):
        s, v = series(records, "val/loss")
        rows.append(("last val/loss", f"{v[-1]:.4g} at step {s[-1]}" if s else "not validated"))
        return rows
    s, v = series(records, "val/acc")
    rows.append(("last val/acc", f"{v[-1]:.1%} at step {s[-1]}" if s else "not validated"))
    return rows


def print_summary(run_dir: Path, console: Any) -> None:
    """Print `summary_rows` as a rich table on `console`."""
    from rich.table import Table

    table = Table(title="run summary", show_header=True, header_style="bold")
    table.add_column("metric", style="cyan", no_wrap=True)
    table.add_column("value")
    for name, value in summary_rows(run_dir):
        table.add_row(name, value)
    console.print(table)


def _num(x: float) -> str:
    return f"{x:.4g}" if abs(x) < 1e4 else f"{x:.0f}"


def _duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{seconds:.1f}s"
