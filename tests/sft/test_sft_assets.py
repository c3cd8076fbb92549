"""The bundled chat files are what scripts/build_tiny_model.py writes: correct answers to the RL
train / val problems, so SFT's held-out split is the RL held-out split."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pyarrow.parquet as pq

from polyrl.data.synthetic import split_problems
from polyrl.builtin import resolve

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))


def test_bundled_chat_files_match_the_build_script():
    import build_tiny_model as build

    train, val, _ = split_problems(4000, 500, seed=0)
    for name, problems in (("train", train), ("val", val)):
        rows = pq.read_table(resolve(f"builtin:arithmetic_chat_{name}")).to_pylist()
        assert rows == build.chat_rows(problems, build.Teacher(), random.Random(0))
        for r in rows:
            a, b = r["messages"][0]["content"].removesuffix("=").split("+")
            assert r["messages"][1]["content"] == str(int(a) + int(b))
