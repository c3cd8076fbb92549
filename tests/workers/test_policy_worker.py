"""The policy worker in-process (no Ray): generation into a RolloutBatch, the update through the
training engine, and non-finite updates skipped, counted, then stopping the run."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from polyrl.batch import RolloutBatch
from polyrl.config import load_config
from polyrl.rollout.base import SamplingParams
from polyrl.job import JobConfig
from polyrl.training.base import NonFiniteUpdate
from polyrl.topology.launch_plan import role_plans
from polyrl.workers.policy import PolicyWorker


@pytest.fixture
def worker(tiny_model, arith_files):
    cfg = load_config(JobConfig, overrides=[f"model.path={tiny_model}", "actor.max_nonfinite_steps=2",
                                            "rollout.max_model_len=64"])
    [role] = role_plans(cfg, num_threads=1)["policy"]  # colocated: hosts its engine, in place
    w = PolicyWorker(cfg, role, total_steps=10)
    w.setup(None)
    return w


def samples(w, advantage: float, n: int = 4) -> RolloutBatch:
    rows = [SimpleNamespace(prompt_ids=[5, 6, 7]), SimpleNamespace(prompt_ids=[8, 9])]
    out = w.generate(rows, SamplingParams(n=n // 2, max_tokens=4, temperature=1.0), seeds=[1, 2])
    out.advantages = torch.full((len(out),), advantage)
    return out.for_training()


def params(w) -> list[torch.Tensor]:
    return [p.detach().clone() for p in w.engine.model.parameters()]


def test_generate_returns_version_and_logprobs(worker):
    out = samples(worker, 1.0)
    assert len(out) == 4 and out.group.tolist() == [0, 0, 1, 1]
    assert torch.equal(out.rollout_logprobs.lengths, out.response_ids.lengths)
    assert torch.equal(out.loss_mask.values, torch.ones_like(out.loss_mask.values))
    current = worker.logprobs(out, which="current")
    # engine log-probs == trainer forward (fp32), token by token
    assert torch.allclose(current.values, out.rollout_logprobs.values, atol=1e-4)
    assert torch.equal(current.offsets, out.response_ids.offsets)


def test_update_changes_weights_and_sync_bumps_version(worker):
    before = params(worker)
    metrics = worker.update(samples(worker, 1.0), num_mini_batches=1, use_rollout_logprobs=False)
    assert metrics["actor/nonfinite_skipped"] == 0.0 and metrics["actor/grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, worker.engine.model.parameters()))
    synced = worker.sync_weights()  # hybrid: in place into the colocated engine
    assert synced["weight_sync/version"] == 1 and worker.version == 1
    out = samples(worker, 1.0)
    assert out.weight_version.tolist() == [1] * len(out)


def test_update_with_per_token_advantages_equals_broadcast(worker):
    """A per-sequence advantage and the same value written per token give the same update."""
    batch = samples(worker, 0.5)
    per_token = batch.replace(advantages=None, token_advantages=batch.token_advantage_rows())
    start = params(worker)
    a = worker.update(batch, 1, False)
    after_a = params(worker)
    with torch.no_grad():
        for p, s in zip(worker.engine.model.parameters(), start):
            p.copy_(s)
    worker.engine.optimizer.state.clear()  # the same fresh optimizer state for the second run
    b = worker.update(per_token, 1, False)
    assert a["actor/loss"] == b["actor/loss"]
    assert all(torch.equal(x, y) for x, y in zip(after_a, worker.engine.model.parameters()))


def test_nonfinite_updates_are_skipped_then_stop(worker):
    before = params(worker)
    m = worker.update(samples(worker, math.nan), 1, False)
    assert m["actor/nonfinite_skipped"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, worker.engine.model.parameters()))
    worker.update(samples(worker, 1.0), 1, False)  # a good step resets the count
    assert worker.engine.nonfinite_in_a_row == 0
    worker.update(samples(worker, math.inf), 1, False)
    with pytest.raises(NonFiniteUpdate, match="2 updates in a row had a NaN/inf"):
        worker.update(samples(worker, math.nan), 1, False)
