"""Measure the engine / trainer gap of a mixture-of-experts policy with and without routing replay
(docs/moe.md, "Measured"): the native engine samples the bundled arithmetic prompts with
builtin:tiny-moe, the trainer takes one on-policy update of that batch, and the update reports
`moe/route_match` (the trainer's own top-k sets that equal the engine's) and
`rollout/logprob_diff_mean|max` (the first forward's |trainer - engine| log-prob).

    python scripts/moe_replay_gap.py            # fp32 and bf16, replay off and R3
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402


def measure(dtype: str, mode: str, prompts: int = 64, n: int = 8) -> dict:
    from polyrl.algorithms import AlgorithmConfig
    from polyrl.algorithms.off_policy import OffPolicyConfig
    from polyrl.builtin import resolve
    from polyrl.platform import get_platform
    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native.engine import NativeEngine
    from polyrl.training import build_engine
    from polyrl.training.config import ActorConfig
    from polyrl.training.model_loading import load_causal_lm
    from polyrl.workers.actor import PPOActor
    from polyrl.workers.generation import to_batch

    path = resolve("builtin:tiny-moe")
    engine = NativeEngine(path, dtype=dtype, max_model_len=64)
    import pandas as pd

    rows = pd.read_parquet(resolve("builtin:arithmetic_val")).head(prompts)
    tok = engine.tokenizer
    ids = [tok.apply_chat_template(list(m), add_generation_prompt=True, tokenize=True) for m in rows["prompt"]]
    ids = [list(i["input_ids"]) if hasattr(i, "keys") else list(i) for i in ids]
    outs = engine.generate_batch(ids, SamplingParams(n=n, max_tokens=8, seed=0))
    batch = to_batch(tok, engine.eos_token_ids, ids, outs, list(range(len(ids))))
    batch = batch.replace(advantages=torch.randn(len(batch), generator=torch.Generator().manual_seed(0)))
    cfg = ActorConfig(strategy="ddp", lr=1e-4, ppo_epochs=1, router_replay=mode, param_dtype=dtype, compute_dtype=dtype)
    platform = get_platform("cpu")
    model = load_causal_lm(path, dtype)
    trainer = build_engine(model, cfg, platform, torch.device("cpu"), rank=0, world_size=1, group=None, horizon=4)
    actor = PPOActor(trainer, cfg, AlgorithmConfig(), OffPolicyConfig().resolve(on_policy=True), torch.device("cpu"))
    m = actor.update(batch, 1, False, version=0)
    return {k: m[k] for k in ("moe/route_match", "rollout/logprob_diff_mean", "rollout/logprob_diff_max")}


if __name__ == "__main__":
    torch.set_num_threads(1)
    for dtype in ("float32", "bfloat16"):
        for mode in ("off", "R3"):
            r = measure(dtype, mode)
            print(f"{dtype:9s} {mode:3s} route_match {r['moe/route_match']:.4f}  logprob_diff mean "
                  f"{r['rollout/logprob_diff_mean']:.2e} max {r['rollout/logprob_diff_max']:.2e}", flush=True)
