"""Mixture-of-experts models in the native engine (moe.py; docs/moe.md): log-probs against a plain
transformers forward in fp32 through prefill, decode and the prefix cache, per-expert checkpoint
names and the fused in-memory names alike, and the one-line refusal of an MoE router shape the
engine does not implement, in the pre-flight before Ray (batch-invariant mode:
test_native_moe_invariant.py)."""

from __future__ import annotations

import pytest
import torch

from moe_models import MOE_ARCHS, build_moe_model
from polyrl.rollout.base import SamplingParams
from polyrl.rollout.native.engine import NativeEngine
from polyrl.rollout.native.loader import spec_from_config

PROMPTS = [[5, 17, 33, 2, 90, 64, 7], [40, 41], [3, 9, 27, 81, 115]]


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    out = {}
    for arch in MOE_ARCHS:
        path = build_moe_model(tmp_path_factory.mktemp(arch), arch)
        out[arch] = (path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    return out


def hf_logprobs(model, prompt, tokens) -> torch.Tensor:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].float(), -1)
    return logp[len(prompt) - 1 : -1].gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_logprobs_match_transformers_from_disk_and_from_memory(moe_models, arch):
    path, model = moe_models[arch]
    spec = spec_from_config(model.config)
    assert spec.moe.sparse_layers == (True, False, True) and spec.moe.top_k == 2
    assert (spec.moe.shared_intermediate_size > 0) == (arch == "qwen2_moe")
    # per-expert names on disk, fused names (what a trainer syncs) in memory
    for engine in (NativeEngine(path, max_model_len=64), NativeEngine.from_model(model, max_model_len=64)):
        outs = engine.generate_batch(PROMPTS, SamplingParams(n=2, max_tokens=12, seed=3, ignore_eos=True))
        for prompt, samples in zip(PROMPTS, outs):
            for out in samples:
                gap = (torch.tensor(out.logprobs) - hf_logprobs(model, prompt, out.token_ids)).abs().max()
                assert gap.item() <= 1e-5


def test_prefix_cache_turn_matches_transformers(moe_models):
    path, model = moe_models["qwen3_moe"]
    engine = NativeEngine(path, max_model_len=96, prefix_cache_tokens=1024)
    sampling = SamplingParams(max_tokens=8, seed=1, ignore_eos=True)
    first = engine.generate_batch([PROMPTS[0]], sampling)[0][0]
    turn2 = PROMPTS[0] + first.token_ids + [50, 51, 52]
    second = engine.generate_batch([turn2], sampling)[0][0]
    assert engine.stats["prefix_reused_tokens"] == len(PROMPTS[0]) + len(first.token_ids) - 1
    gap = (torch.tensor(second.logprobs) - hf_logprobs(model, turn2, second.token_ids)).abs().max()
    assert gap.item() <= 1e-5


def test_bf16_logprobs_close(moe_models):
    path, model = moe_models["qwen3_moe"]
    engine = NativeEngine(path, dtype="bfloat16", max_model_len=64)
    out = engine.generate_batch([PROMPTS[0]], SamplingParams(max_tokens=10, seed=2, ignore_eos=True))[0][0]
    gap = (torch.tensor(out.logprobs) - hf_logprobs(model, PROMPTS[0], out.token_ids)).abs().max()
    assert gap.item() < 0.25  # bf16 rounding (a flipped top-k moves a token further than in a dense model)


def test_missing_expert_is_named(moe_models):
    from pathlib import Path

    from safetensors.torch import load_file

    path, model = moe_models["qwen3_moe"]
    state = load_file(str(Path(path) / "model.safetensors"))
    del state["model.layers.2.mlp.experts.4.up_proj.weight"]
    with pytest.raises(ValueError, match="model.layers.2.mlp.experts.gate_up_proj"):
        NativeEngine.from_model(state, model.config, max_model_len=64)


def test_unsupported_moe_is_one_line_before_ray(tmp_path):
    from transformers import MixtralConfig

    from polyrl.config import ConfigError, load_config
    from polyrl.job import JobConfig
    from polyrl.trainer.preflight import check_rollout_engine

    MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, num_local_experts=4).save_pretrained(str(tmp_path))
    cfg = load_config(JobConfig, overrides=[f"model.path={tmp_path}"])
    with pytest.raises(ConfigError) as err:
        check_rollout_engine(cfg)
    (problem,) = err.value.problems
    assert "\n" not in problem and "'mixtral'" in problem and "Qwen3MoeForCausalLM" in problem
    # a supported one passes the same check
    path = build_moe_model(tmp_path / "ok", "qwen3_moe")
    check_rollout_engine(load_config(JobConfig, overrides=[f"model.path={path}"]))


def test_grouped_and_per_expert_products_agree(monkeypatch):
    """The experts' paths (moe.py): torch._grouped_mm over the sorted segments, one packed
    product per expert (where the matmul packs), and one mm per expert that received tokens (a
    torch without _grouped_mm, a GPU) give the same output."""
    import torch.nn.functional as F

    from polyrl.rollout.native import moe
    from polyrl.rollout.native.matmul import OneDNNPackedMatmul, PlainMatmul, _onednn_works

    g = torch.Generator().manual_seed(0)
    E, H, I, k, N = 6, 32, 16, 2, 11
    w = moe.MoeWeights(router=torch.randn(E, H, generator=g), gate_up=torch.randn(E, 2 * I, H, generator=g),
                       down=torch.randn(E, H, I, generator=g))
    x = torch.randn(N, H, generator=g)
    weights, ids = moe.route(x, w.router, moe.MoeSpec(E, k, I, True, (True,)))
    grouped = moe.experts_forward(x, weights, ids, w, F.silu)
    if _onednn_works(torch.float32):  # the packed experts (oneDNN's layout, one product per expert)
        packed = moe.packed_moe(w, OneDNNPackedMatmul(batch_hint=4, pack_all=True))
        assert packed.packed is not None and all(t.is_mkldnn for t in packed.packed.down)
        torch.testing.assert_close(moe.experts_forward(x, weights, ids, packed, F.silu), grouped, rtol=1e-4, atol=1e-4)
    assert moe.packed_moe(w, PlainMatmul()) is w  # a matmul that does not pack: the grouped path
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    looped = moe.experts_forward(x, weights, ids, w, F.silu)
    torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-5)
    # and both are the plain sum over each token's experts
    ref = torch.stack([sum(weights[n, j] * F.linear(F.silu(F.linear(x[n], w.gate_up[e, :I])) * F.linear(x[n], w.gate_up[e, I:]),
                                                 w.down[e]) for j, e in enumerate(ids[n].tolist())) for n in range(N)])
    torch.testing.assert_close(grouped, ref, rtol=1e-4, atol=1e-4)


def test_packed_experts_bookkeeping_on_one_thread_keeps_the_bits_and_the_callers_threads(monkeypatch):
    """At decode sizes (moe.py ONE_THREAD_PAIRS) the routing, sort, gather and scatter run on one
    thread and the packed products on the caller's count: the block's output and routes are
    bit-identical to running all of it at the caller's count, the caller's count is back after
    it, and above the size nothing is switched."""
    import torch.nn.functional as F

    from polyrl.rollout.native import moe
    from polyrl.rollout.native.matmul import OneDNNPackedMatmul, _onednn_works

    if not _onednn_works(torch.float32):
        pytest.skip("this torch build has no oneDNN packing: the grouped path has no thread switch")
    g = torch.Generator().manual_seed(0)
    E, H, I, k = 16, 64, 32, 2
    spec = moe.MoeSpec(E, k, I, True, (True,))
    w = moe.packed_moe(moe.MoeWeights(router=torch.randn(E, H, generator=g), gate_up=torch.randn(E, 2 * I, H, generator=g),
                                      down=torch.randn(E, H, I, generator=g)), OneDNNPackedMatmul(batch_hint=64, pack_all=True))
    counts: list[int] = []
    set_threads = torch.set_num_threads

    def recording(n):
        counts.append(n)
        set_threads(n)

    before = torch.get_num_threads()
    try:
        set_threads(2)
        for rows in (64, moe.ONE_THREAD_PAIRS // k + 1):  # a decode step's 64 sequences; a prefill
            x = torch.randn(rows, H, generator=g)
            monkeypatch.setattr(moe, "ONE_THREAD_PAIRS", 0)  # nothing switched: the reference
            ref_routes: list = []
            ref = moe.moe_block(x, w, spec, F.silu, ref_routes)
            monkeypatch.undo()
            monkeypatch.setattr(torch, "set_num_threads", recording)
            counts.clear()
            routes: list = []
            out = moe.moe_block(x, w, spec, F.silu, routes)
            monkeypatch.undo()
            assert torch.equal(out, ref) and torch.equal(routes[0], ref_routes[0])
            assert torch.get_num_threads() == 2
            if rows * k <= moe.ONE_THREAD_PAIRS:  # the routing and the experts' steps, each on one thread
                assert len(counts) >= 8 and counts == [1, 2] * (len(counts) // 2)
            else:
                assert counts == []
    finally:
        set_threads(before)


def test_bf16_decode_on_two_threads_takes_one_bmm_per_projection_with_the_same_bits(monkeypatch):
    """Where one torch.bmm over the plain expert weights gives the packed products to the bit
    (moe.py `bmm_matches_packed`: bf16 on an avx512_bf16 CPU without AMX), a decode step on two
    threads multiplies all experts with one bmm per projection (`_padded_products`); its output
    and routes equal the one-thread step's (per-expert packed products) bit for bit, so the
    thread count still changes no number. A batch whose padding would more than triple the rows
    (one sequence: 2 of 16 experts hold tokens) keeps the per-expert products."""
    import torch.nn.functional as F

    from polyrl.rollout.native import moe
    from polyrl.rollout.native.matmul import matmul_for

    g = torch.Generator().manual_seed(0)
    E, H, I, k = 16, 64, 32, 2
    spec = moe.MoeSpec(E, k, I, True, (True,))

    def layer(dtype):
        w = moe.MoeWeights(router=torch.randn(E, H, generator=g).to(dtype),
                           gate_up=torch.randn(E, 2 * I, H, generator=g).to(dtype),
                           down=torch.randn(E, H, I, generator=g).to(dtype))
        return moe.packed_moe(w, matmul_for(w.gate_up, 64))

    w = layer(torch.bfloat16)
    if w.packed is None or not w.packed.batched:
        pytest.skip("bf16 experts are not packed, or bmm does not give the packed bits, on this CPU")
    taken: list[int] = []
    padded = moe._padded_products
    monkeypatch.setattr(moe, "_padded_products", lambda rows, *a: taken.append(rows.shape[0]) or padded(rows, *a))
    before = torch.get_num_threads()
    try:
        for sequences in (64, 1):
            x = torch.randn(sequences, H, generator=g).to(torch.bfloat16)
            out = {}
            for threads in (1, 2):
                torch.set_num_threads(threads)
                routes: list = []
                out[threads] = (moe.moe_block(x, w, spec, F.silu, routes), routes[0])
            assert torch.equal(out[1][0], out[2][0]) and torch.equal(out[1][1], out[2][1])
            if sequences == 64:
                assert E * torch.bincount(out[1][1].reshape(-1), minlength=E).max() <= moe.PADDED_ROWS_LIMIT * sequences * k
        assert taken == [64 * k]  # the 64-sequence step on two threads only
    finally:
        torch.set_num_threads(before)
