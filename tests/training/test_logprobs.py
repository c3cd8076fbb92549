"""The fused, chunked log-prob + entropy head (polyrl/training/logprobs.py) against the plain
[rows, vocab] computation: values and gradients, entropy gradient on and off, fp32 and bf16
autocast, several chunks with a ragged last one, and end to end through `response_logprobs`."""

from __future__ import annotations

import pytest
import torch

from polyrl.batch import Ragged, RolloutBatch, collate
from polyrl.training import logprobs as lpmod
from polyrl.training.logprobs import fused_logprobs, response_logprobs


def plain(hidden, weight, targets):
    """The unfused reference: full logits, log-softmax, gather, entropy."""
    logits = torch.nn.functional.linear(hidden, weight).float()
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _inputs(n=37, h=16, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = (torch.randn(v, h, generator=g) * 0.5).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    gl, ge = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return hidden, weight, targets, gl, ge


def _grads(fn, hidden, weight, targets, gl, ge, entropy_grad):
    hidden.grad = weight.grad = None
    lp, ent = fn(hidden, weight, targets)
    loss = (lp * gl).sum() + ((ent * ge).sum() if entropy_grad else 0.0)
    loss.backward()
    return lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.fixture
def small_chunks(monkeypatch):
    # 50-token vocab: 5 rows per chunk, so 37 rows take 8 chunks, the last one of 2 rows
    monkeypatch.setattr(lpmod, "CHUNK_ELEMENTS", 250)
    monkeypatch.setattr(lpmod, "MIN_CHUNK_ROWS", 1)


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_fused_matches_plain_fp32(small_chunks, entropy_grad):
    args = _inputs()
    ref = _grads(plain, *args, entropy_grad)
    got = _grads(lambda h, w, t: fused_logprobs(h, w, t), *args, entropy_grad)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the entropy term really contributes when on (so the comparison above is not vacuous)
    if entropy_grad:
        other = _grads(plain, *args, False)
        assert not torch.allclose(other[2], ref[2], atol=1e-4)


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_fused_matches_plain_under_bf16_autocast(small_chunks, entropy_grad):
    args = _inputs(seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _grads(plain, *args, entropy_grad)
        got = _grads(lambda h, w, t: fused_logprobs(h, w, t), *args, entropy_grad)
    assert got[0].dtype == torch.float32 and got[3].dtype == torch.float32
    # both round the logits to bf16 the same way; the gradients differ only by bf16 rounding of
    # the per-chunk weight-gradient partial sums (accumulated in fp32 here)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_fused_without_entropy_and_no_grad(small_chunks):
    hidden, weight, targets, *_ = _inputs(seed=2)
    with torch.no_grad():
        lp, ent = fused_logprobs(hidden, weight, targets, with_entropy=False)
        ref, _ = plain(hidden, weight, targets)
    assert ent is None
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-5)


def _model_and_batch():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 64, (k,), generator=g).tolist() for k in (3, 5, 2, 4)]
    responses = [torch.randint(2, 64, (k,), generator=g).tolist() for k in (6, 1, 4, 3)]
    resp = Ragged.from_rows(responses, torch.long)
    zeros = torch.zeros(4, dtype=torch.long)
    batch = RolloutBatch(prompt_ids=Ragged.from_rows(prompts, torch.long), response_ids=resp,
                         loss_mask=Ragged.full_like(resp, 1.0, torch.float32), group=torch.arange(4),
                         stop_reason=zeros, finished_with_eos=zeros.bool(), weight_version=zeros,
                         min_version=zeros, max_version=zeros, continuations=zeros)
    return model, collate(batch, [0, 1, 2, 3], torch.device("cpu"))


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_response_logprobs_fused_equals_plain(monkeypatch, autocast, entropy_grad):
    """Through the model: the same log-probs / entropy on real response tokens, 0 on padding, and
    the same parameter gradients, whichever path the size rule picks."""
    model, mb = _model_and_batch()
    mask = mb.response_mask
    g = torch.Generator().manual_seed(4)
    wl, we = torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)
    monkeypatch.setattr(lpmod, "CHUNK_ELEMENTS", 64 * 3)  # 3 rows per chunk: 14 rows, 5 chunks
    monkeypatch.setattr(lpmod, "MIN_CHUNK_ROWS", 1)
    results = []
    for threshold in (1 << 60, 0):  # plain, then fused
        monkeypatch.setattr(lpmod, "FUSED_MIN_ELEMENTS", threshold)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            lp, ent = response_logprobs(model, mb, with_entropy=True, entropy_grad=entropy_grad)
        assert ent.requires_grad == entropy_grad
        loss = (lp * wl * mask).sum() + ((ent * we * mask).sum() if entropy_grad else 0.0)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((lp.detach(), ent.detach(), grads))
    (lp0, e0, g0), (lp1, e1, g1) = results
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-5, atol=1e-5)
    real = mask.bool()
    torch.testing.assert_close(lp1[real], lp0[real], **tol)
    torch.testing.assert_close(e1[real], e0[real], **tol)
    assert (lp1[~real] == 0).all() and (e1[~real] == 0).all()
    assert g0.keys() == g1.keys() and "model.embed_tokens.weight" in g1
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], **tol, msg=name)


def test_size_rule_picks_the_path(monkeypatch):
    """Below FUSED_MIN_ELEMENTS logits the plain path runs, at or above it the fused one."""
    model, mb = _model_and_batch()
    calls = []
    real_fused = lpmod.fused_logprobs
    monkeypatch.setattr(lpmod, "fused_logprobs", lambda *a, **k: calls.append(1) or real_fused(*a, **k))
    elements = mb.target_ids.numel() * 64
    monkeypatch.setattr(lpmod, "FUSED_MIN_ELEMENTS", elements + 1)
    response_logprobs(model, mb)
    assert calls == []
    monkeypatch.setattr(lpmod, "FUSED_MIN_ELEMENTS", elements)
    response_logprobs(model, mb)
    assert calls == [1]


@pytest.mark.parametrize("varlen", [True, False])
@pytest.mark.parametrize("autocast", [False, True])
def test_packed_loss_and_gradients_equal_padded(autocast, varlen):
    """polyrl/batch/packed.py: one row, positions restarting per sample, attention per sample
    (`varlen`, polyrl/training/varlen.py) or through a dense block-diagonal mask; the same
    log-probs and parameter gradients as the padded micro-batch (tests/training/test_packing.py
    covers the packed attention further)."""
    from polyrl.batch.packed import collate_packed, plan_packed

    model, _ = _model_and_batch()
    g = torch.Generator().manual_seed(5)
    lengths_p, lengths_r = (3, 5, 2, 4, 9, 1), (6, 1, 4, 3, 2, 7)
    prompts = [torch.randint(2, 64, (k,), generator=g).tolist() for k in lengths_p]
    resp = Ragged.from_rows([torch.randint(2, 64, (k,), generator=g).tolist() for k in lengths_r], torch.long)
    n = len(prompts)
    zeros = torch.zeros(n, dtype=torch.long)
    batch = RolloutBatch(prompt_ids=Ragged.from_rows(prompts, torch.long), response_ids=resp,
                         loss_mask=Ragged.full_like(resp, 1.0, torch.float32), group=torch.arange(n),
                         stop_reason=zeros, finished_with_eos=zeros.bool(), weight_version=zeros,
                         min_version=zeros, max_version=zeros, continuations=zeros)
    idx = list(range(n))
    padded, packed = collate(batch, idx, torch.device("cpu")), collate_packed(batch, idx, torch.device("cpu"), varlen)
    assert (packed.attention_mask is None) == varlen
    assert packed.input_ids.shape == (1, sum(p + r - 1 for p, r in zip(lengths_p, lengths_r)))
    w = torch.randn(padded.response_mask.shape, generator=g)
    out = []
    for mb in (padded, packed):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            lp, ent = response_logprobs(model, mb, with_entropy=True, entropy_grad=True)
        ((lp + 0.1 * ent) * w * mb.response_mask).sum().backward()
        out.append((lp.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}))
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-4, atol=1e-5)
    real = padded.response_mask.bool()
    torch.testing.assert_close(out[1][0][real], out[0][0][real], **tol)
    for k in out[0][1]:
        torch.testing.assert_close(out[1][1][k], out[0][1][k], **tol, msg=k)
    # packing to a budget: every sample once, no pack over the budget unless a sample alone is
    packs = plan_packed([5, 30, 7, 12, 3, 20], 32)
    assert sorted(i for p in packs for i in p) == list(range(6))
    assert all(sum([5, 30, 7, 12, 3, 20][i] for i in p) <= 32 for p in packs)


def _reference(logits, targets):
    """autograd's own ops: log-softmax, gather, entropy."""
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_plain_head_node_equals_autograd_ops(entropy_grad):
    """`logits_logprobs` (the plain path's one autograd node, which consumes its logits): values in
    float32 against float64 (logits up to ~60, a [rows, len, V] and a [n, V] shape), gradients in
    float64 against autograd's (with the entropy term when it has gradient), and the entropy
    without gradient unless asked. (Not gradcheck: it runs each backward several times.)"""
    from polyrl.training.logprobs import logits_logprobs

    g = torch.Generator().manual_seed(7)
    for shape in ((3, 4, 97), (9, 97)):
        logits = torch.randn(shape, generator=g, dtype=torch.float64) * 20
        targets = torch.randint(0, 97, shape[:-1], generator=g)
        ref_lp, ref_ent = _reference(logits, targets)
        lp, ent = logits_logprobs(logits.float(), targets, entropy_grad=entropy_grad)
        assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == shape[:-1]
        torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=2e-5)
        torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=2e-5)
        x = logits.clone().requires_grad_()
        lp, ent = logits_logprobs(x * 1, targets, entropy_grad=entropy_grad)  # (* 1: a non-leaf to consume)
        assert lp.requires_grad and ent.requires_grad == entropy_grad
        lp, ent = logits_logprobs(x * 1, targets, with_entropy=False)
        assert ent is None

    small = torch.randn(2, 3, 11, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (2, 3), generator=g)
    weights = torch.randn(2, 2, 3, generator=g, dtype=torch.float64)

    def loss(fn):
        def run(x):
            lp, ent = fn(x * 1, targets)
            return (lp * weights[0]).sum() + ((ent * weights[1]).sum() if entropy_grad else 0.0)
        return run

    ours = loss(lambda x, t: logits_logprobs(x, t, entropy_grad=entropy_grad))
    grad, = torch.autograd.grad(ours(small), small)
    ref = loss(lambda x, t: (lambda lp, e: (lp, e if entropy_grad else e.detach()))(*_reference(x, t)))
    ref_grad, = torch.autograd.grad(ref(small), small)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-10)


def test_plain_head_node_backward_runs_once():
    """The backward turns the saved probabilities into the logits' gradient: a second backward
    through the same graph is refused in one line rather than computing a wrong gradient."""
    from polyrl.training.logprobs import logits_logprobs

    x = torch.randn(4, 13, requires_grad=True)
    lp, _ = logits_logprobs(x * 1, torch.zeros(4, dtype=torch.long))
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph=True is not supported"):
        lp.sum().backward()
