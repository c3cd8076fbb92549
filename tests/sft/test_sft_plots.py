"""`polyrl plot` on an SFT run: loss curves and a loss summary (RL runs keep their panels:
tests/trainer/test_plots.py)."""

from __future__ import annotations

import json

from polyrl.cli.main import main
from polyrl.trainer.plots import is_sft, read_metrics, summary_rows


def test_sft_run_gets_loss_curves_and_summary(tmp_path, capsys):
    records = [{"step": 0, "val/loss": 0.8, "val/token_acc": 0.5}]
    records += [{"step": s, "train/loss": 1.0 / s, "actor/lr": 1e-3, "actor/grad_norm": 1.0}
                for s in range(1, 11)]
    records += [{"step": 10, "val/loss": 0.2, "val/token_acc": 0.9}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert is_sft(read_metrics(tmp_path))
    rows = dict(summary_rows(tmp_path))
    assert rows["val/loss"] == "0.8 (step 0) -> 0.2 (step 10), best 0.2 at step 10"
    assert rows["val/token_acc"] == "0.5 (step 0) -> 0.9 (step 10), best 0.9 at step 10"
    assert rows["last val/loss"] == "0.2 at step 10" and "last val/acc" not in rows
    assert main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    assert "val/loss" in capsys.readouterr().out


def test_rl_records_are_not_sft():
    assert not is_sft([{"step": 1, "reward/score_mean": 0.5, "actor/loss": 0.1}])
