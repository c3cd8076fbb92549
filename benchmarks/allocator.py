"""Process-environment A/B on a GRPO-shaped training update: glibc's heap defaults against
polyrl's CPU allocator rule (`--compare allocator`, the default), or OpenMP threads left to the
scheduler against threads bound to cores (`--compare binding`).

glibc serves every allocation above its mmap threshold (at most 32 MiB on 64-bit) with a fresh
`mmap` and returns it to the kernel on `free`. A training update on CPU allocates tensors that
size every step (the fp32 [batch, response, vocab] logits, their log-softmax and gradients), so
each step faults the same pages in again. polyrl's CPU envplan rule `cpu-malloc-keep-heap`
(polyrl/envplan/rules.py) sets `MALLOC_MMAP_MAX_=0` and a huge `MALLOC_TRIM_THRESHOLD_` in the
trainer and rollout processes, so freed memory stays in the heap and is reused.

Each setting runs in its own process (glibc reads the variables at start-up); the two alternate,
`--repeats` times. Per update (forward + backward + AdamW of the 30M benchmark model,
`benchmarks/_tiny.py`, 8 prompts x 8 samples x 32 response tokens, `polyrl bench grpo`'s batch):
minor page faults, system CPU seconds, user CPU seconds and wall seconds, medians over steps
2..N. Page-fault counts do not depend on the machine's load; the seconds do.

    python benchmarks/allocator.py [--dtype bfloat16] [--steps 5] [--repeats 2] [--threads 1] [--json]

`--compare binding` (run it with `--threads 2` or more) keeps the allocator rule in both settings
and adds `OMP_PROC_BIND=close OMP_PLACES=cores` to the second: each of torch's OpenMP threads
stays on one core instead of migrating, which can shorten the barriers between parallel regions
on an idle machine and lengthen them when another process wants the same core.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COMPARISONS = {"allocator": ("glibc defaults", "polyrl CPU rule"),
               "binding": ("threads unbound", "threads bound to cores")}
BINDING = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}


def rule_variables() -> dict[str, str]:
    from polyrl.envplan.rules import RULES

    (rule,) = [r for r in RULES if r.id == "cpu-malloc-keep-heap"]
    return dict(rule.variables)


def child(model_dir: str, dtype: str, steps: int, threads: int) -> dict:
    import torch

    from logprobs import update_case

    torch.set_num_threads(threads)
    (step, (model,)), _ = update_case(model_dir, 8, 8, 32, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    rows = []
    for _ in range(steps):
        before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        step().backward()
        optimizer.step()
        after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
        rows.append({"minor_faults": after.ru_minflt - before.ru_minflt,
                     "sys_s": after.ru_stime - before.ru_stime,
                     "user_s": after.ru_utime - before.ru_utime, "wall_s": wall})
    return {k: median(r[k] for r in rows[1:]) for k in rows[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compare", default="allocator", choices=tuple(COMPARISONS))
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.dtype, args.steps, args.threads)))
        return 0

    from _tiny import MODELS, build_model
    from logprobs import cpu_flags

    tmp = tempfile.TemporaryDirectory()
    model_dir = str(Path(tmp.name) / "30M")
    build_model(model_dir, MODELS["30M"])
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", *BINDING))}
    settings = COMPARISONS[args.compare]
    # (variables in both settings, variables the second adds)
    shared, added = ({}, rule_variables()) if args.compare == "allocator" else (rule_variables(), BINDING)
    envs = {settings[0]: {**base_env, **shared}, settings[1]: {**base_env, **shared, **added}}
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    for _ in range(args.repeats):
        for setting in settings:  # alternating, so both see the same machine load
            cmd = [sys.executable, __file__, "--child", model_dir, "--dtype", args.dtype,
                   "--steps", str(args.steps), "--threads", str(args.threads)]
            out = subprocess.run(cmd, env=envs[setting], capture_output=True, text=True, check=True)
            runs[setting].append(json.loads(out.stdout.strip().splitlines()[-1]))
    result = {"cpu_flags": cpu_flags(), "compare": args.compare, "dtype": args.dtype, "threads": args.threads,
              "load_average": os.getloadavg()[0],
              "variables": added,
              "settings": {s: {k: median(r[k] for r in rs) for k in rs[0]} for s, rs in runs.items()}}
    a, b = (result["settings"][s] for s in settings)
    result["update_speedup"] = a["wall_s"] / b["wall_s"]
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"30M {args.dtype}, {args.threads} thread(s), CPU flags {' '.join(result['cpu_flags'])}, "
          f"load {result['load_average']:.1f}")
    print(f"{'setting':<24} {'minor faults':>13} {'sys s':>7} {'user s':>7} {'wall s':>7}")
    for s in settings:
        r = result["settings"][s]
        print(f"{s:<24} {r['minor_faults']:>13.0f} {r['sys_s']:>7.3f} {r['user_s']:>7.3f} {r['wall_s']:>7.3f}")
    print(f"update speedup {result['update_speedup']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
