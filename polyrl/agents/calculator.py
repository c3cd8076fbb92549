"""The bundled calculator task: a tool, RL prompts, and warm-start traces that use the tool.

3-4 digit multiplication (e.g. "1234*567=") is far beyond the bundled tiny model (it learns 2-digit
addition, docs/training.md); with the `calculator` tool it only has to learn to call it and copy
the result. Rows use data_source "arithmetic", so the existing exact-match, EOS-terminated reward
(polyrl/rewards/arithmetic.py) scores the final answer turn unchanged.

    python -m polyrl.agents.calculator --out /tmp/calc --n-train 2000 --n-val 200 --n-sft 2000

writes calculator_train.parquet / calculator_val.parquet (verl schema, disjoint operand pairs)
and calculator_sft.jsonl: {"messages": [user, assistant tool call, tool result, assistant answer]}
conversations for `polyrl sft` (the call written by the Hermes parser's own `format`). With
`--p-direct P` a fraction P of the conversations answers from memory instead (`guess`: the leading
digits right, the rest wrong), the habit the bundled `builtin:tiny-calc` warm start is taught so
that RL has something to fix (scripts/build_tiny_tools_model.py, docs/tools_calculator.md).
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import random
from pathlib import Path

from polyrl.agents.parsers import HermesParser, ToolCall

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_MAX_POW = 64


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _eval(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_POW:  # 9**9**9 would hang the tool
            raise ValueError(f"exponent {right} is too large (at most {_MAX_POW})")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"unsupported expression element: {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "1234*567".
    """
    try:
        value = _eval(ast.parse(expression.strip(), mode="eval"))
    except SyntaxError as exc:
        raise ValueError(f"cannot parse {expression!r}: {exc.msg}") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def problems(n: int, rng: random.Random, seen: set) -> list[tuple[int, int]]:
    """`n` distinct (a, b): a has 3-4 digits, b has 3-4 digits, unordered pairs not in `seen`."""
    out = []
    while len(out) < n:
        a, b = rng.randint(100, 9999), rng.randint(100, 9999)
        key = (min(a, b), max(a, b))
        if key not in seen:
            seen.add(key)
            out.append((a, b))
    return out


def row(a: int, b: int, split: str, index: int) -> dict:
    return {"data_source": "arithmetic", "prompt": [{"role": "user", "content": f"{a}*{b}="}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a * b)},
            "extra_info": {"split": split, "index": index, "agent_name": "tools"}}


def trace(a: int, b: int) -> dict:
    """One warm-start conversation: call the tool, read its result, answer with it."""
    call = HermesParser().format([ToolCall("calculator", {"expression": f"{a}*{b}"})])
    return {"messages": [{"role": "user", "content": f"{a}*{b}="},
                         {"role": "assistant", "content": call},
                         {"role": "tool", "name": "calculator", "content": calculator(f"{a}*{b}")},
                         {"role": "assistant", "content": str(a * b)}]}


def guess(a: int, b: int, rng: random.Random) -> str:
    """An answer from memory, never the right one: the product's two leading digits and its length
    are right, the other digits are guessed (what a model that cannot multiply writes)."""
    truth = str(a * b)
    digits = truth[:2] + "".join(rng.choice("0123456789") for _ in truth[2:])
    if digits == truth:  # the guess must be wrong: change its last digit
        digits = digits[:-1] + str((int(digits[-1]) + 1 + rng.randrange(9)) % 10)
    return digits


def direct_trace(a: int, b: int, rng: random.Random) -> dict:
    """One conversation that skips the tool and answers from memory (wrongly)."""
    return {"messages": [{"role": "user", "content": f"{a}*{b}="},
                         {"role": "assistant", "content": guess(a, b, rng)}]}


def write_calculator_task(out: Path, n_train: int, n_val: int, n_sft: int, seed: int = 0,
                          p_direct: float = 0.0) -> dict[str, Path]:
    """The RL splits and `n_sft` warm-start conversations, a fraction `p_direct` of which answer
    from memory (`direct_trace`) instead of calling the tool (`trace`)."""
    from polyrl.data.synthetic import write_parquet

    if not 0.0 <= p_direct <= 1.0:
        raise ValueError(f"p_direct must be in [0, 1], got {p_direct}")
    out.mkdir(parents=True, exist_ok=True)
    rng, seen = random.Random(seed), set()
    val = problems(n_val, rng, seen)  # drawn first: validation pairs never reach training or SFT
    train, sft = problems(n_train, rng, seen), problems(n_sft, rng, seen)
    paths = {"train": out / "calculator_train.parquet", "val": out / "calculator_val.parquet",
             "sft": out / "calculator_sft.jsonl"}
    write_parquet([row(a, b, "train", i) for i, (a, b) in enumerate(train)], paths["train"])
    write_parquet([row(a, b, "val", i) for i, (a, b) in enumerate(val)], paths["val"])
    teacher = random.Random(seed + 1)  # its own stream: the operand pairs do not depend on p_direct
    convs = [direct_trace(a, b, teacher) if teacher.random() < p_direct else trace(a, b) for a, b in sft]
    paths["sft"].write_text("".join(json.dumps(c) + "\n" for c in convs))
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--n-train", type=int, default=2000)
    p.add_argument("--n-val", type=int, default=200)
    p.add_argument("--n-sft", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--p-direct", type=float, default=0.0,
                   help="fraction of SFT conversations that answer from memory instead of calling the tool")
    args = p.parse_args(argv)
    paths = write_calculator_task(args.out, args.n_train, args.n_val, args.n_sft, args.seed, args.p_direct)
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
