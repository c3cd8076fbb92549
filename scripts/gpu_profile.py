"""Where a GPU's training step and decode spend their time (`scripts/gpu_check.sh --profile`):
torch.profiler over polyrl's bf16 PPO/GRPO update of a Qwen2.5-0.5B-shaped random Qwen2 with
sequence packing, and over the built-in engine's decode; for a lent accelerator with torch alone
(no Ray, engines or network), and in a tiny CPU form that CI-like checks run so it cannot rot.

    python scripts/gpu_profile.py [--device cuda|cpu] [--json PATH]

Prints, in order (the CPU form prints the same lines with a 2-layer model):
  device     the device, torch, the bf16 peak it is measured against
  train      one update (`PPOActor.update`, DDP engine on a 1-rank group, bf16 weights and
             compute, `actor.packing=on`: samples back to back in rows of `micro_batch_tokens`,
             per-sample attention, as the trainer packs them; polyrl/batch/packed.py): tokens,
             micro-batches, ms per update (mean of 3 after a warm-up, no profiler; CPU form: 1),
             TFLOP/s and MFU (6 N per token plus attention 6 L d s per token over each sample's
             causal length s, against the device's dense bf16 peak; the CPU form has no known
             peak: MFU n/a)
  top        the update's top kernels by device time (CPU form: ops by CPU time), one line each,
             with their share of the profiled total
  decode     the built-in engine's bf16 decode tokens/s (B prompts x P + T tokens, no profiler)
             and its top kernels under the profiler
  reference  the issue's reference points: the goal (training MFU >= 40% on H100/H200 at
             0.5B-1.5B with packing) and NeMo-RL's published 1,562 tokens/s/GPU end to end for
             Llama-3.1-8B on 16 H100 (a different model and a whole loop: a comparison line only)
  JSON       one object with all of the above, last line (and --json PATH)

Imports: torch, transformers (the qwen2 family) and the rank-side parts of polyrl, what
scripts/gpu_carry.sh carries; the model is built from a config, nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

# the model, batch and actor helpers of --quick (it puts the repository on sys.path)
import gpu_quick_check as quick  # noqa: E402

from polyrl.batch import Ragged, RolloutBatch  # noqa: E402
from polyrl.platform import get_platform  # noqa: E402

GOAL_MFU = 0.40
"""Issue 42: training MFU >= 40% on H100/H200 at 0.5B-1.5B with packing."""
NEMO_RL_TOKENS_PER_S_PER_GPU = 1562.0
"""NeMo-RL's published end-to-end rollout figure for Llama-3.1-8B on 16 H100 (issue 42)."""

WORKLOAD = {
    # samples, prompt and response length ranges (long-tailed: packing has padding to remove),
    # micro-batch tokens, timed updates, decode prompts x prompt tokens x new tokens, profiled
    # decode tokens
    "cuda": dict(shape="0.5b", samples=64, prompt=(64, 512), response=(32, 1024), micro_batch_tokens=16384,
                 timed_updates=3, decode=(256, 128, 128), profiled_decode_tokens=16),
    "cpu": dict(shape="tiny", samples=8, prompt=(4, 16), response=(4, 32), micro_batch_tokens=256,
                timed_updates=1, decode=(4, 8, 8), profiled_decode_tokens=4),
}
TOP = 12


def long_tail_batch(n: int, prompt: tuple[int, int], response: tuple[int, int], vocab: int,
                    seed: int = 0) -> RolloutBatch:
    """`n` random samples with lengths drawn uniformly from the ranges (seeded); one advantage
    per sample, groups of 8."""
    g = torch.Generator().manual_seed(seed)
    P = torch.randint(prompt[0], prompt[1] + 1, (n,), generator=g).tolist()
    R = torch.randint(response[0], response[1] + 1, (n,), generator=g).tolist()
    prompts = Ragged.from_rows([torch.randint(2, vocab, (p,), generator=g) for p in P], torch.long)
    responses = Ragged.from_rows([torch.randint(2, vocab, (r,), generator=g) for r in R], torch.long)
    zeros = torch.zeros(n, dtype=torch.long)
    return RolloutBatch(
        prompt_ids=prompts, response_ids=responses,
        loss_mask=Ragged.full_like(responses, 1.0, torch.float32), group=torch.arange(n) // 8,
        stop_reason=zeros, finished_with_eos=torch.ones(n, dtype=torch.bool), weight_version=zeros,
        min_version=zeros, max_version=zeros, continuations=zeros,
        rollout_logprobs=responses.with_values(-torch.rand(len(responses.values), generator=g) * 3),
        advantages=torch.randn(n, generator=g))


def training_flops(params: int, layers: int, hidden: int, lengths: torch.Tensor) -> float:
    """6 N per token (forward + backward, the tied head included in N) plus attention: QK^T and
    AV, forward and backward, 12 L d per query-key pair over each sample's causal half (s^2 / 2)."""
    tokens = float(lengths.sum())
    return 6.0 * params * tokens + 12.0 * layers * hidden * float((lengths.float() ** 2 / 2).sum())


def top_kernels(prof, device: torch.device, n: int = TOP) -> tuple[list[dict], float]:
    """The `n` kernels (CUDA: the device's own events, memcpy and memset included) or ops (CPU)
    with the most self time, and the profiled total (ms). A CPU op's self device time is the
    time of the kernels it launched, so on CUDA only the device events count, each once."""
    from torch.autograd import DeviceType

    rows = []
    for e in prof.key_averages():
        if device.type == "cuda":
            ms = e.self_device_time_total / 1e3 if e.device_type == DeviceType.CUDA else 0.0
        else:
            ms = e.self_cpu_time_total / 1e3
        if ms > 0:
            rows.append((e.key, ms, e.count))
    total = sum(ms for _, ms, _ in rows)
    rows.sort(key=lambda r: -r[1])
    return [{"name": k, "ms": round(ms, 3), "calls": c, "share": round(ms / total, 4) if total else 0.0}
            for k, ms, c in rows[:n]], total


def profiler(device: torch.device):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(activities=activities)


def profile_training(device: torch.device, model_dir: Path, work: dict, peak_tflops: float | None) -> dict:
    from polyrl.batch.packed import plan_layout

    model = quick.load_model(model_dir, "bfloat16", device)
    params = sum(p.numel() for p in model.parameters())
    cfg = model.config
    engine, actor = quick.actor_and_engine(model, "ddp", device, param_dtype="bfloat16", compute_dtype="bfloat16",
                                           packing="on", micro_batch_tokens=work["micro_batch_tokens"])
    batch = long_tail_batch(work["samples"], work["prompt"], work["response"], cfg.vocab_size, seed=2)
    lengths = batch.prompt_ids.lengths + batch.response_ids.lengths
    packed, plan = plan_layout(batch.lengths, work["micro_batch_tokens"], engine.packing)
    update = lambda: actor.update(batch, num_mini_batches=1, use_rollout_logprobs=False)  # noqa: E731
    update()  # warm-up: allocator, kernels' autotuning
    quick.synchronize(device)
    reps = work["timed_updates"]
    start = time.perf_counter()
    for _ in range(reps):
        update()
    quick.synchronize(device)
    per_update = (time.perf_counter() - start) / reps
    with profiler(device) as prof:
        update()
        quick.synchronize(device)
    top, profiled_ms = top_kernels(prof, device)
    flops = training_flops(params, cfg.num_hidden_layers, cfg.hidden_size, lengths)
    tflops = flops / per_update / 1e12
    return {"params": params, "tokens": int(lengths.sum()), "samples": len(batch), "packing": engine.packing,
            "packed": packed, "micro_batches": len(plan), "micro_batch_tokens": work["micro_batch_tokens"],
            "ms_per_update": round(per_update * 1e3, 2), "tflops": tflops,
            "mfu": round(tflops / peak_tflops, 4) if peak_tflops else None,
            "profiled_ms": round(profiled_ms, 2), "top": top}


def profile_decode(device: torch.device, model_dir: Path, work: dict) -> dict:
    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native.engine import NativeEngine

    batch, prompt, tokens = work["decode"]
    engine = NativeEngine(model_dir, dtype="bfloat16", device=device, max_model_len=prompt + tokens,
                          max_num_seqs=batch, tokenizer=False)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, vocab, (prompt,), generator=g).tolist() for _ in range(batch)]
    engine.generate_batch(prompts[:4], SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True))  # warm-up
    quick.synchronize(device)
    start = time.perf_counter()
    outs = engine.generate_batch(prompts, SamplingParams(temperature=1.0, max_tokens=tokens, seed=0, ignore_eos=True))
    quick.synchronize(device)
    elapsed = time.perf_counter() - start
    generated = sum(len(s[0].token_ids) for s in outs)
    if generated != batch * tokens:
        raise AssertionError(f"decode generated {generated} tokens, expected {batch * tokens}")
    short = work["profiled_decode_tokens"]
    with profiler(device) as prof:
        engine.generate_batch(prompts, SamplingParams(temperature=1.0, max_tokens=short, seed=1, ignore_eos=True))
        quick.synchronize(device)
    top, profiled_ms = top_kernels(prof, device)
    return {"prompts": batch, "prompt_tokens": prompt, "new_tokens": tokens,
            "tokens_per_s": round(generated / elapsed, 1), "seconds": round(elapsed, 3),
            "profiled_new_tokens": short, "profiled_ms": round(profiled_ms, 2), "top": top}


def print_top(label: str, rows: list[dict], unit: str) -> None:
    print(f"top {label} by {unit} time:")
    for r in rows:
        print(f"  {r['share']:6.1%} {r['ms']:10.2f} ms {r['calls']:6d}x  {r['name'][:110]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--json", help="write the JSON object here too")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAIL profile: no CUDA device visible to torch (run with --device cpu for the CPU form)")
        return 1
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    work = WORKLOAD[args.device]
    name, peak = "cpu", None
    if device.type == "cuda":
        torch.cuda.set_device(device)
        name = torch.cuda.get_device_name(device)
        peak = next((v for k, v in quick.PEAK_BF16_TFLOPS.items() if k in name), None)
    print(f"device: {name}; torch {torch.__version__}; bf16 peak "
          f"{f'{peak:.0f} TFLOP/s' if peak else 'n/a (no known peak for this device)'}", flush=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(get_platform(None).group_backend(device.type), store=dist.HashStore(), rank=0, world_size=1)
    try:
        with tempfile.TemporaryDirectory(prefix="polyrl-profile-") as tmp:
            model_dir = quick.random_model_dir(quick.SHAPES[work["shape"]], Path(tmp) / "model", torch.bfloat16)
            train = profile_training(device, model_dir, work, peak)
            mfu = "n/a" if train["mfu"] is None else f"{train['mfu']:.1%}"
            print(f"train: {train['params'] / 1e6:.1f}M params, bf16, packing {train['packing']} "
                  f"({train['micro_batches']} micro-batches of <= {train['micro_batch_tokens']} tokens), "
                  f"{train['samples']} samples, {train['tokens']} tokens: {train['ms_per_update']:.1f} ms per update, "
                  f"{train['tflops']:.3g} TFLOP/s, MFU {mfu}", flush=True)
            print_top("training kernels" if device.type == "cuda" else "training ops", train["top"],
                      "device" if device.type == "cuda" else "CPU")
            decode = profile_decode(device, model_dir, work)
            print(f"decode: {decode['tokens_per_s']:,.0f} tokens/s ({decode['prompts']} prompts x "
                  f"{decode['prompt_tokens']} + {decode['new_tokens']} tokens, bf16, built-in engine, "
                  f"{decode['seconds']:.2f} s)", flush=True)
            print_top("decode kernels" if device.type == "cuda" else "decode ops", decode["top"],
                      "device" if device.type == "cuda" else "CPU")
    finally:
        dist.destroy_process_group()
    goal = ("n/a" if train["mfu"] is None else ("met" if train["mfu"] >= GOAL_MFU else "not met"))
    print(f"reference: goal training MFU >= {GOAL_MFU:.0%} on H100/H200 at 0.5B-1.5B with packing: {goal}; "
          f"NeMo-RL (published, end to end, Llama-3.1-8B on 16 H100): {NEMO_RL_TOKENS_PER_S_PER_GPU:,.0f} "
          f"tokens/s/GPU, here decode {decode['tokens_per_s']:,.0f} tokens/s on one device "
          f"(a {train['params'] / 1e6:.1f}M model, decode alone: a comparison line, not a like-for-like ratio)")
    summary = {"device": args.device, "device_name": name, "torch": torch.__version__, "peak_bf16_tflops": peak,
               "train": train, "decode": decode,
               "reference": {"goal_mfu": GOAL_MFU, "goal": goal,
                             "nemo_rl_tokens_per_s_per_gpu": NEMO_RL_TOKENS_PER_S_PER_GPU}}
    print(json.dumps(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
