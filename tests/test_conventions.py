"""Conventions a reviewer would otherwise have to police by hand (docs/architecture.md, Conventions).

- Only `polyrl/envplan` computes environment for other processes; nothing writes os.environ.
- Only `polyrl/platform` touches torch.cuda, device-type strings and communication backends.
- Importing polyrl has no side effects.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import polyrl

PACKAGE = Path(polyrl.__file__).parent

ENV_WRITE = re.compile(
    r"os\.environ\[[^\]]+\]\s*=[^=]|os\.putenv|environ\.setdefault|os\.environ\.update|"
    r"os\.environ\.pop|del\s+os\.environ"
)
DEVICE_USE = re.compile(r"torch\.cuda\b|torch\.npu\b|[\"'](nccl|hccl|cuda|npu)(:\d+)?[\"']")

# Each exception names why it is allowed. Keep this list short.
DEVICE_EXCEPTIONS = {
    # Enumerations of names that users type (choices, registries), not device use.
    "polyrl/envplan/rules.py": "rule conditions name platforms as data",
    "polyrl/envplan/plan.py": "validates platform names in plan contexts",
    "polyrl/cli/env_cmd.py": "--platform help text lists platform names",
}


def python_files(root: Path):
    for path in sorted(root.rglob("*.py")):
        yield path, path.relative_to(root.parent).as_posix()


def test_no_environment_writes_outside_envplan():
    offenders = []
    for path, rel in python_files(PACKAGE):
        if rel.startswith("polyrl/envplan/"):
            continue
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if ENV_WRITE.search(line):
                offenders.append(f"{rel}:{no}: {line.strip()}")
    assert not offenders, "environment written outside polyrl/envplan:\n" + "\n".join(offenders)


def test_no_device_specific_code_outside_platform():
    offenders = []
    for path, rel in python_files(PACKAGE):
        if rel.startswith("polyrl/platform/") or rel in DEVICE_EXCEPTIONS:
            continue
        for no, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if DEVICE_USE.search(code):
                offenders.append(f"{rel}:{no}: {line.strip()}")
    assert not offenders, "device-specific code outside polyrl/platform:\n" + "\n".join(offenders)


def test_the_checks_catch_offenders():
    assert ENV_WRITE.search('os.environ["X"] = "1"')
    assert ENV_WRITE.search("os.environ.setdefault('X', '1')")
    assert not ENV_WRITE.search('if os.environ["X"] == "1":')
    assert DEVICE_USE.search("torch.cuda.synchronize()")
    assert DEVICE_USE.search('dist.init_process_group("nccl")')
    assert DEVICE_USE.search("x.to('cuda:0')")
    assert not DEVICE_USE.search("platform.torch_device(0)")


def test_import_has_no_side_effects():
    code = (
        "import os, logging, sys; before = dict(os.environ);"
        "import polyrl, polyrl.cli.main, polyrl.envplan, polyrl.platform, polyrl.job;"
        "assert dict(os.environ) == before, 'environment changed at import';"
        "assert not logging.getLogger().handlers, 'root logging configured at import';"
        "import polyrl.platform.detect as d; assert d._real_probe.cache_info().currsize == 0, 'probed at import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
