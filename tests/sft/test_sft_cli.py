"""`polyrl sft` follows `polyrl train`'s config conventions; its dry run reports the data plan."""

from __future__ import annotations

import json

import yaml

from polyrl.cli.main import main


def test_print_config_shows_the_no_flag_defaults(capsys):
    assert main(["sft", "--print-config", "actor.lr=3e-4"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["model"]["path"] == "builtin:tiny-arith"
    assert cfg["data"]["train_files"] == ["builtin:arithmetic_chat_train"]
    assert cfg["actor"]["lr"] == 3e-4 and cfg["actor"]["lr_schedule"] == "cosine"


def test_help_config_lists_sft_keys_only(capsys):
    assert main(["sft", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert "data.truncation (Literal, default 'drop')" in out
    assert "actor.micro_batch_tokens" in out and "actor.ppo_epochs" not in out


def test_config_errors_are_one_line_with_suggestions(capsys, tmp_path):
    assert main(["sft", "data.truncaton=left"]) == 2
    assert "did you mean 'data.truncation'?" in capsys.readouterr().err
    assert main(["sft", "actor.ppo_epochs=2"]) == 2
    assert "actor.ppo_epochs has no meaning in polyrl sft" in capsys.readouterr().err
    assert main(["sft", "actor.world_size=2", "actor.sequence_parallel_size=2"]) == 2
    assert "actor.sequence_parallel_size: polyrl sft does not split sequences" in capsys.readouterr().err
    assert main(["sft", "data.prompt_key=q"]) == 2
    assert "set both data.prompt_key and data.response_key" in capsys.readouterr().err
    missing = tmp_path / "nope.jsonl"
    assert main(["sft", f"data.train_files=[{missing}]", "--output-dir", str(tmp_path / "o")]) == 2
    assert f"data file {missing} does not exist" in capsys.readouterr().err
    assert main(["sft", "--json"]) == 2
    assert "--json only applies with --dry-run" in capsys.readouterr().err


def test_dry_run_reports_the_plan_without_training(capsys, tmp_path):
    assert main(["sft", "--dry-run", "--json", "--output-dir", str(tmp_path)]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["train"]["train/conversations"] == 4000 and plan["val"]["val/conversations"] == 500
    assert plan["train"]["train/bad_rows"] == 0
    assert plan["batches_per_epoch"] == 4000 // 64 and plan["steps"] == 2 * (4000 // 64)
    assert plan["max_length"] == 64  # capped by the tiny model's context
    assert not any(tmp_path.iterdir())  # nothing written


def test_shipped_sft_configs_validate(capsys):
    from pathlib import Path

    configs = sorted((Path(__file__).parents[2] / "configs").glob("sft_*.yaml"))
    assert configs
    for path in configs:
        assert main(["sft", "-c", str(path), "--print-config"]) == 0, path
        assert yaml.safe_load(capsys.readouterr().out)["actor"]["world_size"] >= 1
