"""Build polyrl's bundled tiny mixture-of-experts model, ``builtin:tiny-moe`` (docs/moe.md).

Exact command (from the repository root)::

    python scripts/build_tiny_moe_model.py

It writes ``polyrl/assets/tiny-moe/``: a ``Qwen3MoeForCausalLM`` of about 0.3M parameters (3
decoder layers, each a mixture-of-experts block of 8 experts, top-2, no shared expert; tied
embeddings; trained in fp32, stored rounded to bf16, 0.7 MB, to stay inside the bundled assets'
size budget, tests/assets/test_tiny_assets.py: the trainer and the engine load it as fp32), the char-level tokenizer and generation config of ``tiny-arith``,
and ``warm_start.json`` (the arguments it was built with).

Warm-started exactly like ``tiny-arith`` (scripts/build_tiny_model.py, whose tokenizer, problem
split, teachers and SFT phases it reuses): correct answers from a random initialisation, then the
noisy teacher that usually forgets the carry, so that GRPO has an easy shared direction to push on
the bundled arithmetic data (``builtin:arithmetic_train`` / ``arithmetic_val``, which this script
does not rewrite). Deterministic for a given seed and thread count. Use ``--out-dir`` to build
somewhere else.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import build_tiny_model as dense  # noqa: E402  (the tokenizer, data split, teachers, SFT phases)
import torch  # noqa: E402

from polyrl.data.synthetic import split_problems, write_parquet  # noqa: E402


def build_model(vocab_size: int, args):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.expert_intermediate,
        moe_intermediate_size=args.expert_intermediate, num_experts=args.experts,
        num_experts_per_tok=args.top_k, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=args.hidden // 4, max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=dense.SPECIAL_TOKENS.index(dense.EOS),
        pad_token_id=dense.SPECIAL_TOKENS.index(dense.PAD), initializer_range=0.02, use_cache=True,
        router_aux_loss_coef=0.0, output_router_logits=False,
    )
    cfg.dtype = torch.float32
    return Qwen3MoeForCausalLM(cfg)


def store_bf16(src: Path, dst: Path) -> None:
    from safetensors.torch import load_file, save_file

    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(src)).items()}, str(dst), metadata={"format": "pt"})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=str(dense.REPO / "polyrl" / "assets"), help="assets root")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-train", type=int, default=4000, help="the problem split of build_tiny_model.py")
    ap.add_argument("--n-val", type=int, default=500)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-intermediate", type=int, default=64)
    ap.add_argument("--clean-steps", type=int, default=1000)
    ap.add_argument("--clean-lr", type=float, default=3e-3)
    ap.add_argument("--noisy-steps", type=int, default=300)
    ap.add_argument("--noisy-lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--p-forget", type=float, default=0.8)
    ap.add_argument("--p-slip", type=float, default=0.05)
    ap.add_argument("--p-runon", type=float, default=0.10)
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    model_dir = Path(args.out_dir) / "tiny-moe"
    tokenizer = dense.build_tokenizer()
    train, val, rest = split_problems(args.n_train, args.n_val, seed=args.seed)
    model = build_model(len(tokenizer), args)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.3f}M params", flush=True)
    with tempfile.TemporaryDirectory(prefix="tiny-moe-") as tmp:
        work = Path(tmp)
        model.save_pretrained(work / "init", safe_serialization=True)
        dense.save_tokenizer(tokenizer, work / "init")
        val_chat = write_parquet(dense.chat_rows(val, dense.Teacher(), random.Random(args.seed)),
                                 work / "val_chat.parquet")
        sft_problems = train + rest  # never the held-out problems
        clean_file = write_parquet(dense.chat_rows(sft_problems, dense.Teacher(), random.Random(args.seed + 1)),
                                   work / "clean.parquet")
        policy = dense.sft_phase(work / "init", clean_file, val_chat, work / "clean", args.clean_steps,
                                 args.clean_lr, args.batch, args.seed + 1, "clean")
        noisy = dense.Teacher(p_forget=args.p_forget, p_slip=args.p_slip, p_runon=args.p_runon)
        per_problem = -(-args.noisy_steps * args.batch // len(sft_problems))
        noisy_file = write_parquet(dense.chat_rows(sft_problems, noisy, random.Random(args.seed + 2), per_problem),
                                   work / "noisy.parquet")
        policy = dense.sft_phase(policy, noisy_file, val_chat, work / "noisy", args.noisy_steps,
                                 args.noisy_lr, args.batch, args.seed + 2, "noisy")
        model_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(policy / "config.json", model_dir / "config.json")
        store_bf16(policy / "model.safetensors", model_dir / "model.safetensors")
    from transformers import GenerationConfig

    dense.save_tokenizer(tokenizer, model_dir)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True,
                     temperature=1.0, top_k=0, top_p=1.0,
                     max_new_tokens=dense.MAX_RESPONSE_TOKENS).save_pretrained(model_dir)
    recipe = {k: v for k, v in vars(args).items() if k != "out_dir"}
    (model_dir / "warm_start.json").write_text(json.dumps(recipe, indent=2, sort_keys=True) + "\n")
    print(f"wrote {model_dir}")


if __name__ == "__main__":
    main()
