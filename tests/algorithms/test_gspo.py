"""GSPO and GSPO-token against hand computations and a plain-Python reference on random inputs
whose loss masks have holes (multi-turn tool output) and right padding."""

import math
import random

import pytest
import torch

from polyrl.algorithms import POLICY_LOSSES, AlgorithmConfig, actor_loss
from polyrl.algorithms.losses.gspo import gspo_loss
from polyrl.algorithms.losses.ppo import ppo_clip_loss
from polyrl.config import ConfigError, load_config

GSPO = dict(clip_ratio_low=3e-4, clip_ratio_high=4e-4, loss_agg_mode="seq-mean-token-mean")

# row 0: token log-ratios 0.3, <hole>, -0.1 -> mean 0.1, s = e^0.1 = 1.105171 (A = +1: clipped)
# row 1: token log-ratios -0.002, 0.0, <pad> -> mean -0.001, s = e^-0.001 = 0.9990005 (A = +1:
#        max(-0.9990005, -0.9997) = -0.9990005, unclipped)
OLD = torch.tensor([[-1.0, -2.0, -1.5], [-0.5, -0.7, -0.9]])
DIFF = torch.tensor([[0.3, 7.0, -0.1], [-0.002, 0.0, 5.0]])  # 7.0 and 5.0 sit off the mask
MASK = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
ADV = torch.ones(2, 3)


@pytest.mark.parametrize("token_level", [False, True])
def test_hand_computed_loss_gradient_and_metrics(token_level):
    logprob = (OLD + DIFF).requires_grad_(True)
    loss, m = gspo_loss(logprob, OLD, ADV, MASK, token_level=token_level, **GSPO)
    s0, s1 = math.exp(0.1), math.exp(-0.001)
    # seq-mean-token-mean: (L_0 + L_1) / 2 with L_0 = -(1 + 4e-4), L_1 = -s1
    assert loss.item() == pytest.approx((-1.0004 - s1) / 2, abs=1e-6)
    loss.backward()
    # row 0 is clipped: no gradient. Row 1: d(-s1)/d logp_t = -s1 / |y_1| = -s1/2, over 2 rows
    expected = torch.tensor([[0.0, 0.0, 0.0], [-s1 / 4, -s1 / 4, 0.0]])
    torch.testing.assert_close(logprob.grad, expected, atol=1e-6, rtol=0)
    # per-token means over the 4 loss tokens: row 0's two tokens were clipped
    assert m["actor/pg_clipfrac"] == pytest.approx(0.5)
    assert m["actor/ratio_mean"] == pytest.approx((2 * s0 + 2 * s1) / 4, abs=1e-6)
    assert m["actor/ppo_kl"] == pytest.approx(-(0.3 - 0.1 - 0.002 + 0.0) / 4, abs=1e-6)
    assert m["actor/pg_clipfrac_lower"] == 0.0
    # the same keys as ppo_clip, so the workers reduce them alike
    _, ppo_m = ppo_clip_loss(OLD.clone(), OLD, ADV, MASK)
    assert m.keys() == ppo_m.keys()


def test_negative_advantage_clips_below():
    # s = e^-0.001 < 1 - 3e-4 with A = -1: max(s, 0.9997) = 0.9997 -> the lower clip binds
    logprob = (OLD + DIFF)[1:].requires_grad_(True)
    loss, m = gspo_loss(logprob, OLD[1:], -ADV[1:], MASK[1:], **GSPO)
    assert loss.item() == pytest.approx(0.9997, abs=1e-7)
    assert m["actor/pg_clipfrac"] == 1.0
    loss.backward()
    assert logprob.grad.abs().sum().item() == 0.0


def reference_gspo(logprob, old, adv, mask, low, high, token_level):
    """Plain-Python GSPO(-token), seq-mean-token-mean: loss and d loss / d logprob."""
    B, T = len(mask), len(mask[0])
    total, grad, rows = 0.0, [[0.0] * T for _ in range(B)], 0
    for i in range(B):
        idx = [t for t in range(T) if mask[i][t]]
        if not idx:
            continue
        rows += 1
        s = math.exp(sum(logprob[i][t] - old[i][t] for t in idx) / len(idx))
        clipped_s = min(max(s, 1 - low), 1 + high)
        if token_level:
            per_token = []
            for t in idx:
                a = adv[i][t]
                unclipped, clipped = -a * s, -a * clipped_s
                per_token.append(max(unclipped, clipped))
                # gradient of s_{i,t} w.r.t. its own token is s; none through the clipped branch
                grad[i][t] = -a * s / len(idx) if unclipped >= clipped else 0.0
            total += sum(per_token) / len(idx)
        else:
            a = sum(adv[i][t] for t in idx) / len(idx)
            unclipped, clipped = -a * s, -a * clipped_s
            total += max(unclipped, clipped)
            if unclipped >= clipped:
                for t in idx:  # d s / d logp_t = s / |y|
                    grad[i][t] = -a * s / len(idx)
    rows = max(rows, 1)
    return total / rows, [[g / rows for g in row] for row in grad]


def random_batch(seed, constant_adv):
    rng = random.Random(seed)
    B, T = 7, 9
    mask = []
    for i in range(B):
        length = rng.randint(0, T) if i else 0  # row 0 is empty: it must not count
        row = [1.0 if t < length else 0.0 for t in range(T)]
        for t in range(1, max(length - 1, 1)):  # holes in the middle (tool output)
            if rng.random() < 0.3:
                row[t] = 0.0
        mask.append(row)
    old = [[rng.uniform(-3, -0.1) for _ in range(T)] for _ in range(B)]
    # small log-ratios so that a 1e-2 range clips some rows and not others; garbage off the mask
    logprob = [[old[i][t] + (rng.gauss(0, 0.02) if mask[i][t] else rng.uniform(-50, 50))
                for t in range(T)] for i in range(B)]
    adv = []
    for _ in range(B):
        a = rng.gauss(0, 1)
        adv.append([a if constant_adv else rng.gauss(0, 1) for _ in range(T)])
    return logprob, old, adv, mask


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("token_level,constant_adv", [(False, True), (True, True), (True, False)])
def test_matches_reference_on_random_inputs_with_holes(seed, token_level, constant_adv):
    logprob, old, adv, mask = random_batch(seed, constant_adv)
    low, high = 0.008, 0.012
    ref_loss, ref_grad = reference_gspo(logprob, old, adv, mask, low, high, token_level)
    lp = torch.tensor(logprob, dtype=torch.float64, requires_grad=True)
    loss, _ = gspo_loss(lp, torch.tensor(old, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64),
                        torch.tensor(mask, dtype=torch.float64), token_level=token_level,
                        clip_ratio_low=low, clip_ratio_high=high, loss_agg_mode="seq-mean-token-mean")
    loss.backward()
    assert loss.item() == pytest.approx(ref_loss, abs=1e-12)
    torch.testing.assert_close(lp.grad, torch.tensor(ref_grad, dtype=torch.float64), atol=1e-12, rtol=0)


def test_reference_inputs_exercise_both_branches():
    # guards the test above: on these inputs some rows clip and some do not
    clipped = []
    for seed in range(4):
        logprob, old, adv, mask = random_batch(seed, True)
        _, m = gspo_loss(torch.tensor(logprob), torch.tensor(old), torch.tensor(adv), torch.tensor(mask),
                         clip_ratio_low=0.008, clip_ratio_high=0.012)
        clipped.append(m["actor/pg_clipfrac"])
    assert any(0 < c < 1 for c in clipped)


@pytest.mark.parametrize("seed", range(3))
def test_token_variant_equals_sequence_variant_for_sequence_advantages(seed):
    # GSPO paper sec. 4.3: with A_{i,t} = A_i both have the same value and gradient
    logprob, old, adv, mask = random_batch(seed, constant_adv=True)
    grads, losses = [], []
    for token_level in (False, True):
        lp = torch.tensor(logprob, requires_grad=True)
        loss, _ = gspo_loss(lp, torch.tensor(old), torch.tensor(adv), torch.tensor(mask),
                            token_level=token_level, clip_ratio_low=0.008, clip_ratio_high=0.012)
        loss.backward()
        losses.append(loss.item())
        grads.append(lp.grad)
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    torch.testing.assert_close(grads[0], grads[1])


def test_dispatched_by_actor_loss_with_config_clip_range():
    cfg = AlgorithmConfig(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean",
                          gspo_clip_ratio_high=1e-3)
    logprob = OLD + DIFF
    loss, m = actor_loss(cfg, logprob, OLD, ADV, MASK)
    # row 0 clips at 1 + 1e-3 now
    assert loss.item() == pytest.approx((-1.001 - math.exp(-0.001)) / 2, abs=1e-6)
    assert m["actor/pg_loss"] == pytest.approx(loss.item())
    token_loss, _ = POLICY_LOSSES.get("gspo_token")(cfg, logprob, OLD, ADV, MASK)
    assert token_loss.item() == pytest.approx(loss.item(), abs=1e-6)


def test_global_sequence_count_for_grad_accumulation():
    # a micro-batch with 2 of the mini-batch's 4 sequences: the sum of its row losses / 4
    loss, _ = gspo_loss(OLD + DIFF, OLD, ADV, MASK, num_seqs=4, **GSPO)
    assert loss.item() == pytest.approx((-1.0004 - math.exp(-0.001)) / 4, abs=1e-6)


@pytest.mark.parametrize("key", ["gspo_clip_ratio_low", "gspo_clip_ratio_high"])
def test_token_scale_clip_range_rejected_naming_the_key(key):
    with pytest.raises(ConfigError, match=rf"{key}=0.2 is a token-level clip range.*set algorithm.{key}="):
        load_config(AlgorithmConfig, overrides=["policy_loss=gspo", "loss_agg_mode=seq-mean-token-mean",
                                                f"{key}=0.2"])
    load_config(AlgorithmConfig, overrides=["policy_loss=gspo", "loss_agg_mode=seq-mean-token-mean",
                                            f"{key}=0.001"])


@pytest.mark.parametrize("loss_name", ["gspo", "gspo_token"])
def test_gspo_needs_sequence_mean_aggregation_and_no_dual_clip(loss_name):
    with pytest.raises(ValueError, match="set algorithm.loss_agg_mode=seq-mean-token-mean"):
        AlgorithmConfig(policy_loss=loss_name, loss_agg_mode="token-mean")
    with pytest.raises(ValueError, match="set algorithm.dual_clip_c=null"):
        AlgorithmConfig(policy_loss=loss_name, loss_agg_mode="seq-mean-token-mean", dual_clip_c=3.0)


def test_sequence_gspo_rejects_per_token_advantages():
    with pytest.raises(ValueError, match="set algorithm.policy_loss=gspo_token"):
        AlgorithmConfig(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean", adv_estimator="gae")
    AlgorithmConfig(policy_loss="gspo_token", loss_agg_mode="seq-mean-token-mean", adv_estimator="gae")
