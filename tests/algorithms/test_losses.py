"""PPO clip values at chosen ratios, and the three aggregation modes, worked out by hand."""

import math

import pytest
import torch

from polyrl.algorithms import POLICY_LOSSES, AlgorithmConfig, aggregate
from polyrl.algorithms.losses.ppo import ppo_clip_loss


def per_token_loss(ratio, adv, **kw):
    """Loss of a single token with the given ratio and advantage."""
    logprob = torch.tensor([[math.log(ratio)]])
    loss, metrics = ppo_clip_loss(
        logprob, torch.zeros(1, 1), torch.tensor([[float(adv)]]), torch.ones(1, 1), **kw
    )
    return loss.item(), metrics


CLIP_HIGHER = dict(clip_ratio_low=0.2, clip_ratio_high=0.28)


@pytest.mark.parametrize(
    "ratio, adv, expected, clipped",
    [
        # A > 0, ratio 1.5: max(-1.5, -1.28) = -1.28 -> the upper clip (1 + 0.28) binds
        (1.5, 1.0, -1.28, True),
        # A > 0, ratio 1.25: inside [0.8, 1.28] with clip-higher -> -1.25 (symmetric 0.2 gives -1.2)
        (1.25, 1.0, -1.25, False),
        # A > 0, ratio 0.5: max(-0.5, -0.8) = -0.5 -> unclipped (no gain from lowering further)
        (0.5, 1.0, -0.5, False),
        # A < 0, ratio 0.5: max(0.5, 0.8) = 0.8 -> the lower clip (1 - 0.2) binds
        (0.5, -1.0, 0.8, True),
        # A < 0, ratio 1.5: max(1.5, 1.28) = 1.5 -> unclipped (pessimistic side)
        (1.5, -1.0, 1.5, False),
        # A = 2, ratio 1.0: -2
        (1.0, 2.0, -2.0, False),
    ],
)
def test_ppo_clip_values(ratio, adv, expected, clipped):
    loss, metrics = per_token_loss(ratio, adv, **CLIP_HIGHER)
    assert loss == pytest.approx(expected, abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == (1.0 if clipped else 0.0)


def test_clip_higher_asymmetry():
    # symmetric eps 0.2: ratio 1.25 with A = 1 clips to -1.2; clip-higher 0.28 lets it reach -1.25
    assert per_token_loss(1.25, 1.0, clip_ratio_low=0.2, clip_ratio_high=0.2)[0] == pytest.approx(-1.2)
    assert per_token_loss(1.25, 1.0, **CLIP_HIGHER)[0] == pytest.approx(-1.25)
    # the low side is unchanged: ratio 0.7, A = -1 -> max(0.7, 0.8) = 0.8 in both
    assert per_token_loss(0.7, -1.0, **CLIP_HIGHER)[0] == pytest.approx(0.8)


def test_dual_clip_caps_negative_advantage_loss():
    # A = -1, ratio 5: max(5, 1.28) = 5; dual clip c = 3 caps it at -A*c = 3
    loss, metrics = per_token_loss(5.0, -1.0, dual_clip_c=3.0, **CLIP_HIGHER)
    assert loss == pytest.approx(3.0)
    assert metrics["actor/pg_clipfrac_lower"] == 1.0
    # without dual clip it stays 5
    assert per_token_loss(5.0, -1.0, **CLIP_HIGHER)[0] == pytest.approx(5.0)
    # positive advantage is untouched by dual clip: A = 1, ratio 5 -> -1.28
    assert per_token_loss(5.0, 1.0, dual_clip_c=3.0, **CLIP_HIGHER)[0] == pytest.approx(-1.28)
    # A = -1, ratio 2: max(2, 1.28) = 2 < 3 -> dual clip inactive
    assert per_token_loss(2.0, -1.0, dual_clip_c=3.0, **CLIP_HIGHER)[0] == pytest.approx(2.0)


def test_gradient_is_zero_when_clipped():
    logprob = torch.tensor([[math.log(1.5)]], requires_grad=True)
    loss, _ = ppo_clip_loss(logprob, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))
    loss.backward()
    assert logprob.grad.item() == 0.0


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # third row: no response tokens


def test_aggregation_modes():
    # token-mean: (1 + 2 + 3 + 4) / 4 = 2.5
    assert aggregate(LOSS, MASK, "token-mean").item() == pytest.approx(2.5)
    # seq-mean-token-sum: (6 + 4) / 2 sequences with tokens = 5
    assert aggregate(LOSS, MASK, "seq-mean-token-sum").item() == pytest.approx(5.0)
    # seq-mean-token-mean: (6/3 + 4/1) / 2 = 3
    assert aggregate(LOSS, MASK, "seq-mean-token-mean").item() == pytest.approx(3.0)


def test_aggregation_with_global_counts_for_grad_accumulation():
    # micro-batch holds 4 of the mini-batch's 8 tokens: 10 / 8
    assert aggregate(LOSS, MASK, "token-mean", num_tokens=8).item() == pytest.approx(1.25)
    # 2 of 4 sequences: (6 + 4) / 4
    assert aggregate(LOSS, MASK, "seq-mean-token-sum", num_seqs=4).item() == pytest.approx(2.5)


def test_aggregation_empty_mask_is_zero_not_nan():
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        assert aggregate(LOSS, torch.zeros_like(MASK), mode).item() == 0.0
    with pytest.raises(ValueError, match="valid choices"):
        aggregate(LOSS, MASK, "sum")


def test_registry_entry_reads_config():
    cfg = AlgorithmConfig(clip_ratio_high=0.28, loss_agg_mode="seq-mean-token-mean")
    fn = POLICY_LOSSES.get("ppo_clip")
    logprob = torch.log(torch.tensor([[1.5, 1.0], [0.5, 1.0]]))
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, metrics = fn(cfg, logprob, torch.zeros(2, 2), adv, mask)
    # row 0: tokens -1.28 and -1.0 -> mean -1.14; row 1: token 0.8 -> 0.8; mean (-1.14 + 0.8)/2
    assert loss.item() == pytest.approx(-0.17, abs=1e-6)
    # clipped tokens: (0,0) and (1,0) of 3 valid tokens
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 3)


def test_actor_loss_combines_terms():
    from polyrl.algorithms import actor_loss

    cfg = AlgorithmConfig(use_kl_loss=True, kl_coef=0.5, kl_estimator="k1", entropy_coeff=0.1)
    zeros = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    adv = torch.tensor([[1.0, 1.0]])
    ref = torch.tensor([[-1.0, -3.0]])  # k1 = logp - ref = 1, 3 -> token-mean 2
    entropy = torch.tensor([[2.0, 4.0]])  # token-mean 3
    # pg: ratio 1, A = 1 -> -1; total = -1 + 0.5 * 2 - 0.1 * 3 = -0.3
    loss, metrics = actor_loss(cfg, zeros, zeros, adv, mask, ref_logprob=ref, entropy=entropy)
    assert loss.item() == pytest.approx(-0.3)
    assert metrics["actor/kl_loss"] == pytest.approx(2.0) and metrics["actor/entropy"] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="needs ref_logprob"):
        actor_loss(cfg, zeros, zeros, adv, mask)
