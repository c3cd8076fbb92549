"""rollout.batch_invariant: the native engine's sampled log-probs equal the trainer's bit for bit.

Real engines (hybrid: built from the trainer's model; standalone: from disk, updated through
update_weights; generate_batch and async generate), real training engines (DDP in this process,
FSDP2 on 2 gloo ranks), padded and packed micro-batches, random batch compositions, fp32 and
bf16. Every comparison is `torch.equal` on the log-prob values.
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout" / "native"))

from gloo_world import run_world_ok  # noqa: E402
from native_models import build_model_dir  # noqa: E402

from polyrl.algorithms import AlgorithmConfig  # noqa: E402
from polyrl.algorithms.off_policy import OffPolicyConfig  # noqa: E402
from polyrl.batch import Ragged, RolloutBatch  # noqa: E402
from polyrl.platform import get_platform  # noqa: E402
from polyrl.rollout.base import SamplingParams  # noqa: E402
from polyrl.rollout.config import RolloutConfig  # noqa: E402
from polyrl.rollout.native import invariant as inv  # noqa: E402
from polyrl.rollout.native.engine import NativeEngine  # noqa: E402
from polyrl.training import batch_invariant, build_engine  # noqa: E402
from polyrl.workers.actor import PPOActor  # noqa: E402
from polyrl.training.config import ActorConfig  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen3")
DTYPES = ("float32", "bfloat16")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bi-models")
    return {arch: build_model_dir(arch, root / arch) for arch in ARCHS}


def load(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def random_requests(seed: int, count: int, vocab: int = 128):
    g = random.Random(seed)
    prompts = [[g.randrange(2, vocab) for _ in range(g.randrange(2, 70))] for _ in range(count)]
    samplings = [SamplingParams(n=g.randrange(1, 4), max_tokens=g.randrange(1, 50), seed=g.randrange(1 << 30),
                                logprobs=True, temperature=g.choice([1.0, 0.7]), ignore_eos=g.random() < 0.5)
                 for _ in range(count)]
    return prompts, samplings


def to_batch(prompts, outputs, version: int = 0) -> RolloutBatch:
    """A RolloutBatch of every sample the engine returned, with its log-probs as the rollout's."""
    P, R, L = [], [], []
    for prompt, outs in zip(prompts, outputs):
        for o in outs:
            P.append(prompt), R.append(o.token_ids), L.extend(o.logprobs)
    n = len(P)
    responses = Ragged.from_rows([torch.tensor(r) for r in R], torch.long)
    zeros = torch.zeros(n, dtype=torch.long)
    versions = torch.full((n,), version, dtype=torch.long)
    g = torch.Generator().manual_seed(n)
    return RolloutBatch(
        prompt_ids=Ragged.from_rows([torch.tensor(p) for p in P], torch.long), response_ids=responses,
        loss_mask=Ragged.full_like(responses, 1.0, torch.float32), group=torch.arange(n) // 2,
        stop_reason=zeros, finished_with_eos=zeros.bool(), weight_version=versions, min_version=versions,
        max_version=versions, continuations=zeros, rollout_logprobs=responses.with_values(torch.tensor(L)),
        advantages=torch.randn(n, generator=g))


def trainer(model, dtype: str, packing: str, *, tokens: int = 97, horizon: int | None = 4, **cfg):
    platform = get_platform("cpu")
    cfg = ActorConfig(strategy="ddp", micro_batch_tokens=tokens, packing=packing, lr=1e-3,
                      compute_dtype=dtype if dtype != "float16" else "float32", **cfg)
    return build_engine(model, cfg, platform, platform.torch_device(0), horizon=horizon)


def training_forward_logprobs(engine, batch: RolloutBatch) -> torch.Tensor:
    """The log-probs of the differentiated forward the loss is built from, in batch order."""
    out = Ragged.full_like(batch.response_ids, 0.0, torch.float32)
    from polyrl.batch import scatter_rows

    for mb in engine.micro_batches(batch):
        lp, _ = engine.forward(mb, with_entropy=True)
        assert lp.requires_grad
        scatter_rows(out, mb, lp.detach().float())
    return out.values


# -- the engine and the trainer, bit for bit -------------------------------------------------------


@pytest.mark.parametrize("packing", ["off", "on"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_engine_logprobs_equal_trainer_bits(model_dirs, arch, dtype, packing):
    model = load(model_dirs[arch])
    engine = NativeEngine.from_model(model, dtype=dtype, batch_invariant=True, max_num_seqs=5, tokenizer=None)
    prompts, samplings = random_requests(hash((arch, dtype, packing)) % 1000, 7)
    batch = to_batch(prompts, engine.generate_batch(prompts, samplings))
    batch_invariant.enable(model, dtype)
    policy = trainer(model, dtype, packing, tokens=random.Random(len(batch)).randrange(60, 200))
    assert policy.packing == packing
    engine_lp = batch.rollout_logprobs.values
    assert torch.equal(policy.logprobs(batch).values, engine_lp)
    assert torch.equal(training_forward_logprobs(policy, batch), engine_lp)


def test_reference_and_checkpointed_forward_equal_engine_bits(model_dirs):
    """A frozen reference engine, and a policy trained with gradient checkpointing."""
    path = model_dirs["qwen3"]
    model = load(path)
    engine = NativeEngine.from_model(model, dtype="bfloat16", batch_invariant=True, max_num_seqs=3, tokenizer=None)
    prompts, samplings = random_requests(5, 6)
    batch = to_batch(prompts, engine.generate_batch(prompts, samplings))
    reference = load(path)
    batch_invariant.enable(reference, "bfloat16")
    assert torch.equal(trainer(reference, "bfloat16", "on", horizon=None).logprobs(batch).values,
                       batch.rollout_logprobs.values)
    model.gradient_checkpointing_enable()
    batch_invariant.enable(model, "bfloat16")
    policy = trainer(model, "bfloat16", "off", gradient_checkpointing=True)
    assert torch.equal(training_forward_logprobs(policy, batch), batch.rollout_logprobs.values)


def test_default_mode_is_not_exact(model_dirs):
    """Without the mode the gap the metric measures is there (what the tests above remove)."""
    model = load(model_dirs["qwen2"])
    engine = NativeEngine.from_model(model, dtype="float32", max_num_seqs=5, tokenizer=None)
    prompts, samplings = random_requests(1, 7)
    batch = to_batch(prompts, engine.generate_batch(prompts, samplings))
    lp = trainer(model, "float32", "off").logprobs(batch).values
    assert not torch.equal(lp, batch.rollout_logprobs.values)


# -- the engine alone: any composition, padding, cache layout, front door ------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_invariant_to_batch_composition(model_dirs, dtype):
    """One seeded request alone, among random others in several slot budgets, through the async
    front door and after a prefix-cached earlier turn: the same tokens and log-prob bits."""
    model = load(model_dirs["llama"])
    target = [list(range(3, 40)), SamplingParams(n=2, max_tokens=40, seed=7, logprobs=True, ignore_eos=True)]

    def build(**kw):
        return NativeEngine.from_model(model, dtype=dtype, batch_invariant=True, tokenizer=None, **kw)

    alone = build(max_num_seqs=2).generate_batch([target[0]], target[1])[0]
    for seed, slots in ((1, 3), (2, 7), (3, 16)):
        prompts, samplings = random_requests(seed, 5)
        k = seed % 5
        prompts.insert(k, target[0]), samplings.insert(k, target[1])
        got = build(max_num_seqs=slots).generate_batch(prompts, samplings)[k]
        assert [o.token_ids for o in got] == [o.token_ids for o in alone]
        assert [o.logprobs for o in got] == [o.logprobs for o in alone]

    async def concurrently(engine):
        prompts, samplings = random_requests(9, 4)
        runs = [engine.generate(p, s) for p, s in zip(prompts, samplings)]
        return (await asyncio.gather(engine.generate(*target), *runs))[0]

    got = asyncio.run(concurrently(build(max_num_seqs=4)))
    assert [o.logprobs for o in got] == [o.logprobs for o in alone]
    # a prompt that extends a finished one is prefilled from the cached prefix (extend path)
    engine = build(max_num_seqs=4, prefix_cache_tokens=4096)
    first = engine.generate_batch([target[0][:20]], SamplingParams(max_tokens=5, seed=1, ignore_eos=True))[0][0]
    second_prompt = target[0][:20] + first.token_ids + [5, 6, 7]
    second = engine.generate_batch([second_prompt], target[1])[0]
    assert engine.stats["prefix_reused_tokens"] > 0
    fresh = build(max_num_seqs=4).generate_batch([second_prompt], target[1])[0]
    assert [o.logprobs for o in second] == [o.logprobs for o in fresh]


def test_linear_tiles_are_row_invariant():
    """The matmul building block: a row's product is the same bits in any tile position and
    next to any other rows (plain F.linear is not: the row count picks the kernel)."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(192, 96, generator=g).to(dtype)
        x = torch.randn(3 * inv.TILE, 96, generator=g).to(dtype)
        with inv.serial():
            ref = inv.linear(x, w, None)
            for m in (1, 5, 63, 70):
                perm = torch.randperm(3 * inv.TILE, generator=g)
                assert torch.equal(inv.linear(x[perm], w, None), ref[perm])
                assert torch.equal(inv.linear(inv.pad_rows(x[perm[:m]]), w, None)[:m], ref[perm[:m]])


def test_attention_independent_of_key_padding():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 2, 2, 32, generator=g)
    keys, values = torch.randn(2, 1, 2, 300, 32, generator=g).unbind(0)
    visible = torch.tensor([1, 17, 64, 65, 130])
    with inv.serial():
        short = inv.attend(q, keys[:, :, :192].contiguous(), values[:, :, :192].contiguous(), visible, 0.2)
        # garbage (finite) past every query's end, and more chunks of it
        long = inv.attend(q, keys[:, :, :256].contiguous(), values[:, :, :256].contiguous(), visible, 0.2)
    assert torch.equal(short, long)


def test_attention_gradients_match_plain_autograd():
    """The invariant forward's hand-written backward (matmuls) against autograd through a plain
    softmax attention, for per-query keys (decode) and keys shared by a block (trainer)."""
    g = torch.Generator().manual_seed(0)
    visible = torch.tensor([1, 30, 64, 100])
    for shared in (False, True):
        q = torch.randn(4, 2, 3, 16, generator=g, requires_grad=True)
        keys = torch.randn(1 if shared else 4, 2, 128, 16, generator=g, requires_grad=True)
        values = torch.randn(1 if shared else 4, 2, 128, 16, generator=g, requires_grad=True)
        weights = torch.randn(4, 2, 3, 16, generator=g)
        (inv.attend(q, keys, values, visible, 0.3) * weights).sum().backward()
        got = [t.grad.clone() for t in (q, keys, values)]
        for t in (q, keys, values):
            t.grad = None
        scores = (q @ keys.transpose(-1, -2)) * 0.3
        hidden = torch.arange(128)[None, :] >= visible[:, None]
        probs = scores.masked_fill(hidden[:, None, None, :], float("-inf")).softmax(-1)
        ((probs @ values) * weights).sum().backward()
        for a, t in zip(got, (q, keys, values)):
            torch.testing.assert_close(a, t.grad, rtol=1e-5, atol=1e-5)


# -- training steps: the metric, the weight sync, the off-policy corrections -----------------------


@pytest.mark.parametrize("standalone", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_training_steps_exactly_on_policy(model_dirs, dtype, standalone):
    """Three steps of sample -> PPO update -> weight sync. `rollout/logprob_diff_max` is 0.0 at
    every step, the IS weights are exactly 1 and nothing is masked. Hybrid: the engine built
    from the policy; standalone: from disk, every version arriving through update_weights."""
    path = model_dirs["qwen2"]
    model = load(path)
    if standalone:
        engine = NativeEngine(path, dtype=dtype, batch_invariant=True, max_num_seqs=6, tokenizer=False)
    else:
        engine = NativeEngine.from_model(model, dtype=dtype, batch_invariant=True, max_num_seqs=6, tokenizer=None)
    batch_invariant.enable(model, dtype)
    policy = trainer(model, dtype, "auto", tokens=150, horizon=6)
    off_policy = OffPolicyConfig(is_level="token", mask_level="token", mask_low=0.999999, mask_high=1.000001)
    actor = PPOActor(policy, policy.cfg, AlgorithmConfig(), off_policy.resolve(on_policy=True), torch.device("cpu"))
    for step in range(3):
        prompts, samplings = random_requests(10 + step, 6)
        batch = to_batch(prompts, engine.generate_batch(prompts, samplings), version=step)
        # step 0: one optimizer step (the differentiated forward is measured); then two
        metrics = actor.update(batch, num_mini_batches=1 if step == 0 else 2, use_rollout_logprobs=False,
                               version=step)
        assert metrics["rollout/logprob_diff_max"] == 0.0, (step, metrics)
        # every weight is exp(0) = 1 exactly (the max); the mean is a token-weighted average over
        # micro-batches, whose shares sum to 1 up to float64 rounding
        assert metrics["off_policy/is_weight_max"] == 1.0
        assert metrics["off_policy/is_weight_mean"] == pytest.approx(1.0, abs=1e-12)
        assert metrics["off_policy/masked_frac"] == 0.0 and metrics["off_policy/kl_rollout_proximal"] == 0.0
        assert metrics["off_policy/is_clipped_frac"] == 0.0
        engine.update_weights(policy.weight_stream(), version=step + 1)


def test_corrections_are_identities(model_dirs):
    """The correction itself on the trainer's and the engine's log-probs: IS weight exactly 1 and
    kept exactly where the loss mask is, under every level."""
    from polyrl.algorithms.off_policy import off_policy_correction

    model = load(model_dirs["llama"])
    engine = NativeEngine.from_model(model, dtype="bfloat16", batch_invariant=True, max_num_seqs=4, tokenizer=None)
    prompts, samplings = random_requests(3, 5)
    batch = to_batch(prompts, engine.generate_batch(prompts, samplings))
    batch_invariant.enable(model, "bfloat16")
    policy = trainer(model, "bfloat16", "off", tokens=4096)
    (mb,) = list(policy.micro_batches(batch.replace(old_logprobs=policy.logprobs(batch))))
    for is_level, mask_level in (("token", "token"), ("sequence", "sequence"), ("token", "geometric")):
        cfg = OffPolicyConfig(is_level=is_level, mask_level=mask_level, mask_low=0.999999, mask_high=1.000001)
        c = off_policy_correction(mb.old_logprobs, mb.rollout_logprobs, mb.response_mask, cfg)
        assert torch.equal(c.weights, mb.response_mask) and torch.equal(c.keep, mb.response_mask)


# -- FSDP2 on two gloo ranks ---------------------------------------------------------------------


def fsdp2_rank(rank: int, world_size: int, path: str, batches: dict) -> dict:
    """Each rank recomputes its half of every batch with FSDP2 (padded and packed)."""
    import torch.distributed as dist

    from polyrl.batch import shard

    out = {}
    for (dtype, packing), batch in batches.items():
        model = load(path)
        batch_invariant.enable(model, dtype)
        platform = get_platform("cpu")
        cfg = ActorConfig(strategy="fsdp2", micro_batch_tokens=80, packing=packing, compute_dtype=dtype,
                          param_dtype="float32")
        engine = build_engine(model, cfg, platform, platform.torch_device(0), rank=rank,
                              world_size=world_size, group=dist.group.WORLD, horizon=4)
        mine = shard(batch, world_size)[rank]
        lp = engine.logprobs(mine)
        out[(dtype, packing)] = (lp.values, mine.rollout_logprobs.values)
    return out


@pytest.mark.slow
def test_fsdp2_two_ranks_equal_engine_bits(model_dirs, tmp_path):
    path = model_dirs["qwen3"]
    batches = {}
    for i, dtype in enumerate(DTYPES):
        engine = NativeEngine(path, dtype=dtype, batch_invariant=True, max_num_seqs=4, tokenizer=False)
        prompts, samplings = random_requests(20 + i, 6)
        batch = to_batch(prompts, engine.generate_batch(prompts, samplings))
        for packing in ("off", "on"):
            batches[(dtype, packing)] = batch
    ranks = run_world_ok(fsdp2_rank, 2, tmp_path, args=(path, batches), timeout_s=300, backend_timeout_s=250)
    for rank, out in ranks.items():
        for key, (trainer_lp, engine_lp) in out.items():
            assert trainer_lp.numel() > 0
            assert torch.equal(trainer_lp, engine_lp), (rank, key, (trainer_lp - engine_lp).abs().max())


# -- configuration ----------------------------------------------------------------------------------


def test_only_the_native_backend():
    assert RolloutConfig(batch_invariant=True).batch_invariant
    with pytest.raises(ValueError, match="rollout.batch_invariant=true needs rollout.backend=native"):
        RolloutConfig(backend="vllm", batch_invariant=True)


def test_compile_on_refused(model_dirs):
    model = load(model_dirs["qwen2"])
    batch_invariant.enable(model, "float32")
    with pytest.raises(ValueError, match="actor.compile=on"):
        trainer(model, "float32", "off", compile="on")
