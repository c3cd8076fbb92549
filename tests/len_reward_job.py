"""The small GRPO job the trainer tests compare layouts with: the tiny model on the arithmetic
data, with a reward that varies within groups (a user reward function, path.py:function) so that
GRPO has signal; and its metrics as written."""

from __future__ import annotations

import json

from polyrl.config import load_config
from polyrl.job import JobConfig


def job(tiny_model, arith_files, out, *overrides, steps: int = 2, val_every: int = 1):
    """`steps` steps, validated before training and every `val_every` steps."""
    reward = out.parent / f"{out.name}_len_reward.py"
    reward.parent.mkdir(parents=True, exist_ok=True)
    reward.write_text("def score(solution_str, ground_truth, extra_info=None):\n"
                      "    return len(solution_str) / 10\n")
    return load_config(JobConfig, overrides=[
        f"model.path={tiny_model}", f"data.train_files=[{arith_files['train']}]",
        f"data.val_files=[{arith_files['val']}]", "data.train_batch_size=4", "rollout.n=4",
        "rollout.response_length=6", "actor.lr=0.01", f"reward.custom_function={reward}:score",
        f"trainer.total_steps={steps}", f"trainer.val_every={val_every}", "trainer.progress_bar=false",
        "trainer.save_at_end=false", "actor.num_cpus_per_worker=1", f"trainer.output_dir={out}",
        *overrides])


def read(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
