#!/usr/bin/env bash
# What a device image with torch alone needs for `scripts/gpu_check.sh --loop`, built here into
# build/gpu_carry (git-ignored, so a lent machine's `carry` takes it, at most 64 MiB in all):
#
#   1. the bundled arithmetic task as JSONL (build/gpu_carry/data): pyarrow, which reads the
#      bundled parquet files, is far too large to carry, and JSONL reads with the standard library;
#   2. a probe: one `polyrl train ray.enabled=false` step on those files in a process where Ray
#      and pyarrow cannot be imported, listing every module the loop imported;
#   3. the distributions behind them that polyrl requires (and what those require), less torch
#      and torch's own requirements, installed with `pip install --target --no-deps` at the
#      versions installed here: the pure-Python ones always (transformers trimmed to the model
#      families the probe imported), the compiled ones the loop imported (a wheel per Python
#      version) only with --binary PYVER (e.g. 3.12, the device's Python);
#   4. a table of each one's size, pure or compiled, and the total against 64 MiB. Packages the
#      loop imported only because they are installed here (transformers loads accelerate, scipy,
#      ... when present) are listed apart and not carried.
#
#   scripts/gpu_carry.sh [--binary PYVER] [--image-has DIST,...] [--out DIR]
#
# --image-has: compiled distributions the device image already has (e.g. numpy), not carried.
#
# Documented in docs/gpu_engines.md ("The loop check").
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/gpu_carry
binary=""
image_has=""
while [ $# -gt 0 ]; do
  case "$1" in
    --binary) binary=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --image-has) image_has=$2; shift 2 ;;
    *) echo "usage: scripts/gpu_carry.sh [--binary PYVER] [--image-has DIST,...] [--out DIR]" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python}
rm -rf "$out"
mkdir -p "$out/data"
probe_dir=$(mktemp -d /tmp/polyrl-carry.XXXXXX)
trap 'rm -rf "$probe_dir"' EXIT

"$PY" - "$out/data" <<'EOF'
import json, sys
from pathlib import Path
import pyarrow.parquet as pq
from polyrl.builtin import resolve
for split in ("train", "val"):
    rows = pq.read_table(resolve(f"builtin:arithmetic_{split}")).to_pylist()
    with open(Path(sys.argv[1]) / f"arithmetic_{split}.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"data: arithmetic_{split}.jsonl, {len(rows)} rows")
EOF

"$PY" - "$probe_dir/modules.json" train ray.enabled=false trainer.total_steps=1 \
  trainer.val_before_train=false trainer.val_every=0 logging.plot_at_end=false \
  logging.samples_every=0 trainer.save_at_end=false trainer.progress_bar=false \
  "data.train_files=[$out/data/arithmetic_train.jsonl]" "data.val_files=[$out/data/arithmetic_val.jsonl]" \
  --output-dir "$probe_dir/run" >"$probe_dir/probe.log" 2>&1 <<'EOF' || { cat "$probe_dir/probe.log"; exit 1; }
import json, sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ray", "pyarrow"):
            raise ImportError(f"{name} is blocked: the carried loop must run without it")
sys.meta_path.insert(0, Blocked())
from polyrl.cli.main import main
rc = main(sys.argv[2:])
json.dump(sorted(sys.modules), open(sys.argv[1], "w"))
sys.exit(rc)
EOF

"$PY" - "$probe_dir/modules.json" "$out" "$binary" "$image_has" <<'EOF'
import json, shutil, subprocess, sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as canon

loaded, out, binary, image_has_arg = json.load(open(sys.argv[1])), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
modules = sorted({m.split(".")[0] for m in loaded})
models = sorted({m.split(".")[2] for m in loaded if m.startswith("transformers.models.") and m.count(".") >= 2})
"""The model families the loop imported (auto, qwen2, what auto's imports pull in): transformers
keeps one package per family, hundreds of them, most of its size; the others are left out."""
LIMIT = 64 * 2**20
owners = metadata.packages_distributions()
imported = {canon(d) for m in modules if m not in sys.stdlib_module_names for d in owners.get(m, [])}


def requires(name: str) -> set[str]:
    found = set()
    for spec in metadata.requires(name) or []:
        req = Requirement(spec)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            found.add(canon(req.name))
    return found


def closure(seed: set[str]) -> set[str]:
    seen, todo = set(), list(seed)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        todo.extend(requires(name) - seen)
    return seen


polyrl = requires("polyrl")
with_torch = closure({"torch"}) | {n for n in imported if n.startswith("nvidia-") or n == "triton"}
needed = sorted(closure(imported & polyrl) - with_torch - {"ray", "pyarrow", "polyrl"})
extra = sorted(imported - set(needed) - with_torch - {"polyrl"})


def facts(name: str) -> tuple[str, int, bool]:
    dist = metadata.distribution(name)
    files = dist.files or []
    size = sum(f.size or 0 for f in files)
    compiled = any(str(f).endswith((".so", ".pyd")) or ".so." in str(f) for f in files)
    return dist.version, size, compiled


rows = {n: facts(n) for n in needed}
pure = [n for n in needed if not rows[n][2]]
# a compiled one is a wheel per Python version and machine: only those the loop imported
compiled = [n for n in needed if rows[n][2] and n in imported]
unused = [n for n in needed if rows[n][2] and n not in imported]
image_has = {canon(n) for n in image_has_arg.split(",") if n}
pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(out), "--no-compile"]
subprocess.run([*pip, *(f"{n}=={rows[n][0]}" for n in pure)], check=True)
wheels = [n for n in compiled if n not in image_has]
if binary and wheels:
    subprocess.run([*pip, "--only-binary=:all:", "--python-version", binary, "--implementation", "cp",
                    "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64",
                    *(f"{n}=={rows[n][0]}" for n in wheels)], check=True)
for junk in out.glob("bin"):
    shutil.rmtree(junk)
families = out / "transformers" / "models"
dropped = [d for d in families.iterdir() if d.is_dir() and d.name not in models and d.name != "__pycache__"]
for d in dropped:
    shutil.rmtree(d)


def mib(n: int) -> str:
    return f"{n / 2**20:7.1f} MiB"


print(f"{'distribution':28} {'version':12} {'installed here':>14}  kind")
for n in needed:
    version, size, is_compiled = rows[n]
    if not is_compiled:
        kind = "pure Python: carried"
    elif n in unused:
        kind = "compiled, required but not imported by the loop: not carried"
    elif n in image_has:
        kind = "compiled: the image has it (--image-has)"
    else:
        kind = "compiled: " + (f"carried, cp{binary} wheel" if binary else "the image must have it, or --binary PYVER")
    print(f"{n:28} {version:12} {mib(size):>14}  {kind}")
carried = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
pure_size = sum(rows[n][1] for n in pure)
compiled_size = sum(rows[n][1] for n in compiled)
print(f"pure Python: {len(pure)} distributions, {mib(pure_size).strip()} installed here")
print(f"compiled, imported by the loop: {len(compiled)} distributions, {mib(compiled_size).strip()} "
      f"installed here ({', '.join(compiled) or 'none'})")
print(f"{out}: {mib(carried).strip()} (data and packages), limit 64 MiB: "
      f"{'fits' if carried <= LIMIT else 'does NOT fit'}")
print(f"transformers/models: kept {', '.join(models)}; left out {len(dropped)} other model families")
if extra:
    print(f"imported here only because installed, not carried: {', '.join(extra)}")
EOF

# the carry checked: the same step with build/gpu_carry first on the path (its trimmed
# transformers and the other carried packages win over this machine's), Ray and pyarrow blocked
PYTHONPATH="$PWD/$out:$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$probe_dir/check.json" train ray.enabled=false \
  trainer.total_steps=1 trainer.val_before_train=false trainer.val_every=0 logging.plot_at_end=false \
  logging.samples_every=0 trainer.save_at_end=false trainer.progress_bar=false \
  "data.train_files=[$out/data/arithmetic_train.jsonl]" "data.val_files=[$out/data/arithmetic_val.jsonl]" \
  --output-dir "$probe_dir/check" >"$probe_dir/check.log" 2>&1 <<'EOF' || { cat "$probe_dir/check.log"; echo "FAIL the carry does not run the loop"; exit 1; }
import json, sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ray", "pyarrow"):
            raise ImportError(f"{name} is blocked: the carried loop must run without it")
sys.meta_path.insert(0, Blocked())
from polyrl.cli.main import main
rc = main(sys.argv[2:])
import transformers
json.dump({"transformers": transformers.__file__}, open(sys.argv[1], "w"))
sys.exit(rc)
EOF
echo "PASS one loop step with $out first on the path (transformers from $("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['transformers'])" "$probe_dir/check.json"))"
