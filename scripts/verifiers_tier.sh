#!/usr/bin/env bash
# The verifiers tier: polyrl's `agent.environment=verifiers:TASKSET` against the real verifiers 0.4
# (tests/agents/test_verifiers_env.py). verifiers 0.4 pins openai<3 and mcp==2.0.0, which the CPU
# lock (constraints-cpu.txt) does not take, so it gets a venv of its own that sees the main
# environment's packages (--system-site-packages) and adds only what verifiers needs, pinned by
# constraints-verifiers.txt. Prints pytest's summary line; exits non-zero when the install fails,
# verifiers does not import, or any test fails or is skipped.
#
#   scripts/verifiers_tier.sh              # venv in $POLYRL_VERIFIERS_VENV (default ~/.cache/polyrl/verifiers-tier)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${POLYRL_VERIFIERS_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/polyrl/verifiers-tier}"
PYTHON="${PYTHON:-python3}"
cd "$ROOT"

HASH="$(cat constraints-verifiers.txt constraints-cpu.txt | sha256sum | cut -d' ' -f1)"
if [[ ! -x "$VENV/bin/python" || "$(cat "$VENV/.polyrl-lock" 2>/dev/null)" != "$HASH" ]]; then
  echo "verifiers tier: installing into $VENV" >&2
  rm -rf "$VENV"
  "$PYTHON" -m venv --system-site-packages "$VENV"
  if ! "$VENV/bin/pip" install -q -c constraints-verifiers.txt "verifiers==0.4.0" >"$VENV/install.log" 2>&1; then
    tail -20 "$VENV/install.log" >&2
    echo "verifiers tier: install failed (log: $VENV/install.log)" >&2
    exit 1
  fi
  echo "$HASH" > "$VENV/.polyrl-lock"
fi
"$VENV/bin/python" -c "import verifiers.v1" || { echo "verifiers tier: verifiers does not import" >&2; exit 1; }

# -rs lists skips: a skipped test here means verifiers was not seen, which is a failure of the tier
out="$(mktemp)"
set +e
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -rs tests/agents/test_verifiers_env.py "$@" | tee "$out"
rc=${PIPESTATUS[0]}
set -e
if grep -q "SKIPPED" "$out"; then
  echo "verifiers tier: tests were skipped" >&2
  rc=1
fi
rm -f "$out"
exit "$rc"
