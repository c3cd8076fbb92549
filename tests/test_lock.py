"""The CPU lock (`constraints-cpu.txt`) is current, satisfies pyproject's ranges, and is what runs.

README command 2 installs with `-c constraints-cpu.txt`, so a fresh machine gets the versions the
suite was last green on. These tests fail when pyproject.toml's requirements (or the deliberate
pins in constraints-cpu.in) change without a re-lock, when a pin falls outside the range users
get, and when the running environment is not the locked one.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
FIX = "run `python scripts/lock_cpu.py`, then README command 2"


def _lock_module():
    spec = importlib.util.spec_from_file_location("lock_cpu", REPO / "scripts" / "lock_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (REPO / "constraints-cpu.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"constraints-cpu.txt: {line!r} is not an exact pin"
            pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


def _requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lock = _lock_module()
    reqs = list(project["dependencies"])
    for extra in lock.EXTRAS:
        reqs += project["optional-dependencies"][extra]
    return [Requirement(r) for r in reqs]


def test_lock_is_current():
    lock = _lock_module()
    assert lock.recorded_digest() == lock.inputs_digest(), (
        f"constraints-cpu.txt is stale (pyproject.toml or constraints-cpu.in changed): {FIX}")


def test_lock_digest_follows_its_inputs(tmp_path):
    lock = _lock_module()
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text()
                                             .replace('"pyyaml>=6"', '"pyyaml>=6.0.2"'))
    (tmp_path / "constraints-cpu.in").write_text((REPO / "constraints-cpu.in").read_text())
    assert lock.inputs_digest(tmp_path) != lock.inputs_digest(REPO)


def test_every_requirement_is_pinned_within_its_range():
    pins = _pins()
    for req in _requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} (pyproject.toml) is not in constraints-cpu.txt: {FIX}"
        version = pins[name]
        # a local label (torch's "+cpu") is not part of the range users write
        assert req.specifier.contains(Version(version.public), prereleases=True), (
            f"constraints-cpu.txt pins {req.name}=={version}, outside pyproject.toml's "
            f"'{req}': {FIX}")


def test_running_environment_is_the_locked_one():
    wrong = []
    for name, version in sorted(_pins().items()):
        try:
            installed = Version(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            continue  # a platform-specific pin this interpreter does not need
        if installed != version:
            wrong.append(f"{name} {installed} (lock: {version})")
    assert not wrong, ("installed versions differ from constraints-cpu.txt: " + ", ".join(wrong)
                       + "; reinstall with README command 2 "
                       "(pip install -c constraints-cpu.txt -e \".[test]\")")
