"""KEY=VALUE overrides may follow an option (issue 41, poor 10): `polyrl train rollout.n=4
--dry-run actor.lr=1e-4` once failed with "unrecognized arguments: actor.lr=1e-4"."""

from __future__ import annotations

import json

import pytest

from polyrl.cli.main import main


def test_overrides_on_both_sides_of_dry_run_all_apply(capsys):
    assert main(["train", "rollout.n=4", "--dry-run", "--json", "actor.lr=1e-4",
                 "--platform", "cpu", "trainer.total_steps=3"]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert (config["rollout"]["n"], config["actor"]["lr"], config["trainer"]["total_steps"]) == (4, 1e-4, 3)


def test_a_later_override_wins_as_it_would_in_one_run_of_words(capsys):
    assert main(["train", "actor.lr=1e-3", "--print-config", "actor.lr=2e-4"]) == 0
    assert "lr: 0.0002" in capsys.readouterr().out


def test_an_unknown_option_after_overrides_is_still_refused(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "actor.lr=1e-4", "--dry-run", "--no-such-flag"])
    assert info.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
