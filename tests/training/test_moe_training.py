"""Mixture-of-experts policies (Qwen3-MoE, Qwen2-MoE; docs/moe.md) in the trainer and the native
engine: the engine's sampled log-probs equal the trainer's packed, micro-batched recompute within
1e-5 in fp32; an update trains the router and the experts (with gradient checkpointing); FSDP2
on two gloo ranks equals DDP on one."""

from __future__ import annotations

import pytest
import torch

import engine_ranks
from gloo_world import run_world_ok
from moe_models import MOE_ARCHS, build_moe_model
from polyrl.batch import Ragged, RolloutBatch
from polyrl.rollout.base import SamplingParams
from polyrl.rollout.native.engine import NativeEngine

PROMPTS = [[5, 17, 33, 2, 90, 64, 7], [40, 41], [3, 9, 27, 81, 115], [60, 61, 62, 63]]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    return {arch: build_moe_model(tmp_path_factory.mktemp(arch), arch) for arch in MOE_ARCHS}


def sampled_batch(engine: NativeEngine, n: int = 2, max_tokens: int = 14) -> RolloutBatch:
    outs = engine.generate_batch(PROMPTS, SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=7,
                                                         ignore_eos=True))
    prompts, responses, logprobs = [], [], []
    for prompt, samples in zip(PROMPTS, outs):
        for out in samples:
            prompts.append(torch.tensor(prompt))
            responses.append(torch.tensor(out.token_ids))
            logprobs.append(torch.tensor(out.logprobs))
    k = len(responses)
    response_ids = Ragged.from_rows(responses, torch.long)
    zeros = torch.zeros(k, dtype=torch.long)
    return RolloutBatch(
        prompt_ids=Ragged.from_rows(prompts, torch.long), response_ids=response_ids,
        loss_mask=Ragged.full_like(response_ids, 1.0, torch.float32), group=torch.arange(k) // n,
        stop_reason=zeros, finished_with_eos=torch.zeros(k, dtype=torch.bool), weight_version=zeros,
        min_version=zeros, max_version=zeros, continuations=zeros,
        rollout_logprobs=Ragged.from_rows(logprobs, torch.float32), advantages=torch.randn(k))


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("packing", ["on", "off"])
def test_engine_logprobs_equal_trainer_fp32(moe_dirs, arch, packing):
    engine = NativeEngine(moe_dirs[arch], max_model_len=64, tokenizer=False)
    batch = sampled_batch(engine)
    # 64-token micro-batches: the 8 samples split over several, packed or padded
    trainer, _ = engine_ranks.build(moe_dirs[arch], engine_ranks.actor_config("ddp", packing=packing), 0, 1)
    got = trainer.logprobs(batch).values.float()
    gap = (got - batch.rollout_logprobs.values).abs().max().item()
    assert gap <= 1e-5, f"{arch}: engine vs trainer log-prob gap {gap}"


def test_update_trains_router_and_experts_with_checkpointing(moe_dirs):
    path = moe_dirs["qwen3_moe"]
    cfg = engine_ranks.actor_config("ddp", gradient_checkpointing=True, ppo_epochs=1)
    trainer, actor = engine_ranks.build(path, cfg, 0, 1)
    before = engine_ranks.full_weights(trainer)
    metrics = actor.update(engine_ranks.make_batch(seed=3, n=6), 1, False)
    after = engine_ranks.full_weights(trainer)
    assert torch.isfinite(torch.tensor(metrics["actor/loss"]))
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj",
                 "model.layers.2.mlp.experts.down_proj", "model.layers.1.mlp.up_proj.weight"):
        assert not torch.equal(before[name], after[name]), name
    # the synced weights load into the engine (fused expert names) and reproduce the trainer
    engine = NativeEngine(path, max_model_len=64, tokenizer=False)
    engine.update_weights(after, version=1)
    batch = sampled_batch(engine, n=1)
    assert (trainer.logprobs(batch).values - batch.rollout_logprobs.values).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_fsdp2_two_ranks_equal_ddp_one(moe_dirs, tmp_path):
    path = moe_dirs["qwen3_moe"]
    one = engine_ranks.train(0, 1, path, "ddp")
    two = run_world_ok(engine_ranks.train, 2, tmp_path, args=(path, "fsdp2"), timeout_s=240)
    for a, b in zip(one["metrics"], two[0]["metrics"]):
        for key in ("actor/loss", "actor/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    for name, w in one["weights"].items():
        torch.testing.assert_close(two[0]["weights"][name], w, rtol=1e-4, atol=1e-5)


def test_export_of_a_trained_moe_checkpoint_loads_back_with_equal_logprobs(moe_dirs, tmp_path):
    """`polyrl export` of an MoE policy's checkpoint: transformers loads it back (experts as saved
    per expert on disk, fused in memory) with the trained weights, so log-probs are equal, and
    the native engine serves it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polyrl.cli.main import main

    path = moe_dirs["qwen2_moe"]
    trainer, actor = engine_ranks.build(path, engine_ranks.actor_config("ddp", ppo_epochs=1), 0, 1)
    actor.update(engine_ranks.make_batch(seed=2, n=4), 1, False)
    ckpt = tmp_path / "step_000001"
    ckpt.mkdir()
    trainer.save(ckpt)
    AutoTokenizer.from_pretrained(path).save_pretrained(str(ckpt / "policy"))
    out = tmp_path / "exported"
    assert main(["export", str(ckpt), "--output", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    params = dict(model.named_parameters())
    trained = engine_ranks.full_weights(trainer)
    assert all(torch.equal(params[k], v) for k, v in trained.items())
    batch = sampled_batch(NativeEngine(str(out), max_model_len=64, tokenizer=False), n=1)
    assert (trainer.logprobs(batch).values - batch.rollout_logprobs.values).abs().max().item() <= 1e-5


def test_lora_on_an_moe_policy_syncs_merged_weights_to_the_engine(moe_dirs):
    """LoRA (all-linear) on a Qwen3-MoE: adapters on the attention projections and, through peft's
    ParamWrapper, on the fused experts (docs/moe.md); the merged weights (expert deltas folded in)
    load into the engine, whose log-probs then equal the adapted policy's."""
    from polyrl.training.lora import apply_lora, merged_named_weights
    from polyrl.training.lora_config import LoraConfig
    from polyrl.training.model_loading import load_causal_lm

    path = moe_dirs["qwen3_moe"]
    model = apply_lora(load_causal_lm(path), LoraConfig(lora_rank=4))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("self_attn.q_proj.lora_A" in n for n in trainable)
    assert any("mlp.experts.lora_A" in n for n in trainable)  # the experts' adapters
    assert not any("mlp.gate." in n for n in trainable)  # the router is not a linear layer
    with torch.no_grad():  # a non-trivial adapter
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    merged = dict(merged_named_weights(model))
    base_weights = dict(load_causal_lm(path).named_parameters())
    assert set(merged) == set(base_weights)  # Hugging Face names, experts fused
    assert not torch.equal(merged["model.layers.0.mlp.experts.gate_up_proj"],
                           base_weights["model.layers.0.mlp.experts.gate_up_proj"])
    engine = NativeEngine(path, max_model_len=64, tokenizer=False)
    engine.update_weights(merged, version=1)
    batch = sampled_batch(engine, n=1)
    base = model.get_base_model().eval()
    with torch.no_grad():
        for i in range(len(batch)):
            ids = torch.cat([batch.prompt_ids.row(i), batch.response_ids.row(i)])[None]
            logp = torch.log_softmax(base(ids).logits[0].float(), -1)
            p = len(batch.prompt_ids.row(i))
            ref = logp[p - 1:-1].gather(1, batch.response_ids.row(i)[:, None]).squeeze(1)
            assert (ref - batch.rollout_logprobs.row(i)).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_fsdp2_lora_on_experts_merges_as_ddp(moe_dirs, tmp_path):
    """FSDP2 gathers the experts' LoRA factors (peft's ParamWrapper) and folds them in as DDP does."""
    from moe_models import lora_merged_after_update
    from polyrl.training.model_loading import load_causal_lm

    path = moe_dirs["qwen3_moe"]
    one = lora_merged_after_update(0, 1, path, "ddp")
    two = run_world_ok(lora_merged_after_update, 2, tmp_path, args=(path, "fsdp2"), timeout_s=240)[0]
    assert set(one) == set(two)
    for name, w in one.items():
        torch.testing.assert_close(two[name], w, rtol=1e-4, atol=1e-5)
    base = dict(load_causal_lm(path).named_parameters())
    assert not torch.equal(one["model.layers.0.mlp.experts.down_proj"], base["model.layers.0.mlp.experts.down_proj"])



def test_a_critic_on_an_moe_trunk_trains(moe_dirs):
    """PPO's critic (a value head on the policy's trunk, training/values.py) on a Qwen3-MoE: three
    updates through the engine seam, finite losses and gradients."""
    metrics = engine_ranks.critic_updates(0, 1, moe_dirs["qwen3_moe"], "ddp")
    assert len(metrics) == 3
    for m in metrics:
        assert torch.isfinite(torch.tensor([m["critic/value_loss"], m["critic/grad_norm"]])).all()
        assert m["critic/grad_norm"] > 0
