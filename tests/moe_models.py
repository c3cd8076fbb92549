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
