"""`polyrl train rollout.batch_invariant=true`: the engine's log-probs equal the trainer's at
every step of a real run (rollout/logprob_diff_max exactly 0.0), with the policy and reference
switched to the shared forward by the policy worker (workers/policy.py)."""

from __future__ import annotations

import json

import pytest

from polyrl.cli.main import main


@pytest.mark.slow
def test_logprob_gap_is_exactly_zero_every_step(tmp_path):
    out = tmp_path / "run"
    code = main(["train", "trainer.progress_bar=false", f"trainer.output_dir={out}",
                 "trainer.total_steps=2", "trainer.val_before_train=false", "trainer.val_every=0",
                 "trainer.save_at_end=false", "rollout.batch_invariant=true",
                 "rollout.dtype=bfloat16", "actor.compute_dtype=bfloat16"])
    assert code == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    gaps = [s["rollout/logprob_diff_max"] for s in steps if "rollout/logprob_diff_max" in s]
    assert len(gaps) == 2 and gaps == [0.0, 0.0], gaps


def test_mismatched_dtypes_are_refused_in_one_line(capsys, tmp_path):
    code = main(["train", f"trainer.output_dir={tmp_path / 'o'}", "rollout.batch_invariant=true",
                 "rollout.dtype=bfloat16", "actor.compute_dtype=float32"])
    err = capsys.readouterr().err
    assert code == 2 and "actor.compute_dtype=bfloat16" in err and "Traceback" not in err, err
