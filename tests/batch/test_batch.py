"""The typed batch: Ragged rows, RolloutBatch select / cat / shard, micro-batch collation and
planning, and the write-back of per-token results."""

from __future__ import annotations

import pickle

import pytest
import torch

from polyrl.batch import (STOP_REASONS, Ragged, RolloutBatch, collate, plan_micro_batches,
                          scatter_rows, shard, split_evenly)

ROWS = [[1, 2, 3], [], [4], [5, 6, 7, 8], [9, 10]]


def batch_of(prompts, responses, **extra) -> RolloutBatch:
    n = len(prompts)
    resp = Ragged.from_rows(responses, torch.long)
    zeros = torch.zeros(n, dtype=torch.long)
    return RolloutBatch(prompt_ids=Ragged.from_rows(prompts, torch.long), response_ids=resp,
                        loss_mask=Ragged.full_like(resp, 1.0, torch.float32), group=torch.arange(n),
                        stop_reason=zeros, finished_with_eos=zeros.bool(), weight_version=zeros,
                        min_version=zeros, max_version=zeros, continuations=zeros, **extra)


def test_ragged_round_trips_and_selects():
    r = Ragged.from_rows(ROWS, torch.long)
    assert r.tolist() == ROWS and r.lengths.tolist() == [3, 0, 1, 4, 2]
    for idx in ([0], [1, 2, 3], [4, 0, 2], [3, 3], list(range(5)), []):
        assert r.select(idx).tolist() == [ROWS[i] for i in idx]
    padded = r.padded(pad=-1)
    assert padded.tolist()[1] == [-1] * 4 and padded.tolist()[3] == [5, 6, 7, 8]
    assert Ragged.from_padded(padded, r.lengths).tolist() == ROWS
    assert Ragged.cat([r.select([0, 1]), r.select([2, 3, 4])]).tolist() == ROWS
    with pytest.raises(ValueError, match="values for"):
        r.with_values(torch.zeros(3))


def test_ragged_pickles_through_numpy_without_losing_rows():
    r = Ragged.from_rows([[0.5, 1.5], [2.5]], torch.float32)
    back = pickle.loads(pickle.dumps(r, protocol=5))
    assert back.tolist() == r.tolist() and back.values.dtype == torch.float32


def test_batch_select_cat_and_shard_keep_fields_aligned():
    b = batch_of([[1], [2, 2], [3], [4, 4, 4]], [[10], [20, 21], [], [40, 41, 42]],
                 texts=["a", "b", "c", "d"], rewards=torch.tensor([0.0, 1.0, 2.0, 3.0]))
    sub = b.select([3, 1])
    assert sub.response_ids.tolist() == [[40, 41, 42], [20, 21]] and sub.texts == ["d", "b"]
    assert sub.rewards.tolist() == [3.0, 1.0] and sub.group.tolist() == [3, 1]
    parts = shard(b, 3)
    assert [len(p) for p in parts] == [2, 1, 1]
    joined = RolloutBatch.cat(parts)
    assert joined.response_ids.tolist() == b.response_ids.tolist() and joined.texts == b.texts
    assert b.for_training().texts is None and b.for_training().prompts is None
    with pytest.raises(ValueError, match="rewards"):
        RolloutBatch.cat([b, b.replace(rewards=None)])
    assert split_evenly([1], 3) == [[1], [], []]


def test_per_sequence_advantages_broadcast_over_tokens():
    b = batch_of([[1], [2]], [[10, 11], [20]], advantages=torch.tensor([0.5, -1.0]))
    assert b.token_advantage_rows().tolist() == [[0.5, 0.5], [-1.0]]
    assert b.replace(token_advantages=Ragged.from_rows([[1.0, 2.0], [3.0]], torch.float32)) \
        .token_advantage_rows().tolist() == [[1.0, 2.0], [3.0]]
    assert STOP_REASONS[int(b.stop_reason[0])] == "stop" and not b.truncated.any()


def test_collate_aligns_responses_with_the_positions_that_predict_them():
    # prompt [1, 2, 3], response [7, 8]: the model is fed [1, 2, 3, 7]; logits at position 2
    # (token 3) predict 7, at position 3 predict 8
    b = batch_of([[1, 2, 3], [5]], [[7, 8], [9, 9, 9]],
                 rollout_logprobs=Ragged.from_rows([[-1.0, -2.0], [-3.0, -3.0, -3.0]], torch.float32))
    b.loss_mask = b.loss_mask.with_values(torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0]))  # a masked token
    mb = collate(b, [0, 1], torch.device("cpu"))
    assert mb.input_ids.tolist() == [[1, 2, 3, 7], [5, 9, 9, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert mb.gather_index.tolist() == [[2, 3, 0], [0, 1, 2]]
    assert mb.target_ids.tolist() == [[7, 8, 0], [9, 9, 9]]
    assert mb.response_mask.tolist() == [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    assert mb.old_logprobs.tolist() == [[-1.0, -2.0, 0.0], [-3.0, -3.0, -3.0]]
    assert mb.advantages is None and mb.num_tokens == 4


def test_micro_batches_respect_the_padded_budget_and_cover_every_sample():
    lengths = [5, 9, 3, 8, 20, 2]
    plan = plan_micro_batches(lengths, token_budget=16)
    assert sorted(i for mb in plan for i in mb) == list(range(6))
    for mb in plan:
        assert max(lengths[i] for i in mb) * len(mb) <= 16 or len(mb) == 1
    assert [4] in plan  # longer than the budget: alone


def test_scatter_rows_writes_back_in_batch_order():
    b = batch_of([[1], [2], [3]], [[1, 1], [2], [3, 3, 3]])
    out = Ragged.full_like(b.response_ids, 0.0, torch.float32)
    for idx in ([2, 0], [1]):
        mb = collate(b, idx, torch.device("cpu"))
        scatter_rows(out, mb, mb.target_ids.float() * 10)
    assert out.tolist() == [[10.0, 10.0], [20.0], [30.0, 30.0, 30.0]]
