"""Bundled assets addressed as `builtin:NAME`: the tiny models and the synthetic tasks' data
(scripts/build_tiny_model.py builds tiny-arith and the arithmetic files,
scripts/build_tiny_tools_model.py tiny-calc and the calculator files,
scripts/build_tiny_vl_model.py the vision-language tiny-vl and the shapes files,
scripts/build_tiny_moe_model.py the mixture-of-experts tiny-moe, on the arithmetic files)."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
PREFIX = "builtin:"

BUILTINS = {
    "tiny-arith": ASSETS / "tiny-arith",
    "arithmetic_train": ASSETS / "data" / "arithmetic_train.parquet",
    "arithmetic_val": ASSETS / "data" / "arithmetic_val.parquet",
    "arithmetic_chat_train": ASSETS / "data" / "arithmetic_chat_train.parquet",
    "arithmetic_chat_val": ASSETS / "data" / "arithmetic_chat_val.parquet",
    "tiny-calc": ASSETS / "tiny-calc",
    "calculator_train": ASSETS / "data" / "calculator_train.parquet",
    "calculator_val": ASSETS / "data" / "calculator_val.parquet",
    "tiny-vl": ASSETS / "tiny-vl",
    "tiny-moe": ASSETS / "tiny-moe",
    "shapes_train": ASSETS / "data" / "shapes_train.parquet",
    "shapes_val": ASSETS / "data" / "shapes_val.parquet",
}


def resolve(path: str) -> str:
    """`builtin:NAME` -> the bundled file or directory; any other path is returned unchanged."""
    if not path.startswith(PREFIX):
        return path
    name = path[len(PREFIX):]
    if name not in BUILTINS:
        raise FileNotFoundError(
            f"unknown bundled asset '{path}'; available: "
            f"{', '.join(PREFIX + n for n in BUILTINS)}"
        )
    return str(BUILTINS[name])
