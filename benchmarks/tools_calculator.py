"""The bundled task where tools win: `polyrl train -c configs/tools_calculator.yaml` with the
calculator tool and the same run without tools (`agent.tools=[]`), end to end through the CLI.

Prints held-out accuracy before and after, the tool calls per trajectory at the last step, and the
wall time of each `polyrl train` command (start-up, validations and checkpoint included), with the
machine's load average, since the wall time is only meaningful next to it (docs/benchmarks.md).

    python benchmarks/tools_calculator.py                 # ~4-8 minutes on 2 cores
    python benchmarks/tools_calculator.py --only tools --json
    python benchmarks/tools_calculator.py --set trainer.total_steps=60
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "tools_calculator.yaml"
RUNS = {"tools": [], "no_tools": ["agent.tools=[]"]}


def cpu_flags() -> str:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "unknown"
    return " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)


def last_metric(metrics_file: Path, key: str) -> float | None:
    """The last logged value of `key` in a run's metrics.jsonl."""
    value = None
    for line in metrics_file.read_text().splitlines():
        value = json.loads(line).get(key, value)
    return value


def run(name: str, overrides: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "polyrl", "train", "-c", str(CONFIG), "--output-dir", str(out),
           "trainer.progress_bar=false", *overrides]
    load_before, start = os.getloadavg()[0], time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    seconds, load_after = time.monotonic() - start, os.getloadavg()[0]
    if proc.returncode != 0:
        raise SystemExit(f"{name}: polyrl train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {"before": summary["initial_accuracy"], "after": summary["final_accuracy"],
            "steps": summary["steps"], "wall_seconds": seconds, "train_seconds": summary["wall_seconds"],
            "tool_calls_mean": last_metric(out / "metrics.jsonl", "agent/tool_calls_mean"),
            "load_avg": [round(load_before, 1), round(load_after, 1)], "command": " ".join(cmd[1:])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", choices=sorted(RUNS))
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for both runs")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    results = {}
    print(f"CPU: {os.cpu_count()} cores, flags {cpu_flags()}", flush=True)
    for name in args.only or RUNS:
        with tempfile.TemporaryDirectory() as out:
            results[name] = r = run(name, [*RUNS[name], *args.set], Path(out))
        calls = "-" if r["tool_calls_mean"] is None else f"{r['tool_calls_mean']:.2f}"
        print(f"{name:>9}: held-out {r['before']:.1%} -> {r['after']:.1%} ({r['after'] - r['before']:+.1%}), "
              f"{r['steps']} steps, tool calls/trajectory {calls}, {r['wall_seconds']:.0f} s wall "
              f"(load average {r['load_avg'][0]} -> {r['load_avg'][1]})", flush=True)
    if args.json:
        print(json.dumps({"config": str(CONFIG.relative_to(REPO)), "overrides": args.set, "cpu_flags": cpu_flags(),
                          "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
