"""GAE against a plain-Python loop on random inputs whose loss masks have holes (multi-turn tool
output), the value loss and explained variance against hand computations."""

import random

import pytest
import torch

from polyrl.algorithms import (
    AlgorithmConfig,
    compute_advantages,
    explained_variance,
    gae_advantages,
    outcome_token_rewards,
    value_loss,
)


def reference_gae(rewards, values, mask, gamma, lam):
    """One row at a time over its loss tokens only: a hole is not a time step."""
    B, R = len(mask), len(mask[0])
    adv = [[0.0] * R for _ in range(B)]
    ret = [[0.0] * R for _ in range(B)]
    for i in range(B):
        steps = [t for t in range(R) if mask[i][t]]
        next_value = next_adv = 0.0
        for t in reversed(steps):
            delta = rewards[i][t] + gamma * next_value - values[i][t]
            next_adv = delta + gamma * lam * next_adv
            next_value = values[i][t]
            adv[i][t] = next_adv
            ret[i][t] = next_adv + values[i][t]
    return adv, ret


def random_inputs(seed, B=6, R=11):
    rng = random.Random(seed)
    mask = []
    for i in range(B):
        length = {0: 0, 1: R}.get(i, rng.randint(1, R))  # row 0 empty, row 1 full length
        row = [1.0 if t < length else 0.0 for t in range(R)]
        # a hole of 1-3 tokens in the middle of every row long enough
        if length > 4:
            start = rng.randint(1, length - 3)
            for t in range(start, min(start + rng.randint(1, 3), length - 1)):
                row[t] = 0.0
        mask.append(row)
    # rewards on loss tokens (dense, like a per-token penalty) and garbage elsewhere that must be
    # ignored; values garbage off the mask too
    rewards = [[rng.gauss(0, 1) if m else rng.uniform(-100, 100) for m in row] for row in mask]
    values = [[rng.gauss(0, 1) if m else rng.uniform(-100, 100) for m in row] for row in mask]
    return rewards, values, mask


def has_hole(row):
    """A masked position before the row's last loss token."""
    ones = [t for t, m in enumerate(row) if m]
    return bool(ones) and any(not row[t] for t in range(ones[-1]))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7)])
def test_matches_reference_loop_with_holes(seed, gamma, lam):
    rewards, values, mask = random_inputs(seed)
    assert any(has_hole(row) for row in mask)  # the inputs do exercise the multi-turn case
    ref_adv, ref_ret = reference_gae(rewards, values, mask, gamma, lam)
    adv, ret = gae_advantages(torch.tensor(rewards), torch.tensor(values), torch.tensor(mask), gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(ref_adv), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, torch.tensor(ref_ret), atol=1e-5, rtol=1e-5)
    assert adv.dtype == ret.dtype == torch.float32


def test_hand_computed_hole_is_skipped():
    # mask [1, 0, 1]: the middle token is tool output. gamma 0.9, lam 0.8
    # t=2: delta = 1 + 0 - 0.25 = 0.75; A = 0.75; return 1.0
    # t=0: next state is t=2 (one gamma): delta = 0 + 0.9 * 0.25 - 0.5 = -0.275
    #      A = -0.275 + 0.9 * 0.8 * 0.75 = 0.265; return 0.765
    # the reward 5 and value 9 on the hole are never read
    adv, ret = gae_advantages(torch.tensor([[0.0, 5.0, 1.0]]), torch.tensor([[0.5, 9.0, 0.25]]),
                              torch.tensor([[1, 0, 1]]), gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.265, 0.0, 0.75]]))
    torch.testing.assert_close(ret, torch.tensor([[0.765, 0.0, 1.0]]))


def test_monte_carlo_limit():
    # gamma = lam = 1 with one outcome reward: A_t = R - V_t on every loss token
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 1, 0, 0]])
    values = torch.tensor([[0.1, 0.2, 7.0, 0.3, 0.0], [0.5, -0.5, 0.25, 0.0, 0.0]])
    token_rewards = outcome_token_rewards(torch.tensor([1.0, -2.0]), mask)
    adv, ret = gae_advantages(token_rewards, values, mask, 1.0, 1.0)
    expected = torch.tensor([[0.9, 0.8, 0.0, 0.7, 0.0], [-2.5, -1.5, -2.25, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0, 1.0, 0], [-2.0, -2.0, -2.0, 0, 0]]))


def test_outcome_reward_on_last_loss_token():
    mask = torch.tensor([[1, 1, 0, 1, 0, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0]])
    out = outcome_token_rewards(torch.tensor([2.0, 3.0, 4.0, 5.0]), mask)
    expected = torch.zeros(4, 6)
    expected[0, 3], expected[1, 0], expected[3, 4] = 2.0, 3.0, 5.0  # the empty row gets nothing
    torch.testing.assert_close(out, expected)


def test_whitening_over_valid_tokens():
    rewards, values, mask = random_inputs(7)
    m = torch.tensor(mask).bool()
    raw, ret = gae_advantages(torch.tensor(rewards), torch.tensor(values), m, 0.99, 0.95)
    white, ret_w = gae_advantages(torch.tensor(rewards), torch.tensor(values), m, 0.99, 0.95, whiten=True)
    assert white[m].mean().item() == pytest.approx(0.0, abs=1e-5)
    assert white[m].std().item() == pytest.approx(1.0, abs=1e-4)
    assert white[~m].abs().sum() == 0
    torch.testing.assert_close(ret_w, ret)  # returns come from the raw advantages
    torch.testing.assert_close(white[m], (raw[m] - raw[m].mean()) / (raw[m].std() + 1e-6))


def test_compute_advantages_dispatches_gae():
    cfg = AlgorithmConfig(adv_estimator="gae", gamma=1.0, lam=1.0, whiten_advantages=False)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    values = torch.tensor([[0.25, 0.5, 0.0], [0.0, 0.0, 0.0]])
    out = compute_advantages(cfg, torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), mask, values=values)
    torch.testing.assert_close(out.advantages, torch.tensor([[0.75, 0.5, 0.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(out.returns, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    # returns on the 3 tokens: 1, 1, 0 (mean 2/3, var 2/9); residuals 0.75, 0.5, 0 (mean 5/12,
    # var (1/3^2 + 1/12^2 + 5/12^2) / 3 = 0.0972222); 1 - 0.0972222 / 0.2222222 = 0.5625
    assert out.metrics["critic/explained_variance"] == pytest.approx(0.5625)
    assert out.metrics["critic/returns_mean"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="needs the critic's values"):
        compute_advantages(cfg, torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), mask)
    assert compute_advantages(AlgorithmConfig(), torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask).returns is None


def test_value_loss_clipping_by_hand():
    # clip 0.2. token 0: V 1.0, old 0.5, R 1.2: error 0.04; clipped V 0.7 -> 0.25; max 0.25 (clipped)
    #          token 1: V 0.6, old 0.5, R 1.0: inside the range, 0.16 either way (not clipped)
    #          token 2: masked (tool output): V 5, R -5 must not count
    values = torch.tensor([[1.0, 0.6, 5.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.0]])
    returns = torch.tensor([[1.2, 1.0, -5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = value_loss(values, old, returns, mask, clip_range=0.2)
    assert loss.item() == pytest.approx(0.5 * (0.25 + 0.16) / 2)
    assert m["critic/vf_clipfrac"] == pytest.approx(0.5)
    assert m["critic/value_loss"] == pytest.approx(loss.item())
    assert m["critic/vpred_mean"] == pytest.approx(0.8)
    loss.backward()
    # token 0: the clipped branch is flat in V; token 1: 0.5 * 2 * (0.6 - 1.0) / 2 tokens = -0.2
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -0.2, 0.0]]))
    plain, m_plain = value_loss(values, old, returns, mask, clip_range=None)
    assert plain.item() == pytest.approx(0.5 * (0.04 + 0.16) / 2)
    assert m_plain["critic/vf_clipfrac"] == 0.0


def test_value_loss_global_token_count():
    values, old, returns = torch.ones(1, 2), torch.ones(1, 2), torch.zeros(1, 2)
    loss, _ = value_loss(values, old, returns, torch.ones(1, 2), num_tokens=8)
    assert loss.item() == pytest.approx(0.5 * 2 / 8)


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full((1, 4), 2.0), returns, mask) == pytest.approx(0.0)
    # values 0: residual = returns, ratio 1 -> 0; values 2 * returns: residual -returns -> 0
    assert explained_variance(2 * returns, returns, mask) == pytest.approx(0.0)
    # values [1, 2, 2]: residuals [0, 0, 1] var 2/9; returns var 2/3 -> 1 - 1/3
    assert explained_variance(torch.tensor([[1.0, 2.0, 2.0, 0.0]]), returns, mask) == pytest.approx(2 / 3)
    assert explained_variance(returns, torch.ones(1, 4), mask) == 0.0  # nothing to explain
