"""`polyrl train ARGS` run in the test's own process, for the bad-input tests of every area."""

from __future__ import annotations

import subprocess

import pytest


@pytest.fixture
def train_here(capsys, caplog, tmp_path):
    """`polyrl train ARGS` in this process, through the function `python -m polyrl` exits with
    (polyrl.cli.main.main): the same code path without a new interpreter importing torch and
    Ray (~5 s each). Every failure here fails before Ray starts. A traceback either escapes
    main() (the test errors) or is logged: the log is checked with stderr."""
    from polyrl.cli.main import main

    def run(*args):
        code = main(["train", "trainer.progress_bar=false", f"trainer.output_dir={tmp_path / 'out'}", *args])
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err + caplog.text)

    return run
