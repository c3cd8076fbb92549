"""OpenAI's presence / frequency penalties and logit bias in the native sampler: they change what
is drawn, never the reported log-probs (those stay under the model's raw distribution)."""

from __future__ import annotations

import random

import pytest
import torch

from polyrl.rollout.base import RolloutInputError, SamplingParams
from polyrl.rollout.native.sampling import RowParams, _shaped, sample


def row(**kw) -> RowParams:
    return RowParams(temperature=0.0, top_p=1.0, top_k=-1, top_logprobs=0, rng=random.Random(0), **kw)


def test_penalties_and_bias_by_hand():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    r = row(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={3: 4.0}, counts={2: 3, 0: 1})
    # token 0: 1 - 0.5 - 0.25; token 2: 3 - 0.5 - 0.75; token 3: 0.5 + 4
    assert _shaped(logits, [r]).tolist() == [[0.25, 2.0, 1.75, 4.5]]
    assert _shaped(logits, [row()]).tolist() == logits.tolist()


def test_greedy_follows_the_shaped_logits_but_reports_raw_logprobs():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5], [1.0, 2.0, 3.0, 0.5]])
    tokens, logprobs, _ = sample(logits.clone(), [row(logit_bias={0: 10.0}), row()])
    assert tokens == [0, 2]
    raw = torch.log_softmax(logits[0], -1)
    assert logprobs == pytest.approx([raw[0].item(), raw[2].item()])


def test_frequency_penalty_counts_what_the_sequence_drew():
    r = row(frequency_penalty=2.0)
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    drawn = [sample(logits.clone(), [r])[0][0] for _ in range(3)]
    # 0 (3 > 2); then 1 (token 0 is at 3 - 2 = 1 < 2); then 0 again (1 > 2 - 2 = 0 = token 2)
    assert drawn == [0, 1, 0] and r.counts == {0: 2, 1: 1}


@pytest.mark.parametrize("kwargs, field", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"logit_bias": {3: 150.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
])
def test_out_of_range_values_name_the_field(kwargs, field):
    with pytest.raises(RolloutInputError) as info:
        SamplingParams(**kwargs).validate()
    assert info.value.field == field
