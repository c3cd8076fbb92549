"""Prepacked CPU weights (matmul.py): same products as F.linear, repacked atomically on updates."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from polyrl.rollout.base import SamplingParams, WeightUpdateError
from polyrl.rollout.native.matmul import OneDNNPackedMatmul, PlainMatmul, matmul_for
from polyrl.rollout.native.weights import ComputeWeights

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [12, 34, 56]
PACKING = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@pytest.mark.skipif(not PACKING, reason="this torch build has no oneDNN weight packing")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_products_match_f_linear(dtype, tol, rows):
    # The class is exercised in both dtypes; matmul_for chooses it for float32 only.
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no bf16 oneDNN on this CPU")
    mm = OneDNNPackedMatmul(batch_hint=64)
    gen = torch.Generator().manual_seed(0)
    w, b = (torch.randn(96, 48, generator=gen) * 0.1).to(dtype), torch.randn(96, generator=gen).to(dtype)
    x, res = torch.randn(rows, 48, generator=gen).to(dtype), torch.randn(rows, 96, generator=gen).to(dtype)
    packed = mm.pack(w)
    for bias in (None, b):
        ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        torch.testing.assert_close(mm.linear(x, packed, bias).float(), ref, atol=tol, rtol=tol)
        torch.testing.assert_close(mm.residual_linear(res, x, packed, bias).float(), res.float() + ref,
                                   atol=tol, rtol=tol)
    x3 = torch.randn(2, rows, 48, generator=gen).to(dtype)  # prefill's [P, T, H]
    torch.testing.assert_close(mm.linear(x3, packed, None).float(), F.linear(x3.float(), w.float()),
                               atol=tol, rtol=tol)


@pytest.mark.skipif(not PACKING, reason="this torch build has no oneDNN weight packing")
def test_float32_cpu_packs_other_dtypes_stay_plain():
    assert isinstance(matmul_for(torch.zeros(1), batch_hint=64), OneDNNPackedMatmul)
    for dtype in (torch.bfloat16, torch.float16):
        mm = matmul_for(torch.zeros(1, dtype=dtype), batch_hint=64)
        assert isinstance(mm, PlainMatmul) and not mm.packs
        w = torch.randn(8, 4, dtype=dtype)
        assert mm.pack(w) is w


@pytest.mark.skipif(not PACKING, reason="this torch build has no oneDNN weight packing")
def test_engine_packs_on_cpu_and_update_swaps_a_new_set(engine):
    weights = engine._weights
    assert weights.matmul.packs
    old = weights.compute
    assert isinstance(old, ComputeWeights) and old.layers[0].qkv.is_mkldnn
    before = engine.generate_batch([PROMPT], GREEDY)[0][0].token_ids

    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(WeightUpdateError):
        engine.update_weights({q: torch.zeros(1)}, version=1)
    assert weights.compute is old  # rejected: nothing repacked
    assert engine.generate_batch([PROMPT], GREEDY)[0][0].token_ids == before

    new_q = torch.randn_like(weights.targets[q][0]) * 5
    engine.update_weights({q: new_q}, version=2)
    assert weights.compute is not old
    assert old.layers[0].qkv.is_mkldnn  # the old set is left whole for a forward still holding it
    assert engine.generate_batch([PROMPT], GREEDY)[0][0].token_ids != before


@pytest.mark.skipif(not PACKING, reason="this torch build has no oneDNN weight packing")
def test_packed_and_plain_forwards_give_the_same_logits(engine):
    model, weights, cache = engine._sched.model, engine._weights, engine._sched.cache
    tokens = torch.tensor([PROMPT, [7, 8, 9]])
    lengths, slots = torch.tensor([3, 3]), torch.tensor([0, 1])

    def forward():  # prefill (3-d matmuls) then one decode step (2-d, fused residual add)
        cache.reserve(2, 4)
        first = model.prefill(tokens, lengths, slots, cache)
        return first, model.decode(torch.tensor([5, 6]), torch.tensor([3, 3]), cache, attend_len=4)

    with torch.inference_mode():
        packed = forward()
        saved = weights.compute
        try:
            weights.compute = ComputeWeights(weights.layers, weights.lm_head, PlainMatmul())
            plain = forward()
        finally:
            weights.compute = saved
    for a, b in zip(packed, plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
