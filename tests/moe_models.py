"""Tiny random mixture-of-experts checkpoints (Qwen3-MoE, Qwen2-MoE) built from a config with
transformers and saved to a temp dir (no downloads), with the char-level tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

MOE_ARCHS = ("qwen3_moe", "qwen2_moe")


def moe_config(arch: str, *, layers: int = 3, hidden: int = 32, experts: int = 6, top_k: int = 2):
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=16,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, num_experts=experts,
        num_experts_per_tok=top_k, max_position_embeddings=256, eos_token_id=1, pad_token_id=0,
        initializer_range=0.2, tie_word_embeddings=False,
        mlp_only_layers=[1] if layers > 2 else [],  # one dense layer between expert layers
    )
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, head_dim=8, norm_topk_prob=True)
    return Qwen2MoeConfig(**common, shared_expert_intermediate_size=24)


def build_moe_model(path: Path, arch: str = "qwen3_moe", seed: int = 0, **shape) -> str:
    from transformers import AutoModelForCausalLM

    from tiny_models import char_tokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(arch, **shape))
    with torch.no_grad():  # non-trivial norms so every weight path is exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(str(path))
    char_tokenizer().save_pretrained(str(path))
    return str(path)


def lora_merged_after_update(rank: int, world_size: int, model_path: str, strategy: str) -> dict:
    """One rank of a LoRA (rank 4, all-linear: attention and the fused experts) policy update on
    `model_path` with `strategy`: the merged weights the engines are synced (Hugging Face names)."""
    import torch.distributed as dist

    import engine_ranks
    from polyrl.algorithms import AlgorithmConfig
    from polyrl.algorithms.off_policy import OffPolicyConfig
    from polyrl.batch import shard
    from polyrl.platform import get_platform
    from polyrl.training import build_engine
    from polyrl.training.lora import LoraConfig, apply_lora
    from polyrl.training.model_loading import load_causal_lm
    from polyrl.workers.actor import PPOActor

    platform = get_platform("cpu")
    device = platform.torch_device(0)
    cfg = engine_ranks.actor_config(strategy, ppo_epochs=1)
    torch.manual_seed(0)  # LoRA's A starts random: the same on every rank
    model = apply_lora(load_causal_lm(model_path), LoraConfig(lora_rank=4))
    engine = build_engine(model, cfg, platform, device, rank=rank, world_size=world_size,
                          group=dist.group.WORLD if dist.is_initialized() else None, horizon=4)
    actor = PPOActor(engine, cfg, AlgorithmConfig(), OffPolicyConfig().resolve(on_policy=True), device)
    actor.update(shard(engine_ranks.make_batch(3, 6), world_size)[rank], 1, False)
    return engine_ranks.full_weights(engine)
