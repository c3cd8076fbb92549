"""Off-policy correction worked out by hand: ratios r = exp(prox - rollout) are chosen as
row 0: [0.5, 1, 4], row 1: [2, 1.5, <pad>]; products 2 and 3; geometric means 2^(1/3), sqrt(3)."""

from __future__ import annotations

import math

import pytest
import torch

from polyrl.algorithms import AlgorithmConfig, actor_loss
from polyrl.algorithms.off_policy import OffPolicyConfig, off_policy_correction
from polyrl.config import ConfigError, load_config

RATIOS = [[0.5, 1.0, 4.0], [2.0, 1.5, 1.0]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def logprobs():
    rollout = torch.full((2, 3), -1.0)
    prox = rollout + torch.log(torch.tensor(RATIOS))
    return prox, rollout


def flat(t):
    return [x for row in (t.tolist() if isinstance(t, torch.Tensor) else t) for x in row]


def correct(**kw):
    prox, rollout = logprobs()
    return off_policy_correction(prox, rollout, MASK, OffPolicyConfig(**kw))


def test_token_truncated_is():
    c = correct(is_level="token", is_cap=2.0, mask_level="none")
    assert flat(c.weights) == pytest.approx([0.5, 1.0, 2.0, 2.0, 1.5, 0.0])
    assert c.metrics["off_policy/is_weight_mean"] == pytest.approx(7 / 5)
    assert c.metrics["off_policy/is_weight_max"] == pytest.approx(4.0)
    assert c.metrics["off_policy/is_clipped_frac"] == pytest.approx(1 / 5)  # only the 4.0
    assert c.metrics["off_policy/masked_frac"] == 0.0
    kl = -sum(math.log(r) for r in [0.5, 1.0, 4.0, 2.0, 1.5]) / 5
    assert c.metrics["off_policy/kl_rollout_proximal"] == pytest.approx(kl)


def test_sequence_truncated_is():
    c = correct(is_level="sequence", is_cap=2.5, mask_level="none")
    assert flat(c.weights) == pytest.approx([2.0, 2.0, 2.0, 2.5, 2.5, 0.0])
    assert c.metrics["off_policy/is_weight_max"] == pytest.approx(3.0)
    assert c.metrics["off_policy/is_clipped_frac"] == pytest.approx(2 / 5)  # row 1's tokens


@pytest.mark.parametrize("level,high,keep", [
    ("token", 2.0, [[1, 1, 0], [1, 1, 0]]),  # 4.0 is out; the padded position is never kept
    ("sequence", 2.0, [[1, 1, 1], [0, 0, 0]]),  # product 3 > 2
    ("geometric", 2.0, [[1, 1, 1], [1, 1, 0]]),  # 1.26 and 1.73 are inside
    ("geometric", 1.5, [[1, 1, 1], [0, 0, 0]]),  # sqrt(3) = 1.73 > 1.5
])
def test_masks(level, high, keep):
    c = correct(is_level="none", mask_level=level, mask_low=0.5, mask_high=high)
    assert c.keep.tolist() == keep
    dropped = sum(1 for row, m in zip(keep, MASK.tolist()) for k, v in zip(row, m) if v and not k)
    assert c.metrics["off_policy/masked_frac"] == pytest.approx(dropped / 5)
    assert c.weights.tolist() == MASK.tolist()  # IS off: weight 1 on every real token


def test_low_threshold_masks_small_ratios():
    c = correct(is_level="none", mask_level="token", mask_low=0.6, mask_high=5.0)
    assert c.keep.tolist() == [[0, 1, 1], [1, 1, 0]]


def test_wired_into_actor_loss_single_step():
    # single-step update: current == proximal, PPO ratio 1, loss per token = -A * w
    prox, rollout = logprobs()
    logprob = prox.clone().requires_grad_(True)
    adv = torch.ones(2, 3)
    cfg = AlgorithmConfig(off_policy=OffPolicyConfig(is_level="token", is_cap=2.0, mask_level="token",
                                                     mask_low=0.5, mask_high=2.0))
    loss, m = actor_loss(cfg, logprob, logprob.detach(), adv, MASK, rollout_logprob=rollout,
                         num_tokens=5.0)
    # kept tokens 0.5, 1 (row 0) and 2, 1.5 (row 1); the global 5 tokens stay the denominator
    assert loss.item() == pytest.approx(-(0.5 + 1.0 + 2.0 + 1.5) / 5)
    loss.backward()
    expected = torch.tensor([[0.5, 1.0, 0.0], [2.0, 1.5, 0.0]]) * -1 / 5
    assert flat(logprob.grad) == pytest.approx(flat(expected))
    assert m["off_policy/masked_frac"] == pytest.approx(1 / 5)
    # the same call without rollout log-probs is plain PPO
    plain, _ = actor_loss(cfg, prox, prox, adv, MASK, num_tokens=5.0)
    assert plain.item() == pytest.approx(-1.0)


def test_auto_resolves_by_mode_and_bad_thresholds_name_the_field():
    assert OffPolicyConfig().resolve(on_policy=False).is_level == "token"
    assert OffPolicyConfig().resolve(on_policy=False).mask_level == "token"
    assert OffPolicyConfig().resolve(on_policy=True).is_level == "none"
    assert OffPolicyConfig().resolve(on_policy=True).mask_level == "none"
    assert OffPolicyConfig(mask_level="geometric").resolve(on_policy=False).mask_level == "geometric"
    assert not OffPolicyConfig().resolve(on_policy=True).active
    assert OffPolicyConfig(is_level="sequence").resolve(on_policy=True).is_level == "sequence"
    with pytest.raises(ConfigError, match="mask_low"):
        load_config(AlgorithmConfig, overrides=["off_policy.mask_low=3", "off_policy.mask_high=2"])
