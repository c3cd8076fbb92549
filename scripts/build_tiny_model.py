"""Build polyrl's bundled tiny model, tokenizer and arithmetic data (the ``polyrl train`` default).

Exact command (from the repository root; 2300 SFT steps of 128 conversations, 15 minutes measured
on a heavily shared 2-core machine)::

    python scripts/build_tiny_model.py

It writes, deterministically for a given seed and thread count:

* ``polyrl/assets/tiny-arith/``: char-level tokenizer (``tokenizer.json``,
  ``tokenizer_config.json`` with a minimal chat template), a ~0.8M-parameter ``Qwen2ForCausalLM``
  (fp32 safetensors, tied embeddings) and ``generation_config.json``;
* ``polyrl/assets/data/arithmetic_{train,val}.parquet``: the RL train / held-out val problems;
* ``polyrl/assets/data/arithmetic_chat_{train,val}.parquet``: the same problems with their correct
  answers as chat conversations (verl's SFT ``messages`` schema), the ``polyrl sft`` defaults.

The model is warm-started with polyrl's own SFT trainer (``polyrl/sft``, ``docs/sft.md``) in two
phases, each on a chat file of teacher answers: correct answers from a random initialisation, then
a *noisy teacher* (see
``docs/embedded_default.md``): on problems that need a carry the teacher usually "forgets the
carry" (``37+48=`` -> ``75``), sometimes slips a digit, and sometimes runs on without stopping.
The imitation policy therefore always writes digits-then-EOS, is right on carry-free problems,
and spreads its mass between the right and the carry-forgetting answer elsewhere: about a third
of held-out problems are right, both sampled and greedy, and the verifiable reward has an easy,
shared direction to push (apply the carry), so GRPO raises held-out accuracy fast.

Re-runnable: every output is overwritten. Use ``--out-dir`` to build somewhere else (experiments).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from polyrl.data.synthetic import Problem, split_problems, make_rows, write_parquet  # noqa: E402

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
PAD, EOS, UNK = SPECIAL_TOKENS
# Qwen2's pre-tokenizer regex. transformers 5 always rebuilds a qwen2 checkpoint's tokenizer as
# ``Qwen2Tokenizer`` (NFC, this regex, byte-level BPE) from tokenizer.json's vocab and merges, so the
# tokenizer is built exactly that way: with *no merges* a byte-level BPE is a byte tokenizer, i.e.
# one token per printable ASCII character (digits, '+', '=', ...), and any other text still
# tokenizes (as UTF-8 bytes). transformers 4 (which loads tokenizer.json as-is) gives the same ids.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}{{ message['content'] + eos_token }}"
    "{%- else -%}{{ message['content'] }}{%- endif -%}"
    "{%- endfor -%}"
)
MAX_RESPONSE_TOKENS = 8  # answers are <= 3 digits + EOS; a run-on fills all 8 without EOS


# ----------------------------------------------------------------------------- tokenizer
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode char table (what the ByteLevel pre-tokenizer emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_tokenizer(chat_template: str = CHAT_TEMPLATE, max_length: int = 64, added_tokens: tuple[str, ...] = ()):
    """Byte-level BPE without merges (one token per byte), the special tokens first; `added_tokens`
    become non-special added tokens (scripts/build_tiny_tools_model.py: the tool tags)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    b2u = byte_to_unicode()
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for b in range(256):  # id = len(SPECIAL_TOKENS) + byte value
        vocab[b2u[b]] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], dropout=None, unk_token=None,
                               continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                               byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if added_tokens:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        chat_template=chat_template,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer, model_dir: Path) -> None:
    tokenizer.save_pretrained(model_dir)
    # Portable config: transformers 4 reads the chat template from tokenizer_config.json and has
    # no "TokenizersBackend" class; transformers 5 reads chat_template.jinja and maps qwen2 to
    # Qwen2Tokenizer either way. Pin everything explicitly so both load the same tokenizer.
    path = model_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(
        tokenizer_class="PreTrainedTokenizerFast",
        chat_template=CHAT_TEMPLATE,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        bos_token=None,
        add_bos_token=False,
        add_eos_token=False,
        padding_side="left",
    )
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------- noisy teacher
def carry_free(p: Problem) -> int:
    """The classic slip: every column on its own, carries (or borrows) forgotten."""
    a, b, out, place = p.a, p.b, 0, 1
    while a or b:
        da, db = a % 10, b % 10
        d = (da + db) % 10 if p.op == "+" else abs(da - db)
        out += d * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def digit_slip(ans: int, rng: random.Random) -> int:
    s = list(str(ans))
    i = rng.randrange(len(s))
    d = int(s[i]) + rng.choice((-1, 1))
    if d < 0 or d > 9 or (i == 0 and d == 0 and len(s) > 1):
        d = int(s[i]) - (d - int(s[i]))  # mirror into range
    s[i] = str(d)
    return int("".join(s))


@dataclass(frozen=True)
class Teacher:
    """Error rates of the (noisy) teacher; all zero is the clean teacher."""

    p_forget: float = 0.0  # P(forget the carry | the problem needs one)
    p_slip: float = 0.0  # P(one digit off by one)
    p_runon: float = 0.0  # P(stutter the answer and never emit EOS)


def teacher_target(p: Problem, rng: random.Random, args: Teacher) -> tuple[str, bool]:
    """Sample the teacher's response text and whether it ends with EOS."""
    truth = p.answer
    u = rng.random()
    if u < args.p_runon:  # run on: stutter the answer, never stop
        base = str(carry_free(p) if rng.random() < 0.5 else truth)
        return (base * MAX_RESPONSE_TOKENS)[:MAX_RESPONSE_TOKENS], False
    u -= args.p_runon
    if u < args.p_slip:
        return str(digit_slip(truth, rng)), True
    if carry_free(p) != truth and rng.random() < args.p_forget:
        return str(carry_free(p)), True
    return str(truth), True


# ----------------------------------------------------------------------------- model
def build_model(vocab_size: int, args):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        initializer_range=0.02,
        use_cache=True,
    )
    cfg.dtype = torch.float32
    return Qwen2ForCausalLM(cfg)


def chat_rows(problems: list[Problem], teacher: Teacher, rng: random.Random, per_problem: int = 1) -> list[dict]:
    """Teacher answers as chat conversations (verl's SFT `messages` schema). A run-on answer is
    8 digits: the template then ends it with EOS, which generation (max 8 new tokens) never reaches."""
    rows = []
    for p in problems:
        for _ in range(per_problem):
            text, _stop = teacher_target(p, rng, teacher)
            rows.append({"messages": [{"role": "user", "content": p.prompt},
                                      {"role": "assistant", "content": text}]})
    return rows


def sft_phase(model_path: Path, train_file: Path, val_file: Path, out: Path, steps: int, lr: float,
              batch: int, seed: int, tag: str) -> Path:
    """One warm-start phase through polyrl's own SFT trainer (polyrl/sft); returns the policy dir."""
    from polyrl.config import load_config
    from polyrl.sft.config import SFTConfig
    from polyrl.sft.trainer import SFTTrainer

    cfg = load_config(SFTConfig, overrides=[
        f"model.path={model_path}", f"data.train_files=[{train_file}]", f"data.val_files=[{val_file}]",
        f"data.train_batch_size={batch}", f"data.seed={seed}", f"trainer.seed={seed}",
        f"trainer.total_steps={steps}", f"trainer.val_every={max(steps // 4, 1)}",
        f"trainer.output_dir={out}", "trainer.resume=off", "trainer.keep_last=1",
        "trainer.progress_bar=false", "logging.plot_at_end=false",
        f"actor.lr={lr}", f"actor.warmup_steps={min(100, steps // 10 + 1)}", "actor.min_lr_ratio=0.0",
        "actor.micro_batch_tokens=8192",
    ])
    t0 = time.time()
    summary = SFTTrainer(cfg).fit()
    print(f"{tag}: held-out loss {summary['initial_val_loss']:.4f} -> {summary['final_val_loss']:.4f}, "
          f"token accuracy {summary['final_val_token_acc']:.3f} ({steps} steps, {time.time() - t0:.0f}s)",
          flush=True)
    return Path(summary["policy_dir"])


# ----------------------------------------------------------------------------- main
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=str(REPO / "polyrl" / "assets"), help="assets root")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (fixed for reproducibility; 1 is fastest for a model this small)")
    ap.add_argument("--n-train", type=int, default=4000)
    ap.add_argument("--n-val", type=int, default=500)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--clean-steps", type=int, default=2000, help="phase 1: SFT steps on correct answers")
    ap.add_argument("--clean-lr", type=float, default=3e-3)
    ap.add_argument("--noisy-steps", type=int, default=300, help="phase 2: SFT steps on the noisy teacher")
    ap.add_argument("--noisy-lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--save-clean", default=None, help="also save the phase-1 model here (experiments)")
    ap.add_argument("--p-forget", type=float, default=0.8, help="P(teacher forgets the carry | carry needed)")
    ap.add_argument("--p-slip", type=float, default=0.05, help="P(teacher slips one digit by +-1)")
    ap.add_argument("--p-runon", type=float, default=0.10, help="P(teacher runs on without EOS)")
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out_dir)
    model_dir, data_dir = out / "tiny-arith", out / "data"

    tokenizer = build_tokenizer()
    train, val, rest = split_problems(args.n_train, args.n_val, seed=args.seed)
    write_parquet(make_rows(train, "train"), data_dir / "arithmetic_train.parquet")
    write_parquet(make_rows(val, "val"), data_dir / "arithmetic_val.parquet")

    # the bundled SFT files (`polyrl sft` defaults): correct answers to the RL train / val problems
    write_parquet(chat_rows(train, Teacher(), random.Random(args.seed)), data_dir / "arithmetic_chat_train.parquet")
    val_chat = write_parquet(chat_rows(val, Teacher(), random.Random(args.seed)), data_dir / "arithmetic_chat_val.parquet")

    model = build_model(len(tokenizer), args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.3f}M params, vocab {len(tokenizer)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="tiny-arith-") as tmp:
        work = Path(tmp)
        model.save_pretrained(work / "init", safe_serialization=True)
        save_tokenizer(tokenizer, work / "init")
        # Warm start on every problem whose operand pair is not held out (train + rest), never val.
        sft_problems = train + rest
        clean_file = write_parquet(chat_rows(sft_problems, Teacher(), random.Random(args.seed + 1)),
                                   work / "clean.parquet")
        policy = sft_phase(work / "init", clean_file, val_chat, work / "clean", args.clean_steps,
                           args.clean_lr, args.batch, args.seed + 1, "clean")
        if args.save_clean:
            shutil.copytree(policy, args.save_clean, dirs_exist_ok=True)
        noisy = Teacher(p_forget=args.p_forget, p_slip=args.p_slip, p_runon=args.p_runon)
        # as many teacher samples as the noisy phase draws, fixed in a file (one epoch)
        per_problem = -(-args.noisy_steps * args.batch // len(sft_problems))
        noisy_file = write_parquet(chat_rows(sft_problems, noisy, random.Random(args.seed + 2), per_problem),
                                   work / "noisy.parquet")
        policy = sft_phase(policy, noisy_file, val_chat, work / "noisy", args.noisy_steps,
                           args.noisy_lr, args.batch, args.seed + 2, "noisy")
        model_dir.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "model.safetensors"):
            shutil.copyfile(policy / name, model_dir / name)

    from transformers import GenerationConfig

    save_tokenizer(tokenizer, model_dir)
    GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=MAX_RESPONSE_TOKENS,
    ).save_pretrained(model_dir)
    recipe = {k: v for k, v in vars(args).items() if k != "out_dir"}
    (model_dir / "warm_start.json").write_text(json.dumps(recipe, indent=2, sort_keys=True) + "\n")
    print(f"wrote {model_dir} and {data_dir}")


if __name__ == "__main__":
    main()
