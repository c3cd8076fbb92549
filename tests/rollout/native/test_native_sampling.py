"""The sampler's distributions, checked by counting (no model involved)."""

from __future__ import annotations

import random

import torch

from polyrl.rollout.native.sampling import RowParams, _inverse_cdf, sample

N = 20000


def rows(n, **kw):
    base = dict(temperature=1.0, top_p=1.0, top_k=-1, top_logprobs=0)
    base.update(kw)
    return [RowParams(rng=random.Random(i), **base) for i in range(n)]


def frequencies(tokens, vocab):
    return torch.bincount(torch.tensor(tokens), minlength=vocab).float() / len(tokens)


def test_sampling_follows_the_softmax_across_blocks():
    torch.manual_seed(0)
    vocab = 300  # not a multiple of the 128-token block: exercises padding and 3 blocks
    logits = torch.randn(vocab) * 2
    tokens, logprobs, _ = sample(logits.expand(N, vocab).contiguous(), rows(N))
    expected = torch.softmax(logits, -1)
    assert (frequencies(tokens, vocab) - expected).abs().max() < 0.01
    assert torch.allclose(torch.tensor(logprobs), torch.log_softmax(logits, -1)[tokens], atol=1e-5)


def test_temperature_top_k_top_p_match_their_definitions():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    scaled = torch.softmax(logits / 0.5, -1)
    tokens, logprobs, _ = sample(logits.expand(N, 6).contiguous(), rows(N, temperature=0.5, top_k=3))
    kept = scaled[:3] / scaled[:3].sum()
    assert (frequencies(tokens, 6)[:3] - kept).abs().max() < 0.015 and max(tokens) < 3
    # logprobs stay those of the raw (temperature 1, unfiltered) distribution
    assert torch.allclose(torch.tensor(logprobs), torch.log_softmax(logits, -1)[tokens], atol=1e-6)

    probs = torch.softmax(logits, -1)  # top_p=0.7: mass before token 2 is 0.65 < 0.7, before 3 is 0.83
    tokens, _, _ = sample(logits.expand(N, 6).contiguous(), rows(N, top_p=0.7))
    kept = probs[:3] / probs[:3].sum()
    assert (frequencies(tokens, 6)[:3] - kept).abs().max() < 0.015 and max(tokens) < 3


def test_greedy_and_top_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    tokens, logprobs, top = sample(logits, rows(1, temperature=0.0, top_logprobs=2))
    lp = torch.log_softmax(logits[0], -1)
    assert tokens == [1] and abs(logprobs[0] - lp[1].item()) < 1e-6
    assert list(top[0]) == [1, 3] and abs(top[0][3] - lp[3].item()) < 1e-6


def test_inverse_cdf_never_picks_a_token_without_mass():
    probs = torch.zeros(4, 256)
    probs[:, 5] = 1.0
    probs[:, 130] = 1.0
    for u in (0.0, 0.4999999, 0.5, 0.9999999, 1.0):
        picked = _inverse_cdf(probs, torch.full((4,), u))
        assert set(picked.tolist()) <= {5, 130}
