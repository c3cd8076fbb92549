"""The `polyrl` entry point: every subcommand is wired, and a subcommand that fails to import
fails loudly instead of silently vanishing from the CLI."""

from __future__ import annotations

import pytest

from polyrl.cli import main as cli


def test_every_subcommand_is_in_the_parser():
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert set(commands) == set(cli.SUBCOMMANDS)
    assert {"train", "env", "doctor", "serve", "bench", "plot"} <= set(commands)


def test_a_subcommand_that_cannot_be_imported_is_an_error(monkeypatch):
    monkeypatch.setitem(cli.SUBCOMMANDS, "ghost", "polyrl.cli.ghost")
    with pytest.raises(ModuleNotFoundError, match="polyrl.cli.ghost"):
        cli.build_parser()


def test_bench_modules_import_their_siblings_when_run_by_polyrl_bench():
    """`polyrl bench rollout --against vllm` imported `logprobs` (a sibling benchmark) inside a
    function and failed after measuring: every sibling a benchmark imports must resolve."""
    import ast
    import importlib

    from polyrl.cli import bench

    siblings = {p.stem for p in bench.BENCH_DIR.glob("*.py")}
    for name in bench.available():
        bench.load(name)
        tree = ast.parse((bench.BENCH_DIR / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in siblings:
                importlib.import_module(node.module)
