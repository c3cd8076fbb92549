"""Build the bundled tiny vision-language model ``builtin:tiny-vl`` and the shapes task's data.

Exact command (from the repository root; one torch thread, no downloads)::

    python scripts/build_tiny_vl_model.py

It writes, deterministically for a given seed and thread count:

* ``polyrl/assets/tiny-vl/``: tiny-arith's byte-level tokenizer (scripts/build_tiny_model.py)
  plus Qwen2-VL's four vision special tokens, a chat template that renders image content parts
  as ``<|vision_start|><|image_pad|><|vision_end|>``, the slow (PIL) Qwen2-VL image processor
  config pinned to 56x56 images (4x4 patches of 14 -> 4 merged image tokens), and a
  ``Qwen2VLForConditionalGeneration`` of about 1M parameters (fp32 safetensors) warm-started
  with ``polyrl.sft`` (the library API of ``polyrl sft``) on image chats;
* ``polyrl/assets/data/shapes_{train,val}.parquet``: the RL prompts of the shapes task
  (polyrl/data/shapes.py), held-out scenes disjoint from the training ones.

The warm start is two SFT runs on generated image chats (scenes disjoint from the held-out ones):

1. right answers, from a random initialisation: the vision tower and the language model learn to
   read the four cells (counts and colours);
2. a *noisy teacher*, as tiny-arith's (docs/embedded_default.md): on three or four shapes it
   usually misses one (says 2 for 3), and it usually swaps green / blue and red / yellow. The
   imitation policy keeps reading the image but its most likely answer is the teacher's habit
   wherever the habit applies, so greedy held-out accuracy starts low while the right answer keeps
   a real share of the samples: the verifiable reward has one shared direction to push.

Re-runnable: every output is overwritten. ``--out-dir`` builds somewhere else (experiments).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import torch  # noqa: E402

from build_tiny_model import EOS, PAD, SPECIAL_TOKENS, UNK  # noqa: E402
from build_tiny_model import build_tokenizer as build_byte_tokenizer  # noqa: E402

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = VISION_TOKENS
MAX_POSITIONS = 128
MAX_ANSWER_TOKENS = 8  # "yellow" + EOS = 7; a run-on fills all 8 without EOS
# tiny-arith's template (user text verbatim, an assistant turn + EOS, no generation prompt) with
# content parts: an image part is the placeholder triple the processor expands.
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}{{ render(message['content']) + eos_token }}"
    "{%- else -%}{{ render(message['content']) }}{%- endif -%}"
    "{%- endfor -%}"
)
IMAGE_SIDE = 56
CONFUSED_COLOURS = {"green": "blue", "blue": "green", "red": "yellow", "yellow": "red"}


# ----------------------------------------------------------------------------- tokenizer, processor
def build_tokenizer():
    tok = build_byte_tokenizer(CHAT_TEMPLATE, MAX_POSITIONS)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    return tok


def save_tokenizer(tokenizer, model_dir: Path) -> None:
    tokenizer.save_pretrained(model_dir)
    # pinned like tiny-arith's: transformers 4 and 5 load the same fast tokenizer and template
    path = model_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE, eos_token=EOS,
               pad_token=PAD, unk_token=UNK, bos_token=None, add_bos_token=False, add_eos_token=False,
               padding_side="left")
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def build_image_processor():
    """The slow (PIL / numpy) Qwen2-VL image processor: no torchvision is needed to run it.
    min = max pixels = 56*56: every image becomes 4x4 patches, 4 tokens after the 2x2 merge."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pixels = IMAGE_SIDE * IMAGE_SIDE
    return Qwen2VLImageProcessorPil(size={"shortest_edge": pixels, "longest_edge": pixels},
                                    patch_size=14, temporal_patch_size=2, merge_size=2)


# ----------------------------------------------------------------------------- model
def build_model(tokenizer, args):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    heads = 4
    half = args.hidden // heads // 2
    mrope = [half - 2 * (half // 3), half // 3, half // 3]  # (temporal, height, width) of each head's rotary half
    cfg = Qwen2VLConfig(
        text_config=dict(hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=2,
                         vocab_size=len(tokenizer), max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6,
                         bos_token_id=None, eos_token_id=SPECIAL_TOKENS.index(EOS),
                         pad_token_id=SPECIAL_TOKENS.index(PAD), initializer_range=0.02, use_cache=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope}),
        vision_config=dict(depth=args.vision_depth, embed_dim=args.vision_dim, hidden_size=args.hidden,
                           num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                           in_channels=3),
        image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
    )
    cfg.dtype = torch.float32
    return Qwen2VLForConditionalGeneration(cfg)


# ----------------------------------------------------------------------------- warm-start data
def noisy_answer(example, rng: random.Random, p_miss: float, p_swap: float) -> str:
    """The noisy teacher's answer: misses a shape among 3-4, swaps confusable colours."""
    if example.question_type == "count":
        k = int(example.answer)
        return str(k - 1) if k >= 3 and rng.random() < p_miss else example.answer
    return CONFUSED_COLOURS[example.answer] if rng.random() < p_swap else example.answer


def write_chats(path: Path, examples, rng: random.Random | None = None, p_miss: float = 0.0,
                p_swap: float = 0.0) -> Path:
    from polyrl.data.shapes import make_chat, write_parquet

    rows = [make_chat(e, noisy_answer(e, rng, p_miss, p_swap) if rng else None) for e in examples]
    return write_parquet(rows, path)


def sft_phase(model_dir: Path, train_file: Path, val_file: Path, out: Path, steps: int, lr: float,
              args, tag: str) -> Path:
    """One polyrl.sft run (the library API `polyrl sft` runs); returns the policy directory."""
    from polyrl.config import load_config
    from polyrl.sft.config import SFTConfig
    from polyrl.sft.trainer import SFTTrainer

    cfg = load_config(SFTConfig, overrides=[
        f"model.path={model_dir}", f"data.train_files=[{train_file}]", f"data.val_files=[{val_file}]",
        f"data.max_length={MAX_POSITIONS}", "data.on_bad_row=error", "data.truncation=error",
        f"data.train_batch_size={args.batch}", f"data.seed={args.seed}", f"trainer.seed={args.seed}",
        f"trainer.total_steps={steps}", f"trainer.val_every={max(steps // 4, 1)}", f"trainer.output_dir={out}",
        "trainer.resume=off", "trainer.keep_last=1", "trainer.progress_bar=false", "logging.plot_at_end=false",
        f"actor.lr={lr}", f"actor.warmup_steps={min(50, steps // 10 + 1)}", "actor.min_lr_ratio=0.0",
        "actor.micro_batch_tokens=8192", "model.train_vision_tower=true",
    ])
    t0 = time.time()
    summary = SFTTrainer(cfg).fit()
    print(f"{tag}: {steps} SFT steps of {args.batch} image chats in {time.time() - t0:.0f}s; held-out chats: "
          f"loss {summary['initial_val_loss']:.4f} -> {summary['final_val_loss']:.4f}, token accuracy "
          f"{summary['final_val_token_acc']:.3f}", flush=True)
    return Path(summary["policy_dir"])


# ----------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(model_dir: Path, val_file: Path, n: int, temperature: float, seed: int = 0) -> dict[str, float]:
    """Held-out accuracy of `model_dir` on the RL prompts (the shapes reward, EOS required), one
    answer per prompt with transformers' generate, through polyrl's own data path."""
    from transformers import AutoModelForImageTextToText

    from polyrl.data import DataConfig, load_dataset
    from polyrl.data.multimodal import mm_token_type_ids
    from polyrl.rewards.shapes import shapes_score
    from polyrl.training.model_loading import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    prompts = load_dataset([str(val_file)], tokenizer, DataConfig(max_samples=n, max_prompt_length=MAX_POSITIONS),
                           split="val", model_dir=str(model_dir))
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir)).eval()
    torch.manual_seed(seed)
    hits = {"count": [], "colour": []}
    for p in prompts:
        ids = torch.tensor([p.prompt_ids])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             pixel_values=p.images.pixel_values, image_grid_thw=p.images.image_grid_thw,
                             mm_token_type_ids=mm_token_type_ids(ids, model.config.image_token_id),
                             max_new_tokens=MAX_ANSWER_TOKENS, do_sample=temperature > 0,
                             temperature=temperature if temperature > 0 else None, top_k=0, top_p=1.0,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        answer = out[0, ids.shape[1]:].tolist()
        eos = tokenizer.eos_token_id in answer
        text = tokenizer.decode(answer[: answer.index(tokenizer.eos_token_id)] if eos else answer,
                                skip_special_tokens=True)
        hits[p.extra_info["question"]].append(shapes_score(text, p.ground_truth, finished_with_eos=eos))
    every = hits["count"] + hits["colour"]
    return {"accuracy": sum(every) / len(every),
            **{f"{k}_accuracy": sum(v) / max(len(v), 1) for k, v in hits.items()}}


# ----------------------------------------------------------------------------- main
def build(args) -> None:
    from transformers import GenerationConfig

    from polyrl.data.shapes import split_examples, write_shapes_dataset

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out_dir)
    model_dir, data_dir = out / "tiny-vl", out / "data"
    tokenizer = build_tokenizer()
    rl = write_shapes_dataset(data_dir, args.n_train, args.n_val, seed=args.seed)
    # warm-start chats: fresh scenes, never a held-out one (same seed, same held-out split)
    n_clean, n_noisy = args.clean_steps * args.batch, args.noisy_steps * args.batch
    _, val, extra = split_examples(0, args.n_val, seed=args.seed, n_extra=n_clean + n_noisy)
    with tempfile.TemporaryDirectory(prefix="tiny-vl-") as tmp:
        work = Path(tmp)
        clean = write_chats(work / "clean.parquet", extra[:n_clean])
        noisy = write_chats(work / "noisy.parquet", extra[n_clean:], random.Random(args.seed), args.p_miss,
                            args.p_swap)
        val_chats = write_chats(work / "val_chats.parquet", val[:256])  # scored only, never trained on
        model = build_model(tokenizer, args)
        print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.3f}M params "
              f"(vision {sum(p.numel() for p in model.model.visual.parameters()) / 1e6:.3f}M), "
              f"vocab {len(tokenizer)}", flush=True)
        init = work / "init"
        model.save_pretrained(init, safe_serialization=True)
        save_tokenizer(tokenizer, init)
        build_image_processor().save_pretrained(init)
        policy = sft_phase(init, clean, val_chats, work / "sft_clean", args.clean_steps, args.clean_lr, args,
                           "phase 1 (right answers)")
        if args.eval:  # how well the model reads the images before the noisy teacher
            stats = evaluate(policy, rl["val"], args.eval, 0.0, seed=args.seed)
            print(f"after phase 1, held-out (T=0, {args.eval} prompts): " +
                  ", ".join(f"{k} {v:.1%}" for k, v in stats.items()), flush=True)
        if args.noisy_steps:
            policy = sft_phase(policy, noisy, val_chats, work / "sft_noisy", args.noisy_steps, args.noisy_lr,
                               args, f"phase 2 (noisy teacher: miss {args.p_miss:.0%}, swap {args.p_swap:.0%})")
        if model_dir.exists():
            shutil.rmtree(model_dir)
        model_dir.mkdir(parents=True)
        for name in ("config.json", "model.safetensors"):
            shutil.copyfile(policy / name, model_dir / name)
    save_tokenizer(tokenizer, model_dir)
    build_image_processor().save_pretrained(model_dir)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True,
                     temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=MAX_ANSWER_TOKENS).save_pretrained(model_dir)
    recipe = {k: v for k, v in vars(args).items() if k not in ("out_dir", "eval")}
    (model_dir / "warm_start.json").write_text(json.dumps(recipe, indent=2, sort_keys=True) + "\n")
    print(f"wrote {model_dir} and {rl['train']}, {rl['val']}", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=str(REPO / "polyrl" / "assets"), help="assets root")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (fixed for reproducibility)")
    ap.add_argument("--n-train", type=int, default=1000, help="RL training prompts")
    ap.add_argument("--n-val", type=int, default=200, help="held-out prompts")
    ap.add_argument("--hidden", type=int, default=96)
    ap.add_argument("--intermediate", type=int, default=192)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vision-depth", type=int, default=2)
    ap.add_argument("--vision-dim", type=int, default=48)
    ap.add_argument("--batch", type=int, default=64, help="SFT conversations per step")
    ap.add_argument("--clean-steps", type=int, default=300, help="phase 1: SFT steps on right answers")
    ap.add_argument("--clean-lr", type=float, default=3e-3)
    ap.add_argument("--noisy-steps", type=int, default=120, help="phase 2: SFT steps on the noisy teacher")
    ap.add_argument("--noisy-lr", type=float, default=1e-3)
    ap.add_argument("--p-miss", type=float, default=0.8, help="noisy teacher: P(count one short on 3-4 shapes)")
    ap.add_argument("--p-swap", type=float, default=0.8, help="noisy teacher: P(swap a confusable colour)")
    ap.add_argument("--eval", type=int, default=200, help="evaluate on this many held-out prompts (0: skip)")
    args = ap.parse_args(argv)
    build(args)
    if args.eval:
        model_dir, val = Path(args.out_dir) / "tiny-vl", Path(args.out_dir) / "data" / "shapes_val.parquet"
        for temperature in (0.0, 1.0):
            stats = evaluate(model_dir, val, args.eval, temperature, seed=args.seed)
            print(f"held-out (T={temperature:g}, {args.eval} prompts): " +
                  ", ".join(f"{k} {v:.1%}" for k, v in stats.items()), flush=True)


if __name__ == "__main__":
    main()
