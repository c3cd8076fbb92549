"""Padded against packed micro-batches (dense mask and per-sample attention), same run.

One training pass (forward + backward through `response_logprobs`, every micro-batch of the
batch) of a random-init Qwen2 model of `benchmarks/_tiny.py` (4M by default) over a GRPO batch,
for each length mix, token budget and compute dtype asked for:

* **padded** = `plan_micro_batches` + `collate` (sorted by length, padded to the longest of each
  micro-batch, `actor.micro_batch_tokens` padded tokens);
* **packed-dense** = `plan_packed` + `collate_packed(varlen=False)`: one row per micro-batch, no
  padding, a dense block-diagonal causal [T, T] mask through SDPA (T^2 scores);
* **packed-varlen** = `plan_packed` + `collate_packed`: the same rows with segment boundaries,
  attention per sample (polyrl/training/varlen.py, sum(L_i^2) scores).

Length mixes: **long-tail** (80% of responses 4-24 tokens, the rest up to `--max-response`, as RL
batches are), **spread** (responses uniform over 4..`--max-response`) and **uniform** (every
response 45-50% of `--max-response`: almost no padding, the control); prompts 8-16 tokens. bf16 runs under autocast with the CPU platform's training attention kernel choice
(polyrl/platform/platforms.py), as the training engines do. The three paths are interleaved per
repetition; medians. Also per path: micro-batches, tokens computed (real + padding), attention
scores computed per head (sum of rows x L^2, T^2 or L_i^2), and the padding fraction of the padded
plan (what `actor.packing=auto` reads, polyrl/batch/packed.py).

    python benchmarks/packing.py [--threads 1] [--reps 5] [--budget 2048 ...] [--model 4M]
        [--mix long-tail spread uniform] [--dtype float32 bfloat16] [--paths padded ...] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

PATHS = ("padded", "packed-dense", "packed-varlen")


def length_mix(mix: str, n: int, max_response: int, g: torch.Generator) -> torch.Tensor:
    if mix == "long-tail":  # Pareto-like: 80% of responses 4-24 tokens, the rest spread up to max_response
        short = torch.randint(4, 25, (n,), generator=g)
        long = torch.randint(25, max_response + 1, (n,), generator=g)
        return torch.where(torch.rand(n, generator=g) < 0.8, short, long)
    if mix == "spread":
        return torch.randint(4, max_response + 1, (n,), generator=g)
    if mix == "uniform":
        return torch.randint(int(0.45 * max_response), max_response // 2 + 1, (n,), generator=g)
    raise ValueError(f"unknown mix {mix!r}")


def make_batch(mix: str, n: int, vocab: int, max_response: int, seed: int = 0):
    from polyrl.batch import Ragged, RolloutBatch

    g = torch.Generator().manual_seed(seed)
    lengths = length_mix(mix, n, max_response, g)
    prompts = [torch.randint(2, vocab, (int(k),), generator=g).tolist()
               for k in torch.randint(8, 17, (n,), generator=g)]
    resp = Ragged.from_rows([torch.randint(2, vocab, (int(k),), generator=g).tolist() for k in lengths], torch.long)
    zeros = torch.zeros(n, dtype=torch.long)
    return RolloutBatch(prompt_ids=Ragged.from_rows(prompts, torch.long), response_ids=resp,
                        loss_mask=Ragged.full_like(resp, 1.0, torch.float32), group=torch.arange(n) // 8,
                        stop_reason=zeros, finished_with_eos=zeros.bool(), weight_version=zeros,
                        min_version=zeros, max_version=zeros, continuations=zeros)


def micro_batches(batch, budget: int, paths=PATHS) -> dict[str, list]:
    from polyrl.batch import collate, plan_micro_batches
    from polyrl.batch.packed import collate_packed, plan_packed

    cpu = torch.device("cpu")
    packs = plan_packed(batch.lengths, budget)
    build = {"padded": lambda: [collate(batch, idx, cpu) for idx in plan_micro_batches(batch.lengths, budget)],
             "packed-dense": lambda: [collate_packed(batch, idx, cpu, varlen=False) for idx in packs],
             "packed-varlen": lambda: [collate_packed(batch, idx, cpu) for idx in packs]}
    return {k: build[k]() for k in paths}


def attention_scores(mb) -> int:
    """Scores per head and layer the path computes: rows x L^2 padded, T^2 dense, sum L_i^2 varlen."""
    if getattr(mb, "cu_seq_lens", None) is not None:
        return int((mb.cu_seq_lens.diff().long() ** 2).sum())
    return mb.input_ids.shape[0] * mb.input_ids.shape[1] ** 2


def measure(model, mbs_by_path: dict[str, list], dtype: str, reps: int) -> dict[str, float]:
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from polyrl.training.logprobs import response_logprobs

    def attention():  # the CPU platform's training kernel choice (polyrl/platform/platforms.py)
        return sdpa_kernel(SDPBackend.MATH) if dtype == "bfloat16" else nullcontext()

    def run(mbs) -> float:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        for mb in mbs:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"), attention():
                lp, _ = response_logprobs(model, mb, with_entropy=True)
            (lp * mb.response_mask).sum().div(1000.0).backward()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {k: [] for k in mbs_by_path}
    for k, mbs in mbs_by_path.items():
        run(mbs)  # warm-up
    for _ in range(reps):
        for k, mbs in mbs_by_path.items():
            times[k].append(run(mbs))
    return {k: median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--max-response", type=int, default=200)
    p.add_argument("--budget", type=int, nargs="+", default=[2048], help="tokens per micro-batch (every path)")
    p.add_argument("--model", choices=["4M", "30M"], default="4M")
    p.add_argument("--mix", nargs="+", choices=["long-tail", "spread", "uniform"], default=["long-tail", "uniform"])
    p.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    p.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS), help="padded is always measured")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from _tiny import MODELS, build_model
    from logprobs import cpu_flags
    from polyrl.batch.packed import padding_fraction

    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp) / args.model, MODELS[args.model], max_positions=512)
        model = AutoModelForCausalLM.from_pretrained(str(Path(tmp) / args.model), dtype=torch.float32,
                                                     attn_implementation="sdpa")
    model.train()
    paths = ["padded", *(k for k in PATHS if k in args.paths and k != "padded")]
    print(f"CPU flags: {' '.join(cpu_flags())}; {args.threads} thread(s); model {args.model}; {args.samples} samples; "
          f"{args.reps} reps (medians)")
    results = []
    for mix in args.mix:
        batch = make_batch(mix, args.samples, model.config.vocab_size, args.max_response)
        for budget in args.budget:
            mbs = micro_batches(batch, budget, paths)
            pad = padding_fraction(batch.lengths, budget)
            for dtype in args.dtype:
                seconds = measure(model, mbs, dtype, args.reps)
                row = {"mix": mix, "budget": budget, "dtype": dtype, "real_tokens": int(batch.lengths.sum()),
                       "padding_fraction": pad, "response_median": float(batch.response_ids.lengths.float().median()),
                       "response_max": int(batch.response_ids.lengths.max())}
                for k in paths:
                    row[k] = {"s": seconds[k], "micro_batches": len(mbs[k]),
                              "tokens_computed": sum(mb.input_ids.numel() for mb in mbs[k]),
                              "attention_scores": sum(attention_scores(mb) for mb in mbs[k]),
                              "speedup_vs_padded": seconds["padded"] / seconds[k]}
                results.append(row)
                print(f"\n{mix}, budget {budget}, {dtype}: {row['real_tokens']} real tokens (response median "
                      f"{row['response_median']:.0f}, max {row['response_max']}); padded plan {pad:.0%} padding")
                for k in paths:
                    r = row[k]
                    print(f"  {k:14s} {r['s']:.3f} s  {r['speedup_vs_padded']:.2f}x  {r['micro_batches']} micro-batches  "
                          f"{r['tokens_computed']} tokens  {r['attention_scores']} scores/head/layer")
    if args.json:
        print(json.dumps({"cpu_flags": cpu_flags(), "threads": args.threads, "model": args.model,
                          "samples": args.samples, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
