"""`polyrl bench weights --quick --json` runs end to end and delivers the weights bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "weights.py"


def test_quick_json_reports_the_issue_fields_and_exact_delivery():
    run = subprocess.run([sys.executable, str(BENCH), "--quick", "--json", "--reps", "1"],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    for key in ("bucketed_bytes_per_s", "memcpy_bytes_per_s", "ratio", "copy_engine_ratio"):
        assert result[key] > 0
    assert result["ratio"] == result["bucketed_bytes_per_s"] / result["memcpy_bytes_per_s"]
    assert result["bucketed_exact"] is True and result["shm_direct"] is True
    assert result["bytes"] > 100e6 and 25e6 < result["params"] < 35e6
