"""Packed against padded micro-batches on a long-tail length mix, same run.

One training pass (forward + backward through `response_logprobs`, every micro-batch of the
batch) of the 4M random-init Qwen2 model of `benchmarks/_tiny.py` over a GRPO batch whose
response lengths follow a long tail (most responses short, a few near the limit, as RL batches
are). **padded** = `plan_micro_batches` + `collate` (sorted by length, padded to the longest of
each micro-batch, `actor.micro_batch_tokens` padded tokens); **packed** = `plan_packed` +
`collate_packed` (polyrl/batch/packed.py: one row per micro-batch, no padding, block-diagonal
causal mask) at the same token budget. Interleaved repetitions, medians; `speedup` = padded s /
packed s; also the tokens each path computes (real + padding).

    python benchmarks/packing.py [--threads 1] [--reps 5] [--budget 2048] [--json]
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


def long_tail_batch(n: int, vocab: int, max_response: int, seed: int = 0):
    from polyrl.batch import Ragged, RolloutBatch

    g = torch.Generator().manual_seed(seed)
    # Pareto-like: 80% of responses 4-24 tokens, the rest spread up to max_response
    short = torch.randint(4, 25, (n,), generator=g)
    long = torch.randint(25, max_response + 1, (n,), generator=g)
    lengths = torch.where(torch.rand(n, generator=g) < 0.8, short, long)
    prompts = [torch.randint(2, vocab, (int(k),), generator=g).tolist()
               for k in torch.randint(8, 17, (n,), generator=g)]
    resp = Ragged.from_rows([torch.randint(2, vocab, (int(k),), generator=g).tolist() for k in lengths], torch.long)
    zeros = torch.zeros(n, dtype=torch.long)
    return RolloutBatch(prompt_ids=Ragged.from_rows(prompts, torch.long), response_ids=resp,
                        loss_mask=Ragged.full_like(resp, 1.0, torch.float32), group=torch.arange(n) // 8,
                        stop_reason=zeros, finished_with_eos=zeros.bool(), weight_version=zeros,
                        min_version=zeros, max_version=zeros, continuations=zeros)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--max-response", type=int, default=200)
    p.add_argument("--budget", type=int, default=2048, help="tokens per micro-batch (both paths)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from _tiny import MODELS, build_model
    from logprobs import cpu_flags
    from polyrl.batch import collate, plan_micro_batches
    from polyrl.batch.packed import collate_packed, plan_packed
    from polyrl.training.logprobs import response_logprobs

    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp) / "4M", MODELS["4M"], max_positions=512)
        model = AutoModelForCausalLM.from_pretrained(str(Path(tmp) / "4M"), dtype=torch.float32)
    model.train()
    batch = long_tail_batch(args.samples, model.config.vocab_size, args.max_response)
    lengths = batch.lengths
    cpu = torch.device("cpu")
    paths = {
        "padded": [collate(batch, idx, cpu) for idx in plan_micro_batches(lengths, args.budget)],
        "packed": [collate_packed(batch, idx, cpu) for idx in plan_packed(lengths, args.budget)],
    }
    computed = {"padded": sum(mb.input_ids.numel() for mb in paths["padded"]),
                "packed": sum(mb.input_ids.numel() for mb in paths["packed"])}

    def run(mbs) -> float:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        for mb in mbs:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"):
                lp, _ = response_logprobs(model, mb, with_entropy=True)
            (lp * mb.response_mask).sum().div(1000.0).backward()
        return time.perf_counter() - t0

    times = {k: [] for k in paths}
    for k in paths:
        run(paths[k])  # warm-up
    for _ in range(args.reps):
        for k in paths:
            times[k].append(run(paths[k]))
    out = {"cpu_flags": cpu_flags(), "threads": args.threads, "dtype": args.dtype, "budget": args.budget,
           "samples": args.samples, "real_tokens": int(lengths.sum()),
           "response_lengths": {"median": float(batch.response_ids.lengths.float().median()),
                                "max": int(batch.response_ids.lengths.max())},
           **{f"{k}_s": median(v) for k, v in times.items()},
           **{f"{k}_micro_batches": len(v) for k, v in paths.items()},
           **{f"{k}_tokens_computed": v for k, v in computed.items()}}
    out["speedup"] = out["padded_s"] / out["packed_s"]
    print(f"CPU flags: {' '.join(out['cpu_flags'])}; {args.threads} thread(s), {args.dtype}; {args.samples} samples, "
          f"{out['real_tokens']} real tokens (response median {out['response_lengths']['median']:.0f}, max "
          f"{out['response_lengths']['max']})")
    for k in paths:
        print(f"{k}: {out[k + '_s']:.3f} s per pass, {out[k + '_micro_batches']} micro-batches, "
              f"{out[k + '_tokens_computed']} tokens computed")
    print(f"speedup (padded / packed): {out['speedup']:.2f}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
