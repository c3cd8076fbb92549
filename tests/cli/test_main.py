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
