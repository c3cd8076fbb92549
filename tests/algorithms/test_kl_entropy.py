"""k1 / k2 / k3 values, the KL reward penalty and loss, and chunked entropy."""

import math

import pytest
import torch

from polyrl.algorithms import entropy_from_logits, kl_estimate, kl_loss, kl_penalized_rewards

LN2 = math.log(2)


@pytest.mark.parametrize(
    "log_r, k1, k2, k3",
    [
        # log r = ref - logp = ln 2 (r = 2): k1 = -ln2; k2 = ln2^2/2 = 0.240227; k3 = 2 - 1 - ln2
        (LN2, -LN2, LN2**2 / 2, 1 - LN2),
        # log r = -ln 2 (r = 1/2): k1 = ln2; k2 = 0.240227; k3 = 0.5 - 1 + ln2 = 0.193147
        (-LN2, LN2, LN2**2 / 2, LN2 - 0.5),
        # identical policies: all zero
        (0.0, 0.0, 0.0, 0.0),
    ],
)
def test_kl_estimators(log_r, k1, k2, k3):
    logprob = torch.tensor([[-1.0]])
    ref = logprob + log_r
    for name, expected in (("k1", k1), ("k2", k2), ("k3", k3)):
        assert kl_estimate(logprob, ref, name).item() == pytest.approx(expected, abs=1e-6), name


def test_k3_is_clamped():
    assert kl_estimate(torch.tensor([[0.0]]), torch.tensor([[50.0]]), "k3").item() == 10.0


def test_kl_penalty_in_reward():
    logprob = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    ref = torch.tensor([[-0.5, -0.25, -9.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # the -9 sits on padding and must not count
    # k1 per token = logp - ref: row 0: 0.5 + 0.25 = 0.75; row 1: 1.0
    # rewards [1, 0] - 0.1 * [0.75, 1.0] = [0.925, -0.1]
    out, metrics = kl_penalized_rewards(
        torch.tensor([1.0, 0.0]), logprob, ref, mask, kl_coef=0.1, estimator="k1"
    )
    torch.testing.assert_close(out, torch.tensor([0.925, -0.1]))
    # token mean k1: (0.5 + 0.25 + 1.0) / 5
    assert metrics["kl/token_mean"] == pytest.approx(0.35)


def test_kl_loss_has_gradient_only_through_policy():
    logprob = torch.zeros(1, 2, requires_grad=True)
    ref = torch.full((1, 2), LN2, requires_grad=True)
    loss, metrics = kl_loss(logprob, ref, torch.ones(1, 2), estimator="k3")
    assert loss.item() == pytest.approx(1 - LN2, abs=1e-6)
    loss.backward()
    # d k3 / d logp = 1 - r = -1 per token; token-mean over 2 tokens -> -0.5 each
    torch.testing.assert_close(logprob.grad, torch.full((1, 2), -0.5))
    assert ref.grad is None


def test_entropy_uniform_and_peaked():
    uniform = torch.zeros(2, 3, 4)
    torch.testing.assert_close(entropy_from_logits(uniform), torch.full((2, 3), math.log(4)))
    peaked = torch.tensor([[100.0, 0.0, 0.0]])
    assert entropy_from_logits(peaked).item() == pytest.approx(0.0, abs=1e-6)


def test_entropy_chunking_matches_unchunked():
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0))
    reference = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size=4), reference)
    assert entropy_from_logits(logits.bfloat16()).dtype == torch.float32
