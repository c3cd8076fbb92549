"""`polyrl bench NAME`: run a benchmark from the source checkout's `benchmarks/` directory.

Benchmarks compare polyrl against a baseline measured in the same run and print ratios; they are
not tests. They live outside the package (TRL and friends are benchmark-only dependencies), so
this command needs a source checkout (`pip install -e .`).

`polyrl bench rollout --against vllm` compares the native engine with the real vLLM (its CPU
build on a CPU machine); run it with a Python that has vLLM (scripts/vllm_tier.sh's venv).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import polyrl
from polyrl.cli.common import CLIError

BENCH_DIR = Path(polyrl.__file__).resolve().parent.parent / "benchmarks"


def available() -> list[str]:
    if not BENCH_DIR.is_dir():
        return []
    return sorted(p.stem for p in BENCH_DIR.glob("*.py") if not p.stem.startswith("_"))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks against a baseline in the same run (rollout, grpo, ...)",
                       description=f"Run benchmarks/NAME.py; available: {', '.join(available()) or 'none'}. "
                       "Arguments after NAME go to the benchmark (e.g. --json, --quick; "
                       "rollout --against vllm: the native engine vs the real vLLM; rollout --moe, "
                       "grpo --sizes moe: the mixture-of-experts cells).")
    p.add_argument("name", help="benchmark name")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    path = BENCH_DIR / f"{args.name}.py"
    if not path.is_file():
        raise CLIError(f"unknown benchmark '{args.name}'; available: {', '.join(available()) or 'none'} "
                       f"(benchmarks need a source checkout: pip install -e .)")
    return int(load(args.name).main(args.args) or 0)


def load(name: str):
    """benchmarks/NAME.py as a module, importable siblings included: benchmarks share helpers
    (`from logprobs import cpu_flags`, `from _tiny import MODELS`) as they do when run as
    `python benchmarks/NAME.py`, where Python puts their directory first on sys.path."""
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    spec = importlib.util.spec_from_file_location(f"polyrl_bench_{name}", BENCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there while it executes
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module
