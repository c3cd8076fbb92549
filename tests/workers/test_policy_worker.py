"""The policy worker in-process (no Ray): non-finite updates are skipped, counted, then stop."""

from __future__ import annotations

import math

import pytest
import torch

from polyrl.config import load_config
from polyrl.trainer.config import JobConfig
from polyrl.workers.batch import Sample, collate, plan_micro_batches, split_evenly
from polyrl.workers.policy import NonFiniteUpdate, PolicyWorker


@pytest.fixture
def worker(tiny_model, arith_files):
    cfg = load_config(JobConfig, overrides=[f"model.path={tiny_model}", "actor.max_nonfinite_steps=2",
                                            "rollout.max_model_len=64"])
    w = PolicyWorker(cfg, rank=0, world_size=1, total_steps=10, num_threads=1)
    w.setup(None)
    return w


def samples(w, advantage: float, n: int = 4) -> list[Sample]:
    out = w.generate([[5, 6, 7], [8, 9]], {"n": n // 2, "max_tokens": 4, "temperature": 1.0}, seeds=[1, 2])
    for s in out:
        s.advantages = [advantage] * len(s.response_ids)
    return out


def test_generate_returns_version_and_logprobs(worker):
    out = samples(worker, 1.0)
    assert len(out) == 4 and {s.group for s in out} == {0, 1}
    assert all(len(s.rollout_logprobs) == len(s.response_ids) for s in out)
    current = worker.logprobs(out, which="current")
    for s, lp in zip(out, current):  # engine log-probs == trainer forward (fp32)
        assert lp == pytest.approx(s.rollout_logprobs, abs=1e-4)


def test_update_changes_weights_and_sync_bumps_version(worker):
    before = [p.detach().clone() for p in worker.model.parameters()]
    metrics = worker.update(samples(worker, 1.0), num_mini_batches=1, use_rollout_logprobs=False)
    assert metrics["actor/nonfinite_skipped"] == 0.0 and metrics["actor/grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, worker.model.parameters()))
    assert worker.sync_weights() == {}  # hybrid: in place, no transfer stats
    assert worker.version == 1
    out = samples(worker, 1.0)
    assert {s.weight_version for s in out} == {1}


def test_nonfinite_updates_are_skipped_then_stop(worker):
    before = [p.detach().clone() for p in worker.model.parameters()]
    m = worker.update(samples(worker, math.nan), 1, False)
    assert m["actor/nonfinite_skipped"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, worker.model.parameters()))
    worker.update(samples(worker, 1.0), 1, False)  # a good step resets the count
    assert worker.nonfinite_in_a_row == 0
    worker.update(samples(worker, math.inf), 1, False)
    with pytest.raises(NonFiniteUpdate, match="2 updates in a row had a NaN/inf"):
        worker.update(samples(worker, math.nan), 1, False)


def test_micro_batches_respect_budget_and_alignment():
    ss = [Sample(prompt_ids=[1] * p, response_ids=[2] * r) for p, r in [(3, 2), (5, 4), (2, 1), (4, 4)]]
    plan = plan_micro_batches(ss, token_budget=16)
    assert sorted(i for mb in plan for i in mb) == [0, 1, 2, 3]
    for mb in plan:
        assert max(ss[i].length for i in mb) * len(mb) <= 16 or len(mb) == 1
    mb = collate(ss, [1], torch.device("cpu"))
    # response token k of a 5-token prompt is predicted from position 5 + k - 1
    assert mb.gather_index[0].tolist() == [4, 5, 6, 7]
    assert split_evenly(list(range(5)), 3) == [[0, 1], [2, 3], [4]]
    assert split_evenly([1], 3) == [[1], [], []]
