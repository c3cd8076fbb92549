"""Decode speed of a mixture-of-experts model in the native engine (docs/moe.md, "Speed"): a
random Qwen3-MoE of ~26M total / ~10M active parameters against transformers `generate` on the
same model, and against a dense Qwen3 with the same active parameters in the native engine.

    python scripts/moe_speed.py [--prompts 16] [--tokens 64]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch


def configs():
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False)
    moe = Qwen3MoeConfig(**common, intermediate_size=768, moe_intermediate_size=384, num_experts=8,
                         num_experts_per_tok=2, norm_topk_prob=True)
    dense = Qwen3Config(**common, intermediate_size=768)  # the MoE's active MLP width (2 x 384)
    return moe, dense


def main() -> None:
    from transformers import AutoModelForCausalLM

    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native.engine import NativeEngine

    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(0)
    prompts = [torch.randint(2, 4096, (16,)).tolist() for _ in range(args.prompts)]
    sampling = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    total = args.prompts * args.tokens
    for name, cfg in zip(("moe", "dense"), configs()):
        model = AutoModelForCausalLM.from_config(cfg).eval()
        params = sum(p.numel() for p in model.parameters())
        with tempfile.TemporaryDirectory() as d:
            model.save_pretrained(d)
            engine = NativeEngine(d, tokenizer=False, max_model_len=256)
            engine.generate_batch(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            t0 = time.perf_counter()
            engine.generate_batch(prompts, sampling)
            native = total / (time.perf_counter() - t0)
        line = f"{name}: {params / 1e6:.1f}M params, native engine {native:.0f} tok/s"
        if name == "moe":
            ids = torch.tensor(prompts)
            with torch.no_grad():
                model.generate(ids[:2], max_new_tokens=4, do_sample=False)
                t0 = time.perf_counter()
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                               do_sample=False, pad_token_id=0)
                hf = total / (time.perf_counter() - t0)
            line += f", transformers generate {hf:.0f} tok/s ({native / hf:.2f}x)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
