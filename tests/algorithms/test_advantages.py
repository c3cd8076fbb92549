"""Advantage estimators against numbers worked out by hand."""

import math

import pytest
import torch

from polyrl.algorithms import AlgorithmConfig, compute_advantages
from polyrl.algorithms.advantages import ADV_ESTIMATORS, tied_group_mask
from polyrl.algorithms.advantages.grpo import grpo_advantages
from polyrl.algorithms.advantages.reinforce_pp import reinforce_pp_advantages
from polyrl.algorithms.advantages.rloo import rloo_advantages

# Two prompts x three samples. Group 0 rewards [1, 0, 0], group 1 rewards [0, 2, 4].
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0])
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])
# Response lengths 2, 1, 2, 1, 2, 2 out of T = 2.
MASK = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 0], [1, 1], [1, 1]])


def first_token(adv):
    return adv[:, 0]


def test_grpo_with_std_norm():
    # group 0: mean 1/3; deviations 2/3, -1/3, -1/3; sum sq = 4/9 + 1/9 + 1/9 = 2/3;
    #   unbiased var = (2/3) / 2 = 1/3; std = 1/sqrt(3) = 0.57735
    #   adv = (2/3) * sqrt(3) = 1.15470, -(1/3) * sqrt(3) = -0.57735
    # group 1: mean 2; deviations -2, 0, 2; sum sq 8; var 8/2 = 4; std 2 -> adv -1, 0, 1
    adv = grpo_advantages(REWARDS, GROUPS, MASK, norm_adv_by_std=True, eps=1e-6)
    expected = torch.tensor([2 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), -1.0, 0.0, 1.0])
    torch.testing.assert_close(first_token(adv), expected, atol=1e-5, rtol=0)
    # broadcast over response tokens, zero on padding
    torch.testing.assert_close(adv * (1 - MASK), torch.zeros_like(adv))
    torch.testing.assert_close(adv[0, 1], adv[0, 0])
    assert adv.shape == MASK.shape and adv.dtype == torch.float32


def test_grpo_without_std_norm_is_dr_grpo():
    # just r - group mean: 2/3, -1/3, -1/3 | -2, 0, 2
    adv = grpo_advantages(REWARDS, GROUPS, MASK, norm_adv_by_std=False)
    expected = torch.tensor([2 / 3, -1 / 3, -1 / 3, -2.0, 0.0, 2.0])
    torch.testing.assert_close(first_token(adv), expected)


def test_grpo_groups_need_not_be_contiguous_or_dense():
    order = torch.tensor([0, 3, 1, 4, 2, 5])  # interleave the two groups, ids 17 and 5
    ids = torch.where(GROUPS == 0, 17, 5)[order]
    adv = grpo_advantages(REWARDS[order], ids, MASK[order], norm_adv_by_std=False)
    expected = torch.tensor([2 / 3, -1 / 3, -1 / 3, -2.0, 0.0, 2.0])[order]
    torch.testing.assert_close(first_token(adv), expected)


def test_rloo_leave_one_out_baseline():
    # group 0: 1 - (0+0)/2 = 1;  0 - (1+0)/2 = -0.5 (twice)
    # group 1: 0 - (2+4)/2 = -3; 2 - (0+4)/2 = 0; 4 - (0+2)/2 = 3
    adv = rloo_advantages(REWARDS, GROUPS, MASK)
    torch.testing.assert_close(first_token(adv), torch.tensor([1.0, -0.5, -0.5, -3.0, 0.0, 3.0]))


def test_group_of_one_gets_zero_advantage():
    adv_g = grpo_advantages(torch.tensor([1.0]), torch.tensor([0]), torch.ones(1, 2))
    adv_r = rloo_advantages(torch.tensor([1.0]), torch.tensor([0]), torch.ones(1, 2))
    assert adv_g.abs().sum() == 0 and adv_r.abs().sum() == 0


def test_reinforce_pp_group_baseline_then_batch_whitening():
    # two groups of two: rewards [1, 0 | 1, 1] -> scores after group mean [0.5, -0.5, 0, 0]
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1, 1], [1, 0], [1, 0], [1, 0]])  # lengths 2, 1, 1, 1 -> 5 tokens
    # token values 0.5, 0.5, -0.5, 0, 0: mean 0.5/5 = 0.1
    # deviations 0.4, 0.4, -0.6, -0.1, -0.1; sum sq .16+.16+.36+.01+.01 = .70
    # unbiased var .70/4 = .175; std = 0.418330
    std = math.sqrt(0.175)
    adv = reinforce_pp_advantages(rewards, groups, mask, eps=1e-6)
    expected = torch.tensor([[0.4, 0.4], [-0.6, 0.0], [-0.1, 0.0], [-0.1, 0.0]]) / std
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


def test_tied_group_mask_and_count():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])  # group 0 all 1, group 2 all 0, group 3 alone
    tied, count = tied_group_mask(rewards, groups)
    assert tied.tolist() == [True, True, False, False, True, True, True]
    assert count == 3


def test_compute_advantages_dispatch_and_metrics():
    cfg = AlgorithmConfig(adv_estimator="rloo")
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    out = compute_advantages(cfg, rewards, GROUPS, MASK)
    # group 0 RLOO as above: 1, -0.5, -0.5; group 1 tied -> 0
    torch.testing.assert_close(first_token(out.advantages), torch.tensor([1.0, -0.5, -0.5, 0, 0, 0]))
    assert out.tied_mask.tolist() == [False] * 3 + [True] * 3
    assert out.metrics["adv/tied_groups"] == 1.0 and out.metrics["adv/num_groups"] == 2.0


def test_registry_lists_choices():
    # the group-baseline estimators; gae needs values and is dispatched by compute_advantages
    assert set(ADV_ESTIMATORS.names()) == {"grpo", "rloo", "reinforce_pp"}
    with pytest.raises(KeyError, match="valid choices: grpo, rloo, reinforce_pp"):
        ADV_ESTIMATORS.get("nope")
