"""Seeded synthetic arithmetic task with a verifiable answer (data_source ``"arithmetic"``).

A problem is two integers and an operator rendered as a bare prompt, e.g. ``"37+48="``; the
ground truth is the exact decimal answer (``"85"``). Rows follow verl's dataset schema::

    {"data_source": "arithmetic",
     "prompt": [{"role": "user", "content": "37+48="}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "85"},
     "extra_info": {"split": "train", "index": 0}}

Train and validation problems are disjoint *as unordered operand pairs*: if ``37+48=`` is in one
split, neither ``37+48=`` nor ``48+37=`` is in the other, so held-out accuracy measures
generalisation, not memorisation of a commuted twin.

Everything is a pure function of its arguments (a ``random.Random(seed)`` per call, no global
state), so the same seed always yields the same rows in the same order.

Command line (writes ``arithmetic_train.parquet`` and ``arithmetic_val.parquet``)::

    python -m polyrl.data.synthetic --out /tmp/data --n-train 4000 --n-val 500 --seed 0
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

DATA_SOURCE = "arithmetic"
ABILITY = "math"
SUPPORTED_OPS = ("+", "-")


@dataclass(frozen=True)
class Problem:
    """One arithmetic problem. For ``-`` the generator keeps ``a >= b`` (answers are never negative)."""

    a: int
    b: int
    op: str = "+"

    @property
    def prompt(self) -> str:
        return f"{self.a}{self.op}{self.b}="

    @property
    def answer(self) -> int:
        if self.op == "+":
            return self.a + self.b
        if self.op == "-":
            return self.a - self.b
        raise ValueError(f"unsupported op {self.op!r}; valid: {SUPPORTED_OPS}")

    @property
    def ground_truth(self) -> str:
        return str(self.answer)

    @property
    def key(self) -> tuple[str, int, int]:
        """Split key: commutative twins (``a+b`` / ``b+a``) share a key and so a split."""
        if self.op == "+":
            return (self.op, min(self.a, self.b), max(self.a, self.b))
        return (self.op, self.a, self.b)


def all_problems(max_operand: int = 99, ops: Sequence[str] = ("+",)) -> list[Problem]:
    """Every problem with operands in ``[0, max_operand]`` for the given ops, in a fixed order."""
    for op in ops:
        if op not in SUPPORTED_OPS:
            raise ValueError(f"unsupported op {op!r}; valid: {SUPPORTED_OPS}")
    out = []
    for op in ops:
        for a in range(max_operand + 1):
            for b in range(max_operand + 1):
                if op == "-" and a < b:
                    continue
                out.append(Problem(a, b, op))
    return out


def split_problems(
    n_train: int,
    n_val: int,
    seed: int = 0,
    max_operand: int = 99,
    ops: Sequence[str] = ("+",),
) -> tuple[list[Problem], list[Problem], list[Problem]]:
    """Deterministic disjoint split.

    Returns ``(train, val, rest)``: ``val`` has ``n_val`` problems, ``train`` ``n_train`` problems
    whose keys never appear in ``val``, and ``rest`` every remaining problem that is also disjoint
    from ``val`` (useful as extra supervised warm-start data that never touches held-out keys).
    """
    problems = all_problems(max_operand, ops)
    keys = sorted({p.key for p in problems})
    rng = random.Random(seed)
    rng.shuffle(keys)
    val_keys: set = set()
    val: list[Problem] = []
    by_key: dict = {}
    for p in problems:
        by_key.setdefault(p.key, []).append(p)
    # Take whole key groups for val until n_val problems are collected.
    for k in keys:
        if len(val) >= n_val:
            break
        group = by_key[k]
        if len(val) + len(group) > n_val:
            group = group[: n_val - len(val)]
        val.extend(group)
        val_keys.add(k)
    pool = [p for p in problems if p.key not in val_keys]
    rng.shuffle(pool)
    rng.shuffle(val)
    if n_train > len(pool):
        raise ValueError(
            f"n_train={n_train} exceeds the {len(pool)} problems left after the val split; "
            f"lower n_train/n_val or raise max_operand"
        )
    return pool[:n_train], val, pool[n_train:]


def make_row(problem: Problem, split: str, index: int) -> dict:
    """One dataset row in verl's schema."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem.prompt}],
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": problem.ground_truth},
        "extra_info": {"split": split, "index": index},
    }


def make_rows(problems: Iterable[Problem], split: str) -> list[dict]:
    return [make_row(p, split, i) for i, p in enumerate(problems)]


def generate_splits(
    n_train: int = 4000,
    n_val: int = 500,
    seed: int = 0,
    max_operand: int = 99,
    ops: Sequence[str] = ("+",),
) -> tuple[list[dict], list[dict]]:
    """Train and val rows (verl schema), disjoint by operand pair, deterministic for ``seed``."""
    train, val, _ = split_problems(n_train, n_val, seed, max_operand, ops)
    return make_rows(train, "train"), make_rows(val, "val")


def write_parquet(rows: list[dict], path: str | Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_arithmetic_dataset(
    out_dir: str | Path,
    n_train: int = 4000,
    n_val: int = 500,
    seed: int = 0,
    max_operand: int = 99,
    ops: Sequence[str] = ("+",),
) -> dict[str, Path]:
    """Write ``arithmetic_train.parquet`` and ``arithmetic_val.parquet`` into ``out_dir``."""
    train, val = generate_splits(n_train, n_val, seed, max_operand, ops)
    out_dir = Path(out_dir)
    return {
        "train": write_parquet(train, out_dir / "arithmetic_train.parquet"),
        "val": write_parquet(val, out_dir / "arithmetic_val.parquet"),
    }


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write the synthetic arithmetic train/val parquet files.")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--n-train", type=int, default=4000)
    ap.add_argument("--n-val", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-operand", type=int, default=99)
    ap.add_argument("--ops", default="+", help="operators to mix, e.g. '+' or '+-'")
    args = ap.parse_args(argv)
    paths = write_arithmetic_dataset(
        args.out, args.n_train, args.n_val, args.seed, args.max_operand, tuple(args.ops)
    )
    for split, p in paths.items():
        print(f"{split}: {p}")


if __name__ == "__main__":
    main()
