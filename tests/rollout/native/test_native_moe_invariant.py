"""rollout.batch_invariant with a mixture-of-experts model (Qwen3-MoE, Qwen2-MoE with its shared
expert; invariant.py's `experts`): a sequence's tokens and log-prob bits do not depend on the
sequences beside it, and the trainer's batch-invariant forward (polyrl/training/batch_invariant.py)
recomputes the engine's sampled log-probs bit for bit, padded and packed, fp32 and bf16, with
routing replay's metrics measured on the way. Every comparison is exact (`torch.equal` / `==`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(TESTS / "training"), str(TESTS / "distributed")]  # test_batch_invariant's helpers

from moe_models import MOE_ARCHS, build_moe_model  # noqa: E402
from test_batch_invariant import random_requests, to_batch, trainer, training_forward_logprobs  # noqa: E402

from polyrl.rollout.base import SamplingParams  # noqa: E402
from polyrl.rollout.native import invariant as inv  # noqa: E402
from polyrl.rollout.native.engine import NativeEngine  # noqa: E402
from polyrl.rollout.native.moe import MoeSpec, route  # noqa: E402
from polyrl.training import batch_invariant  # noqa: E402
from polyrl.training.moe_replay import RouterReplay  # noqa: E402


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    return {arch: build_moe_model(tmp_path_factory.mktemp(arch), arch) for arch in MOE_ARCHS}


def load(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.mark.parametrize("arch", ["qwen3_moe", pytest.param("qwen2_moe", marks=pytest.mark.slow)])
def test_engine_invariant_to_batch_composition(moe_dirs, arch):
    """One seeded request alone and among others (another slot budget, so other expert tiles):
    the same tokens, log-prob bits and routes; the prefix-cache extend path gives the same bits
    as a fresh prefill."""
    target = [list(range(3, 40)), SamplingParams(n=2, max_tokens=24, seed=7, logprobs=True, ignore_eos=True)]

    def build(**kw):
        return NativeEngine(moe_dirs[arch], dtype="bfloat16", max_model_len=128, batch_invariant=True,
                            tokenizer=None, **kw)

    alone = build(max_num_seqs=2).generate_batch([target[0]], target[1])[0]
    assert alone[0].extra["routed_experts"].shape == (24, 2, 2)
    for seed, slots in ((1, 3), (2, 9)):
        prompts, samplings = random_requests(seed, 5)
        k = seed % 5
        prompts.insert(k, target[0]), samplings.insert(k, target[1])
        got = build(max_num_seqs=slots).generate_batch(prompts, samplings)[k]
        assert [o.token_ids for o in got] == [o.token_ids for o in alone]
        assert [o.logprobs for o in got] == [o.logprobs for o in alone]
        assert all(torch.equal(a.extra["routed_experts"], b.extra["routed_experts"]) for a, b in zip(got, alone))
    engine = build(max_num_seqs=4, prefix_cache_tokens=4096)
    first = engine.generate_batch([target[0][:20]], SamplingParams(max_tokens=5, seed=1, ignore_eos=True))[0][0]
    second_prompt = target[0][:20] + first.token_ids + [5, 6, 7]
    second = engine.generate_batch([second_prompt], target[1])[0]
    assert engine.stats["prefix_reused_tokens"] > 0
    fresh = build(max_num_seqs=4).generate_batch([second_prompt], target[1])[0]
    assert [o.logprobs for o in second] == [o.logprobs for o in fresh]


@pytest.mark.parametrize("arch,dtype,packing", [
    ("qwen3_moe", "float32", "on"), pytest.param("qwen3_moe", "bfloat16", "off", marks=pytest.mark.slow),
    ("qwen2_moe", "bfloat16", "on"), pytest.param("qwen2_moe", "float32", "off", marks=pytest.mark.slow)])
def test_engine_logprobs_equal_trainer_bits(moe_dirs, arch, dtype, packing):
    """The trainer's batch-invariant log-probs (no-grad and the differentiated forward) are the
    engine's sampled ones; with routing replay installed (R3, the engine's routes) they stay so,
    and the trainer's own routes agree with the engine's on every (token, layer)."""
    model = load(moe_dirs[arch])
    engine = NativeEngine.from_model(model, dtype=dtype, batch_invariant=True, max_num_seqs=5, tokenizer=None)
    prompts, samplings = random_requests(len(arch) + len(dtype), 6)
    outputs = engine.generate_batch(prompts, samplings)
    batch = to_batch(prompts, outputs)
    from polyrl.batch import Ragged

    batch = batch.replace(routes=Ragged(torch.cat([o.extra["routed_experts"] for outs in outputs for o in outs]),
                                        batch.response_ids.offsets))
    batch_invariant.enable(model, dtype)
    policy = trainer(model, dtype, packing, tokens=83)
    replay = RouterReplay.install(policy.module, "R3")
    engine_lp = batch.rollout_logprobs.values
    assert torch.equal(policy.logprobs(batch).values, engine_lp)
    assert torch.equal(training_forward_logprobs(policy, batch), engine_lp)
    metrics = replay.metrics()
    assert metrics["moe/route_match"] == 1.0 and 0 < metrics["moe/expert_load_max"] <= 1
    assert replay.aux_loss() is not None  # the differentiated forward gave the load-balancing loss


def test_experts_rows_independent_and_equal_the_plain_block():
    """The building block: a token's output is the same bits in any row position next to any
    other rows, and it is the plain mixture (moe.py's route and experts) up to rounding."""
    import torch.nn.functional as F

    from polyrl.rollout.native.moe import MoeWeights, moe_block

    g = torch.Generator().manual_seed(0)
    E, H, I, S, k = 6, 32, 16, 24, 2
    spec = MoeSpec(E, k, I, True, (True,), shared_intermediate_size=S)
    w = MoeWeights(router=torch.randn(E, H, generator=g), gate_up=torch.randn(E, 2 * I, H, generator=g) / 4,
                   down=torch.randn(E, H, I, generator=g) / 4, shared_gate_up=torch.randn(2 * S, H, generator=g) / 4,
                   shared_down=torch.randn(H, S, generator=g) / 4, shared_gate=torch.randn(1, H, generator=g))
    ev = inv.ExpertsView(router=w.router, gate_up=w.gate_up, down=w.down, shared_gate=w.shared_gate_up[:S],
                         shared_up=w.shared_gate_up[S:], shared_down=w.shared_down, shared_expert_gate=w.shared_gate)
    x = torch.randn(2 * inv.TILE, H, generator=g)
    with inv.serial():
        ref = inv.experts(spec, ev, x, F.silu)
        for m in (1, 3, 64, 100):
            perm = torch.randperm(2 * inv.TILE, generator=g)
            assert torch.equal(inv.experts(spec, ev, inv.pad_rows(x[perm[:m]]), F.silu)[:m], ref[perm[:m]])
    assert torch.equal(route(x, w.router, spec)[1], torch.topk(torch.softmax(x @ w.router.T, -1), k).indices)
    torch.testing.assert_close(ref, moe_block(x, w, spec, F.silu), rtol=1e-5, atol=1e-5)
