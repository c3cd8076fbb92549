#!/usr/bin/env bash
# Warn-only: install the newest releases pyproject.toml's ranges allow (no lock; torch stays the
# CPU wheel, constraints-cpu.in) into a fresh venv and run the fast test tier there, so a new
# transformers / ray / ... that breaks polyrl shows up before users hit it. It never fails:
# it prints what broke and the versions that differ from constraints-cpu.txt, and exits 0.
#
#   scripts/check_latest.sh [VENV_DIR]      # default: a temp dir, removed afterwards
set -u
cd "$(dirname "$0")/.."
venv=${1:-$(mktemp -d /tmp/polyrl-latest.XXXXXX)}
cleanup() { [ $# -ge 1 ] || rm -rf "$venv"; }
python -m venv "$venv" || { echo "check_latest: WARNING: could not create a venv"; exit 0; }
if ! "$venv/bin/pip" install -q -c constraints-cpu.in -e ".[test]" >"$venv/install.log" 2>&1; then
  echo "check_latest: WARNING: the newest allowed releases do not install:"
  tail -n 20 "$venv/install.log" | sed 's/^/    /'
  cleanup "$@"; exit 0
fi
echo "check_latest: versions newer than constraints-cpu.txt:"
"$venv/bin/python" - <<'PY'
import importlib.metadata as md, re
pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", open("constraints-cpu.txt").read(), re.M))
for name, pinned in sorted(pins.items()):
    try:
        now = md.version(name)
    except md.PackageNotFoundError:
        continue
    if now != pinned:
        print(f"    {name} {pinned} -> {now}")
PY
if "$venv/bin/python" -m pytest -q -m "not slow" -p no:cacheprovider \
    --deselect tests/test_lock.py::test_running_environment_is_the_locked_one >"$venv/pytest.log" 2>&1; then
  echo "check_latest: fast tier green on the newest releases ($(tail -n 1 "$venv/pytest.log"))"
else
  echo "check_latest: WARNING: the fast tier fails on the newest releases (lock still green):"
  grep -E "^(FAILED|ERROR)" "$venv/pytest.log" | head -n 30 | sed 's/^/    /'
  tail -n 1 "$venv/pytest.log" | sed 's/^/    /'
fi
cleanup "$@"
exit 0
