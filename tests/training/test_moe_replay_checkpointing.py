"""Rollout routing replay (R3, training/moe_replay.py) under gradient checkpointing: the backward's
recompute of each layer must route as the forward did, with the replayed (engine) routes, not the
router's own choice. On one ddp rank in fp32 the update's loss, gradient norm and weights with
checkpointing on equal those with it off, on routes the trainer's router would not pick itself."""

from __future__ import annotations

import pytest
import torch

import engine_ranks
from moe_models import build_moe_model
from polyrl.batch.routes import not_routed

EXPERTS, TOP_K, MOE_LAYERS = 6, 2, 2  # tests/moe_models.py: 3 layers, the middle one dense


def engine_routes(batch, seed: int):
    """k distinct random experts per response token and MoE layer (a fifth unmarked: the trainer
    routes those), so most replayed sets differ from the router's own."""
    g = torch.Generator().manual_seed(seed)
    n = len(batch.response_ids.values)
    ids = torch.rand(n, MOE_LAYERS, EXPERTS, generator=g).argsort(-1)[..., :TOP_K].to(torch.uint8)
    ids[torch.rand(n, generator=g) < 0.2] = not_routed(torch.uint8)
    return batch.replace(routes=batch.response_ids.with_values(ids))


def r3_update(model_path: str, checkpointing: bool) -> tuple[dict, dict]:
    cfg = engine_ranks.actor_config("ddp", router_replay="R3", gradient_checkpointing=checkpointing,
                                    param_dtype="float32", compute_dtype="float32", ppo_epochs=1)
    engine, actor = engine_ranks.build(model_path, cfg, 0, 1)
    batch = engine_routes(engine_ranks.make_batch(4, 4), 4)
    metrics = actor.update(batch, num_mini_batches=1, use_rollout_logprobs=False)
    return metrics, engine_ranks.full_weights(engine)


@pytest.mark.slow
def test_r3_with_gradient_checkpointing_equals_without(tmp_path):
    path = build_moe_model(tmp_path / "moe", "qwen3_moe")
    off, weights_off = r3_update(path, checkpointing=False)
    on, weights_on = r3_update(path, checkpointing=True)
    assert off["moe/route_match"] < 0.5  # the replayed routes are mostly not the router's own
    for key in ("actor/loss", "actor/grad_norm"):
        assert on[key] == pytest.approx(off[key], rel=1e-6, abs=1e-7), key
    for name, w in weights_off.items():
        torch.testing.assert_close(weights_on[name], w, rtol=0, atol=1e-6)
