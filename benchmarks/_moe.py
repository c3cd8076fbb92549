"""Mixture-of-experts cells of `polyrl bench rollout --moe` and `polyrl bench grpo --moe` (issue
#44, docs/moe.md "Speed"): a random Qwen3-MoE of ~32M total / ~7.5M active parameters, and two
dense Qwen3 models of the same attention, vocabulary and depth for the comparison:

    moe          16 experts of 256, top-2 (renormalised), 6 layers, hidden 384
    dense-active the MLP of the experts one token uses (2 x 256 = 512): the same active parameters
    dense-total  the MLP of all 16 experts (16 x 256 = 4096): the same total parameters, i.e. the
                 same weight bytes a decode step reads once every expert receives a token

At 64 sequences x top-2 every one of the 16 experts receives ~8 tokens per decode step, so the
MoE's step reads all its expert weights, as `dense-total` does, but does a quarter of its
arithmetic; `dense-active` does the same arithmetic and reads a quarter of the bytes. A decode
step on a CPU is bound by the bytes it reads, so the MoE lands between the two.
"""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=4096, hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
              num_key_value_heads=2, head_dim=64)
MOE_MODELS = {
    "moe": dict(model_type="qwen3_moe", **COMMON, intermediate_size=512, moe_intermediate_size=256,
                num_experts=16, num_experts_per_tok=2, norm_topk_prob=True),
    "dense-active": dict(model_type="qwen3", **COMMON, intermediate_size=512),
    "dense-total": dict(model_type="qwen3", **COMMON, intermediate_size=4096),
}


def build(name: str, path: Path, eos_id: int = 0, pad_id: int = 0) -> tuple[int, int]:
    """Write MOE_MODELS[name] (random, tied embeddings) to `path`; (total, active) parameters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from polyrl.training.memory_plan import Shape

    shape = dict(MOE_MODELS[name])
    torch.manual_seed(0)
    config = AutoConfig.for_model(shape.pop("model_type"), **shape, tie_word_embeddings=True,
                                  max_position_embeddings=1024, eos_token_id=eos_id, pad_token_id=pad_id,
                                  bos_token_id=None)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(path))
    total = model.num_parameters()
    s = Shape.from_config({**MOE_MODELS[name], "tie_word_embeddings": True})
    return total, s.active_params if s.experts else total
