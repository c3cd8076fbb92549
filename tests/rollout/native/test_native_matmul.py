"""Prepacked CPU weights (matmul.py): same products as F.linear, repacked atomically on updates."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from polyrl.rollout.base import SamplingParams, WeightUpdateError
import polyrl.rollout.native.matmul as matmul_module
from polyrl.rollout.native.matmul import (OneDNNPackedMatmul, PlainMatmul, WidenedMatmul, cpu_features,
                                          has_matrix_instructions, matmul_for, packing_pays)
from polyrl.rollout.native.weights import ComputeWeights

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [12, 34, 56]
PACKING = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@pytest.mark.skipif(not PACKING, reason="this torch build has no oneDNN weight packing")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_products_match_f_linear(dtype, tol, rows):
    # The class is exercised in both dtypes; matmul_for chooses it for float32 only (and packs
    # bf16 / fp16 as float32 with WidenedMatmul on CPUs without their matrix instructions).
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no bf16 oneDNN on this CPU")
    mm = OneDNNPackedMatmul(batch_hint=64, pack_all=True)
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
def test_float32_cpu_packs_other_dtypes_widen_only_without_matrix_instructions():
    assert isinstance(matmul_for(torch.zeros(1), batch_hint=64), OneDNNPackedMatmul)
    for dtype in (torch.bfloat16, torch.float16):
        mm = matmul_for(torch.zeros(1, dtype=dtype), batch_hint=64)
        w = torch.randn(8, 4, dtype=dtype)
        if has_matrix_instructions(dtype) and packing_pays((8, 4), dtype, cpu_features()):
            # bf16 on avx512_bf16 without AMX: every matrix packed, still in bf16
            assert type(mm) is OneDNNPackedMatmul and mm.packs and dtype == torch.bfloat16
            assert mm.pack(w).is_mkldnn and mm.pack(w).dtype == dtype
        elif has_matrix_instructions(dtype):  # other native bf16 / fp16 kernels: plain F.linear
            assert isinstance(mm, PlainMatmul) and not mm.packs
            assert mm.pack(w) is w
        else:
            assert isinstance(mm, WidenedMatmul) and mm.packs and mm.pack(w).dtype == torch.float32
            assert WidenedMatmul(batch_hint=64, pack_all=True).pack(w).is_mkldnn


def test_matrix_instructions_are_judged_from_the_cpu_capabilities(monkeypatch):
    caps = {"architecture": "x86_64", "avx2": True, "avx512_bf16": False, "amx_bf16": False,
            "avx512_fp16": False, "amx_fp16": False}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: dict(caps), raising=False)
    assert not has_matrix_instructions(torch.bfloat16) and not has_matrix_instructions(torch.float16)
    assert has_matrix_instructions(torch.float32)
    caps["avx512_bf16"] = True  # e.g. AMD Zen 4, Intel Cooper Lake
    assert has_matrix_instructions(torch.bfloat16) and not has_matrix_instructions(torch.float16)
    caps["architecture"] = "aarch64"  # not judged: the plain kernels stay
    assert has_matrix_instructions(torch.float16)


def test_without_cpu_capabilities_the_vector_level_decides(monkeypatch):
    import polyrl.rollout.native.matmul as matmul

    monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)  # an older torch
    monkeypatch.setattr(matmul.platform, "machine", lambda: "x86_64")
    level = {"value": "AVX2"}
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: level["value"])
    assert not has_matrix_instructions(torch.bfloat16) and not has_matrix_instructions(torch.float16)
    level["value"] = "AVX512"  # may have them: cannot tell, keep the plain kernels
    assert has_matrix_instructions(torch.bfloat16)
    level["value"] = "AVX2"
    monkeypatch.setattr(matmul.platform, "machine", lambda: "aarch64")
    assert has_matrix_instructions(torch.bfloat16)


@pytest.mark.skipif(not PACKING, reason="this torch build has no oneDNN weight packing")
@pytest.mark.parametrize("pack_all", [True, False])  # packed, or plain fp32 where packing does not pay
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_widened_products_are_the_fp32_product_rounded_once(dtype, rows, pack_all, monkeypatch):
    monkeypatch.setattr(matmul_module, "packing_pays", lambda shape, dtype, features: False)
    mm = WidenedMatmul(batch_hint=64, pack_all=pack_all)
    gen = torch.Generator().manual_seed(0)
    w, b = (torch.randn(96, 48, generator=gen) * 0.1).to(dtype), torch.randn(96, generator=gen).to(dtype)
    x, res = torch.randn(rows, 48, generator=gen).to(dtype), torch.randn(rows, 96, generator=gen).to(dtype)
    packed = mm.pack(w)
    ulp = torch.finfo(dtype).eps  # relative: one unit in the last place
    for bias in (None, b):
        exact = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        out = mm.linear(x, packed, bias)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), exact.to(dtype).float(), atol=1e-6, rtol=ulp)
        # the residual add is done in the model's dtype, after the product is rounded (as in HF)
        got = mm.residual_linear(res, x, packed, bias)
        torch.testing.assert_close(got.float(), (res + exact.to(dtype)).float(), atol=1e-6, rtol=ulp)
    x3 = torch.randn(2, rows, 48, generator=gen).to(dtype)  # prefill's [P, T, H]
    torch.testing.assert_close(mm.linear(x3, packed, None).float(), F.linear(x3.float(), w.float()).to(dtype).float(),
                               atol=1e-6, rtol=ulp)


@pytest.mark.skipif(not PACKING, reason="this torch build has no oneDNN weight packing")
def test_engine_packs_on_cpu_and_update_swaps_a_new_set(qwen3_dir, monkeypatch):
    engine = _engine_with(OneDNNPackedMatmul(batch_hint=4, pack_all=True), qwen3_dir, "float32", monkeypatch)
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


def _prefill_and_decode(engine):
    """Logits of a prefill (3-d matmuls) then one decode step (2-d, fused residual add)."""
    model, cache = engine._sched.model, engine._sched.cache
    tokens = torch.tensor([PROMPT, [7, 8, 9]])
    lengths, slots = torch.tensor([3, 3]), torch.tensor([0, 1])
    cache.reserve(2, 4)
    first = model.prefill(tokens, lengths, slots, cache)
    return first, model.decode(torch.tensor([5, 6]), torch.tensor([3, 3]), cache, attend_len=4)


def _packed_and_plain(engine):
    weights = engine._weights
    with torch.inference_mode():
        packed = _prefill_and_decode(engine)
        saved = weights.compute
        try:
            weights.compute = ComputeWeights(weights.layers, weights.lm_head, PlainMatmul())
            plain = _prefill_and_decode(engine)
        finally:
            weights.compute = saved
    return packed, plain


@pytest.mark.skipif(not PACKING, reason="this torch build has no oneDNN weight packing")
def test_packed_bf16_forward_matches_the_plain_one(model_dirs, monkeypatch):
    """bf16 packed (what avx512_bf16 CPUs without AMX run) against `F.linear` / `addmm` on the plain
    weights: a prefill and a decode step give the same logits (bit for bit on the CPU it was
    measured on; within bf16 rounding anywhere), and the same greedy tokens."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no bf16 oneDNN on this CPU")
    engine = _engine_with(OneDNNPackedMatmul(batch_hint=4, pack_all=True), model_dirs["qwen2"], "bfloat16",
                          monkeypatch)  # Qwen2: the qkv bias goes through the packed product too
    cw = engine._weights.compute
    assert cw.num_packed == 4 * len(cw.layers) + 1 and cw.layers[0].qkv.dtype == torch.bfloat16
    for a, b in zip(*_packed_and_plain(engine)):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    plain = _engine_with(PlainMatmul(), model_dirs["qwen2"], "bfloat16", monkeypatch)
    prompts = [PROMPT, [7, 8, 9, 10, 11]]
    assert engine.generate_batch(prompts, GREEDY) == plain.generate_batch(prompts, GREEDY)


@pytest.mark.skipif(not PACKING, reason="this torch build has no oneDNN weight packing")
@pytest.mark.parametrize("packed_shapes", ["all", "qkv and lm_head"])  # every matrix, or a mix
def test_packed_and_plain_forwards_give_the_same_logits(qwen3_dir, packed_shapes, monkeypatch):
    mm = OneDNNPackedMatmul(batch_hint=4, pack_all=packed_shapes == "all")
    engine = _engine_with(mm, qwen3_dir, "float32", monkeypatch)
    if packed_shapes != "all":  # pack the shapes of qkv and lm_head only, then rebuild
        chosen = {tuple(engine._weights.layers[0].qkv.shape), tuple(engine._weights.lm_head.shape)}
        monkeypatch.setattr(matmul_module, "packing_pays", lambda shape, dtype, features: shape in chosen)
        engine._weights.compute = engine._weights._compute_weights()
    cw = engine._weights.compute
    assert cw.layers[0].qkv.is_mkldnn and cw.lm_head.is_mkldnn
    mats = [m for lw in engine._weights.layers for m in (lw.qkv, lw.o, lw.gate_up, lw.down)] + [engine._weights.lm_head]
    expected = len(mats) if packed_shapes == "all" else sum(tuple(m.shape) in chosen for m in mats)
    assert cw.num_packed == expected < len(mats) + (packed_shapes == "all")
    for a, b in zip(*_packed_and_plain(engine)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _engine_with(matmul, model_dir, dtype, monkeypatch):
    from polyrl.rollout.native import weights as weights_module
    from polyrl.rollout.native.engine import NativeEngine

    monkeypatch.setattr(weights_module, "matmul_for", lambda like, batch_hint: matmul)
    return NativeEngine(model_dir, dtype=dtype, max_model_len=64, max_num_seqs=4, tokenizer=False)


@pytest.mark.skipif(not PACKING, reason="this torch build has no oneDNN weight packing")
@pytest.mark.parametrize("dtype,tol", [("bfloat16", 0.05), ("float16", 0.01)])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_widened_engine_agrees_with_a_plain_one(model_dirs, arch, dtype, tol, monkeypatch):
    """Widened (fp32 products, fp32 cache and attention) against plain kernels in the model's
    dtype, whatever this CPU has: same greedy tokens, log-probs and logits within the dtype's
    rounding."""
    widened = _engine_with(WidenedMatmul(batch_hint=4), model_dirs[arch], dtype, monkeypatch)
    plain = _engine_with(PlainMatmul(), model_dirs[arch], dtype, monkeypatch)
    assert widened.health()["matmul"] == "WidenedMatmul" and plain.health()["matmul"] == "PlainMatmul"
    assert widened._sched.cache.dtype == torch.float32 and plain._sched.cache.dtype == widened.dtype
    prompts = [PROMPT, [7, 8, 9, 10, 11]]
    sampling = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for a, b in zip(widened.generate_batch(prompts, sampling), plain.generate_batch(prompts, sampling)):
        assert a[0].token_ids == b[0].token_ids
        assert max(abs(x - y) for x, y in zip(a[0].logprobs, b[0].logprobs)) < tol
    with torch.inference_mode():
        for x, y in zip(_prefill_and_decode(widened), _prefill_and_decode(plain)):
            torch.testing.assert_close(x, y, atol=4 * tol, rtol=0)


@pytest.mark.skipif(not PACKING, reason="this torch build has no oneDNN weight packing")
def test_a_failed_repack_falls_back_to_plain_kernels_and_says_so(qwen3_dir, monkeypatch, caplog):
    engine = _engine_with(WidenedMatmul(batch_hint=4), qwen3_dir, "bfloat16", monkeypatch)
    before = engine.generate_batch([PROMPT], GREEDY)[0][0].token_ids

    def out_of_memory(self, weight):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(WidenedMatmul, "pack", out_of_memory)
    q = "model.layers.0.self_attn.q_proj.weight"
    with caplog.at_level("WARNING"):
        engine.update_weights({q: engine._weights.targets[q][0].clone()}, version=1)  # same values
    assert "packing the weights failed" in caplog.text
    assert engine.health()["matmul"] == "PlainMatmul" and engine.weight_version == 1
    assert engine.generate_batch([PROMPT], GREEDY)[0][0].token_ids == before  # fp32 cache, plain kernels


def test_packing_choice_is_a_pure_function_of_shape_dtype_and_cpu_features(monkeypatch):
    """Same-seed runs must compute the same log-probs: the choice never reads a clock."""
    from polyrl.rollout.native.matmul import PACK_NUMEL_WITHOUT_AVX512

    def no_clock():
        raise AssertionError("packing_pays must not time anything")

    import time

    monkeypatch.setattr(time, "perf_counter", no_clock)
    avx512, avx2 = frozenset({"avx512_f"}), frozenset()
    small, large = (128, 128), (PACK_NUMEL_WITHOUT_AVX512 // 512, 512)
    assert packing_pays(small, torch.float32, avx512) and packing_pays(large, torch.float32, avx512)
    assert not packing_pays(small, torch.float32, avx2) and packing_pays(large, torch.float32, avx2)
    assert not packing_pays(large, torch.bfloat16, avx512)  # bf16 / fp16 are widened to fp32 first
    # bf16 with avx512_bf16 packs every matrix, except with AMX; fp16 never packs as fp16
    zen4, amx = avx512 | {"avx512_bf16"}, avx512 | {"avx512_bf16", "amx_tile", "amx_bf16"}
    assert packing_pays(small, torch.bfloat16, zen4) and packing_pays(large, torch.bfloat16, zen4)
    assert not packing_pays(small, torch.bfloat16, amx) and not packing_pays(large, torch.float16, zen4)
    # asked again, in any order, the answer is the same (nothing measured, nothing cached)
    for _ in range(3):
        assert [packing_pays(s, torch.float32, f) for s in (large, small) for f in (avx2, avx512)] == \
            [True, True, False, True]


def test_cpu_features_come_from_the_capabilities(monkeypatch):
    caps = {"architecture": "x86_64", "avx2": True, "avx512_f": False, "amx_tile": False,
            "avx512_bf16": False, "amx_bf16": False}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: dict(caps), raising=False)
    cpu_features.cache_clear()
    try:
        assert cpu_features() == frozenset()
        caps["avx512_f"] = True
        cpu_features.cache_clear()
        assert cpu_features() == frozenset({"avx512_f"})
        caps["avx512_bf16"] = True
        cpu_features.cache_clear()
        assert cpu_features() == frozenset({"avx512_f", "avx512_bf16"})
        caps["architecture"] = "aarch64"
        cpu_features.cache_clear()
        assert cpu_features() == frozenset()
    finally:
        cpu_features.cache_clear()
