"""Issue #44's done-when, end to end: a user's own random Qwen3-MoE directory trains with
`polyrl train actor.strategy=fsdp2 actor.world_size=2 actor.expert_parallel_size=2
actor.router_replay=R3` through real Ray (the tests' shared local instance), and the step logs
the MoE metrics and the engine / trainer log-prob gap (docs/moe.md "End to end")."""

from __future__ import annotations

import json

import pytest

from moe_models import build_moe_model


@pytest.mark.slow  # one 2-rank Ray run
def test_polyrl_train_a_random_qwen3_moe_with_ep2_and_r3(ray_session, arith_files, tmp_path, capsys):
    from polyrl.cli.main import main

    model = build_moe_model(tmp_path / "my-moe", "qwen3_moe", layers=2)  # 6 experts, top-2: 3 per rank
    out = tmp_path / "out"
    code = main(["train", f"model.path={model}", f"data.train_files=[{arith_files['train']}]",
                 "data.val_files=[]", "trainer.val_before_train=false", "data.train_batch_size=2", "rollout.n=2",
                 "rollout.response_length=4", "trainer.total_steps=1", "trainer.save_at_end=false",
                 "trainer.progress_bar=false", "actor.num_cpus_per_worker=1", f"trainer.output_dir={out}",
                 "actor.strategy=fsdp2", "actor.world_size=2", "actor.expert_parallel_size=2",
                 "actor.router_replay=R3"])
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in steps if "actor/loss" in r)
    for key in ("moe/route_match", "moe/expert_load_max", "rollout/logprob_diff_mean"):
        assert key in step, sorted(step)
    # fp32, the native engine: the trainer's routers pick the engine's experts, the gap is rounding
    assert step["moe/route_match"] == pytest.approx(1.0, abs=1e-6)
    assert 1 / 6 <= step["moe/expert_load_max"] <= 1 / 2
    assert step["rollout/logprob_diff_mean"] < 1e-4
