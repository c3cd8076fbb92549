"""`rollout/logprob_diff_mean|max`: |trainer - engine| log-prob over the loss tokens the engine
sampled with the trainer's current weights, on every update path of the PPO actor."""

from __future__ import annotations

import pytest
import torch

import engine_ranks

OFFSET = 0.25
STALE_OFFSET = 7.0


def _batch(engine, version: int):
    """engine_ranks' batch whose rollout log-probs are the trainer's own plus OFFSET; sample 0
    comes from an older version (its gap must not count) and one loss-masked token is far off."""
    batch = engine_ranks.make_batch(seed=5, n=6)
    trainer = engine.logprobs(batch).values.float().cpu()
    gap = torch.full_like(trainer, OFFSET)
    off0 = batch.response_ids.offsets[0]
    gap[off0: off0 + batch.response_ids.lengths[0]] = STALE_OFFSET  # sample 0: stale
    masked = (batch.loss_mask.values == 0).nonzero()[0, 0]
    gap[masked] = STALE_OFFSET  # a token the policy did not sample
    versions = torch.full((len(batch),), version, dtype=torch.long)
    versions[0] = version - 1
    return batch.replace(rollout_logprobs=batch.response_ids.with_values(trainer - gap),
                         min_version=versions, max_version=versions.clone(),
                         weight_version=versions.clone())


@pytest.mark.parametrize("num_mini_batches,epochs,rollout_as_old", [
    (1, 1, False),   # one optimizer step: the update's own forward is the trainer side
    (2, 1, False),   # several: the recomputed proximal log-probs are
    (2, 2, True),    # the rollout's as old: the first optimizer step's forwards are
])
def test_gap_over_fresh_loss_tokens(tiny_model, num_mini_batches, epochs, rollout_as_old):
    cfg = engine_ranks.actor_config("ddp", ppo_epochs=epochs)
    engine, actor = engine_ranks.build(tiny_model, cfg, 0, 1)
    batch = _batch(engine, version=3)
    metrics = actor.update(batch, num_mini_batches, rollout_as_old, version=3)
    assert metrics["rollout/logprob_diff_mean"] == pytest.approx(OFFSET, abs=1e-5)
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(OFFSET, abs=1e-5)


def test_no_fresh_sample_no_metric(tiny_model):
    engine, actor = engine_ranks.build(tiny_model, engine_ranks.actor_config("ddp"), 0, 1)
    batch = _batch(engine, version=3)
    metrics = actor.update(batch, 1, False, version=9)  # all generated with other weights
    assert "rollout/logprob_diff_mean" not in metrics


def test_no_rollout_logprobs_no_metric(tiny_model):
    engine, actor = engine_ranks.build(tiny_model, engine_ranks.actor_config("ddp"), 0, 1)
    batch = engine_ranks.make_batch(seed=5, n=4).replace(rollout_logprobs=None)
    assert "rollout/logprob_diff_max" not in actor.update(batch, 1, False, version=0)
