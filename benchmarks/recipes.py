"""Embedded-task result of each algorithm recipe: the bundled tiny model trained on the bundled
arithmetic task with the embedded default config plus the recipe's keys, 40 steps; held-out
accuracy before and after (docs/algorithms.md, "embedded-task result").

    python benchmarks/recipes.py                 # ~1 minute per recipe on 2 cores
    python benchmarks/recipes.py --only grpo gae --steps 20 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RECIPES = {
    "grpo": [],
    "dr_grpo": ["algorithm.norm_adv_by_std=false", "algorithm.loss_agg_mode=seq-mean-token-sum"],
    "rloo": ["algorithm.adv_estimator=rloo"],
    "reinforce_pp": ["algorithm.adv_estimator=reinforce_pp"],
    "gae": ["algorithm.adv_estimator=gae", "critic.enable=true", "critic.lr=1e-3", "algorithm.lam=0.95"],
    "gspo": ["algorithm.policy_loss=gspo", "algorithm.loss_agg_mode=seq-mean-token-mean"],
    "gspo_token": ["algorithm.policy_loss=gspo_token", "algorithm.loss_agg_mode=seq-mean-token-mean"],
    "dapo": ["algorithm.dynamic_sampling=true", "algorithm.clip_ratio_high=0.28",
             "algorithm.overlong.shaping=true", "algorithm.overlong.buffer_length=2"],
    "kl_loss": ["algorithm.use_kl_loss=true", "algorithm.kl_coef=0.01"],
    "lora_r8": ["model.lora_rank=8"],
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", choices=sorted(RECIPES))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from polyrl.cli.train import EMBEDDED_DEFAULT
    from polyrl.config import load_config
    from polyrl.job import JobConfig
    from polyrl.trainer.loop import Trainer

    results = {}
    for name in args.only or RECIPES:
        with tempfile.TemporaryDirectory() as out:
            cfg = load_config(JobConfig, files=[EMBEDDED_DEFAULT], overrides=[
                f"trainer.total_steps={args.steps}", "trainer.val_every=0", "trainer.progress_bar=false",
                "logging.plot_at_end=false", "trainer.save_at_end=false", f"trainer.output_dir={out}",
                *RECIPES[name]])
            summary = Trainer(cfg).fit()
        results[name] = {"before": summary["initial_accuracy"], "after": summary["final_accuracy"],
                         "seconds": summary["wall_seconds"]}
        print(f"{name:>14}: {summary['initial_accuracy']:.1%} -> {summary['final_accuracy']:.1%} "
              f"({summary['wall_seconds']:.0f} s)", flush=True)
    if args.json:
        print(json.dumps({"steps": args.steps, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
