"""Build the bundled tiny tool-calling model ``builtin:tiny-calc`` and the calculator task's data.

Exact command (from the repository root; one torch thread, no downloads; 950 SFT steps of 64
conversations, 9 minutes wall / 4.3 minutes CPU measured on a heavily shared 2-core machine)::

    python scripts/build_tiny_tools_model.py

It writes, deterministically for a given seed and thread count:

* ``polyrl/assets/tiny-calc/``: a byte-level tokenizer with the tool tags and the calculator
  call's fixed JSON as added tokens, a chat template that renders tool calls and tool results, a
  small ``Qwen2ForCausalLM`` (256 positions, fp32 safetensors) warm-started with ``polyrl.sft``,
  and ``generation_config.json``;
* ``polyrl/assets/data/calculator_{train,val}.parquet``: the RL prompts (3-4 digit products,
  ``python -m polyrl.agents.calculator``), disjoint operand pairs.

Why the tokenizer has added tokens. A Hermes call
``<tool_call>\\n{"name": "calculator", "arguments": {"expression": "1234*567"}}\\n</tool_call>``
is ~80 bytes; one token per byte would make every call 80 sampled tokens. Here the tags and the
call's constant JSON (``{"name": "calculator", "arguments": {"expression": "`` and ``"}}``) are
one token each - the way BPE merges frequent strings - so a call is at most 15 tokens and the text
is still exactly what polyrl's Hermes parser reads. They are *non-special* added tokens, so
decoding keeps them (the parser reads the decoded turn) and engines that read ``tokenizer.json``
get the same ids.

The warm start (``docs/tools_calculator.md``) is two ``polyrl.sft`` runs (the library API of
``polyrl sft``) on ``calculator_sft.jsonl`` conversations written by ``polyrl.agents.calculator``:

1. every conversation calls the tool and answers with its result (800 steps of 64): the model
   learns the call format and to copy the operands and the result;
2. ``--p-direct 0.9``: nine in ten conversations answer *from memory* instead (the product's
   leading digits, the rest wrong; 150 steps of 64).

The model can use the tool but usually does not: sampled, it calls on ~10% of held-out problems
(and is then almost always right); greedy, it never calls on them. Held-out accuracy starts
low, and the verifiable reward has one shared direction to push (call the calculator), which GRPO
finds in a few dozen steps. The habit is the common failure of tool-using LLMs: answering
from memory instead of calling the tool they know.

Re-runnable: every output is overwritten. ``--out-dir`` builds somewhere else (experiments,
the reproducibility test).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import torch  # noqa: E402

from build_tiny_model import EOS, PAD, SPECIAL_TOKENS, UNK  # noqa: E402,F401
from build_tiny_model import build_tokenizer as build_byte_tokenizer  # noqa: E402

CALL_PREFIX, CALL_SUFFIX = '{"name": "calculator", "arguments": {"expression": "', '"}}'
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", CALL_PREFIX, CALL_SUFFIX]
MAX_POSITIONS = 256
# User text verbatim, an assistant turn as its content (or its OpenAI-style `tool_calls` in the
# Hermes format) + EOS, a tool result inside <tool_response> tags; the generation prompt adds
# nothing. So a trajectory reads `1234*567=<tool_call>...</tool_call><eos><tool_response>699678
# </tool_response>699678<eos>`. Tool schemas are not rendered: the model knows its one tool from
# the warm start (agent.tools_in_prompt=false).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ message['content'] or '' }}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{%- if not loop.first or message['content'] -%}{{ '\\n' }}{%- endif -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- set args = fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) -%}"
    "{{ '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' + args + '}\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{ eos_token }}"
    "{%- elif message['role'] == 'tool' -%}{{ '<tool_response>' + message['content'] + '</tool_response>' }}"
    "{%- else -%}{{ message['content'] }}{%- endif -%}"
    "{%- endfor -%}"
)
MAX_TURN_TOKENS = 16  # the longest turn: <tool_call> \n PREFIX 9999*9999 SUFFIX \n </tool_call> <eos> = 16


# ----------------------------------------------------------------------------- tokenizer
def build_tokenizer():
    """tiny-arith's byte-level BPE without merges (scripts/build_tiny_model.py), plus the tool tags
    and the call's constant JSON as non-special added tokens."""
    return build_byte_tokenizer(CHAT_TEMPLATE, MAX_POSITIONS, tuple(TOOL_TOKENS))


def save_tokenizer(tokenizer, model_dir: Path) -> None:
    tokenizer.save_pretrained(model_dir)
    # Pinned like tiny-arith's (transformers 4 reads the template from tokenizer_config.json, 5
    # from chat_template.jinja; both load a PreTrainedTokenizerFast over tokenizer.json).
    path = model_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE, eos_token=EOS,
               pad_token=PAD, unk_token=UNK, bos_token=None, add_bos_token=False, add_eos_token=False,
               padding_side="left")
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------- model
def build_model(vocab_size: int, args):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=MAX_POSITIONS, rope_theta=10000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=SPECIAL_TOKENS.index(EOS),
                      pad_token_id=SPECIAL_TOKENS.index(PAD), initializer_range=0.02, use_cache=True)
    cfg.dtype = torch.float32
    return Qwen2ForCausalLM(cfg)


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
        "actor.micro_batch_tokens=8192",
    ])
    t0 = time.time()
    summary = SFTTrainer(cfg).fit()
    print(f"{tag}: {steps} SFT steps of {args.batch} conversations in {time.time() - t0:.0f}s; held-out tool-call "
          f"traces: loss {summary['initial_val_loss']:.4f} -> {summary['final_val_loss']:.4f}, token accuracy "
          f"{summary['final_val_token_acc']:.3f}", flush=True)
    return Path(summary["policy_dir"])


# ----------------------------------------------------------------------------- evaluation
def evaluate(model_dir: Path, val_file: Path, n: int, temperature: float, seed: int = 0) -> dict[str, float]:
    """Held-out accuracy of `model_dir` with the calculator tool (the RL recipe's rollouts): one
    trajectory per problem through the native engine and polyrl's agent runner."""
    import pyarrow.parquet as pq

    from polyrl.agents import AgentConfig, run_trajectories_sync
    from polyrl.data.dataset import PromptSample
    from polyrl.rewards.arithmetic import arithmetic_score
    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native.engine import NativeEngine
    from polyrl.training.model_loading import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    rows = []
    for i, r in enumerate(pq.read_table(val_file).to_pylist()[:n]):
        text = tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        rows.append(PromptSample(i, r["data_source"], tokenizer(text, add_special_tokens=False)["input_ids"],
                                 text, r["prompt"], r["reward_model"]["ground_truth"], r["extra_info"]))
    cfg = AgentConfig(tools=["polyrl.agents.calculator:calculator"], tools_in_prompt=False, max_turns=2,
                      max_response_tokens=3 * MAX_TURN_TOKENS)
    engine = NativeEngine(model_dir, seed=seed)
    sampling = SamplingParams(n=1, temperature=temperature, top_p=1.0, top_k=-1, max_tokens=MAX_TURN_TOKENS,
                              seed=seed)
    out = run_trajectories_sync(engine, tokenizer, rows, sampling, cfg, seeds=[seed + i for i in range(len(rows))])
    b = out.batch
    acc = [arithmetic_score(t, row.ground_truth, finished_with_eos=bool(e))
           for t, row, e in zip(b.texts, rows, b.finished_with_eos.tolist())]
    calls = [s.tool_calls > 0 for s in out.stats]
    return {"accuracy": sum(acc) / len(acc), "call_rate": sum(calls) / len(calls),
            "accuracy_when_called": sum(a for a, c in zip(acc, calls) if c) / max(sum(calls), 1)}


# ----------------------------------------------------------------------------- main
def build(args) -> None:
    from transformers import GenerationConfig

    from polyrl.agents.calculator import trace, write_calculator_task
    from polyrl.data import read_rows

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out_dir)
    model_dir, data_dir = out / "tiny-calc", out / "data"
    tokenizer = build_tokenizer()
    with tempfile.TemporaryDirectory(prefix="tiny-calc-") as tmp:
        work = Path(tmp)
        # phase 1 traces always call the tool; phase 2's mostly answer from memory. Same seed: the
        # same RL splits, and SFT pairs disjoint from the held-out ones.
        task = write_calculator_task(work / "copy", args.n_train, args.n_val, args.copy_steps * args.batch,
                                     seed=args.seed)
        habit = write_calculator_task(work / "habit", args.n_train, args.n_val, args.habit_steps * args.batch,
                                      seed=args.seed, p_direct=args.p_direct)
        data_dir.mkdir(parents=True, exist_ok=True)
        for split in ("train", "val"):
            shutil.copyfile(task[split], data_dir / f"calculator_{split}.parquet")
        # SFT validation: tool-call traces of held-out pairs (scored only, never trained on)
        val_pairs = [r["prompt"][0]["content"][:-1].split("*") for r in read_rows(str(task["val"]))[:256]]
        val_traces = work / "val_traces.jsonl"
        val_traces.write_text("".join(json.dumps(trace(int(a), int(b))) + "\n" for a, b in val_pairs))
        model = build_model(len(tokenizer), args)
        print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.3f}M params, vocab {len(tokenizer)}",
              flush=True)
        model.save_pretrained(work / "init", safe_serialization=True)
        save_tokenizer(tokenizer, work / "init")
        reuse = args.phase1_dir and (Path(args.phase1_dir) / "model.safetensors").is_file()
        if reuse:  # experiments with phase 2 only
            policy = Path(args.phase1_dir)
        else:
            policy = sft_phase(work / "init", task["sft"], val_traces, work / "sft_copy", args.copy_steps,
                               args.copy_lr, args, "phase 1 (call the tool, copy its result)")
            if args.phase1_dir:
                shutil.copytree(policy, args.phase1_dir, dirs_exist_ok=True)
        policy = sft_phase(policy, habit["sft"], val_traces, work / "sft_habit", args.habit_steps,
                           args.habit_lr, args, f"phase 2 ({args.p_direct:.0%} answer from memory)")
        model_dir.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "model.safetensors"):
            shutil.copyfile(policy / name, model_dir / name)
    save_tokenizer(tokenizer, model_dir)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True,
                     temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=MAX_TURN_TOKENS).save_pretrained(model_dir)
    recipe = {k: v for k, v in vars(args).items() if k not in ("out_dir", "eval", "phase1_dir")}
    (model_dir / "warm_start.json").write_text(json.dumps(recipe, indent=2, sort_keys=True) + "\n")
    print(f"wrote {model_dir} and {data_dir}", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=str(REPO / "polyrl" / "assets"), help="assets root")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (fixed for reproducibility)")
    ap.add_argument("--n-train", type=int, default=2000, help="RL training prompts")
    ap.add_argument("--n-val", type=int, default=500, help="held-out prompts")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64, help="SFT conversations per step")
    ap.add_argument("--copy-steps", type=int, default=800, help="phase 1: SFT steps on traces that call the tool")
    ap.add_argument("--copy-lr", type=float, default=3e-3)
    ap.add_argument("--habit-steps", type=int, default=150, help="phase 2: SFT steps on the habit traces")
    ap.add_argument("--habit-lr", type=float, default=1e-3)
    ap.add_argument("--p-direct", type=float, default=0.9,
                    help="fraction of warm-start conversations that answer from memory instead of calling the tool")
    ap.add_argument("--phase1-dir", default=None,
                    help="experiments: save the phase-1 model here, or start phase 2 from it if it exists")
    ap.add_argument("--eval", type=int, default=500, help="evaluate on this many held-out problems (0: skip)")
    args = ap.parse_args(argv)
    build(args)
    if args.eval:
        model_dir, val = Path(args.out_dir) / "tiny-calc", Path(args.out_dir) / "data" / "calculator_val.parquet"
        for temperature in (0.0, 1.0):
            stats = evaluate(model_dir, val, args.eval, temperature, seed=args.seed)
            print(f"held-out (T={temperature:g}, {args.eval} problems): " +
                  ", ".join(f"{k} {v:.1%}" for k, v in stats.items()), flush=True)


if __name__ == "__main__":
    main()
