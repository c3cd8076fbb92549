"""The placement layer imports nothing above it, not even inside a function (issue 29: the probe's
command-line entry imported polyrl.cli.common and polyrl.topology.launch_plan inside `main()`;
it moved to polyrl/cli/placement_check.py, `polyrl placement`). tests/test_layers.py checks
module-level imports of every package; this checks every import of polyrl/placement."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import polyrl
from test_layers import all_imports, layer  # tests/ is on sys.path (tests/conftest.py): the one layer order

PLACEMENT = Path(polyrl.__file__).parent / "placement"


def test_placement_imports_nothing_above_it_anywhere():
    own = layer("polyrl.placement")
    up = [f"{path.name} imports {target}" for path in sorted(PLACEMENT.rglob("*.py"))
          for target in all_imports(ast.parse(path.read_text()))
          if (layer(target) or 0) > own]
    assert up == []


def test_the_old_probe_module_names_the_command_that_replaced_it():
    """`python -m polyrl.placement.probe` (what scripts and notes used to run): one line naming
    `polyrl placement`, exit 2, no traceback."""
    out = subprocess.run([sys.executable, "-m", "polyrl.placement.probe", "rollout.backend=trtllm"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "python -m polyrl.placement.probe is now `polyrl placement [-c FILE] [key=value ...]` "
        "(docs/dry_run.md)"]
