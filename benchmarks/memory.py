"""Peak resident memory per rank of FSDP2 training at N = 1, 2, 4 gloo ranks: load, step, sync.

    polyrl bench memory [--params 300M] [--world-sizes 1,2,4] [--bucket-mb 64] [--mmap-threshold-mb 0] [--json]

A random Qwen2-shaped model of about `--params` parameters (fp32, tied embeddings; shape from
`qwen2_shape`) is written as a Hugging Face directory in a temp dir. For each world size, that
many spawned processes join a gloo group and each runs three phases (`_memory_rank.py`):

    load   the policy loaded as `PolicyWorker.setup` loads it under fsdp2 (polyrl/workers/policy.py):
           `load_causal_lm(..., deferred=True)` on the meta device, then `build_engine`, which
           shards it and reads each rank's rows from the safetensors file
    step   one GRPO update through the real `PPOActor` (polyrl/workers/actor.py): forward,
           backward and one AdamW step on this rank's shard of a fixed global batch (the same
           batch at every N, so activations shrink with N as they do in a run)
    sync   one weight publish: `engine.weight_stream()` packed bucket by bucket into one reused
           scratch buffer of `--bucket-mb`, as the object-store sender packs it
           (polyrl/weights/object_store.py; each bucket is dropped where that transport would put
           it in Ray's store); a tensor bigger than a bucket comes in row slices, each its own
           bucket (polyrl/weights/base.py `TensorSpec.pieces`); the other ranks join each
           gather and keep nothing

Reported per rank and phase: the peak resident set during the phase minus the resident set of
the same process just before the model was loaded (torch, transformers and polyrl imported, the
process group up): `<phase>_mib`, the issue's measure, which includes what earlier phases left
resident (the shards, the optimizer state). `<phase>_rise_mib` is the peak minus the resident set
at the phase's start: what the phase itself adds. Before the baseline and before each phase the
free pages glibc keeps in its heaps are handed back (`malloc_trim(0)`): what a phase freed would
otherwise count in the next phase's peak, though no code holds it. `--mmap-threshold-mb M` (0:
glibc's defaults) serves every allocation of M MiB or more by its own mmap, returned when freed,
so that within a phase too the resident set follows the live tensors rather than wherever glibc's
free lists placed the freed ones (`kept_before_<phase>_mib`: what the trim handed back).

How the peak is read: the kernel's own high-water mark (`VmHWM` in /proc/self/status), reset to
the current resident set at each phase's start by writing 5 to /proc/self/clear_refs (Linux >=
4.0). Exact and free: every page the kernel maps counts the moment it is mapped, which a sampling
thread reading VmRSS would miss between samples (and on 2 loaded cores it is often not scheduled),
and unlike `getrusage`'s ru_maxrss it can be reset, so the three phases run in one process without
a fresh process (and a fresh load) per phase. The resident set counts file-backed pages too: the
safetensors file that `from_pretrained` maps is counted while mapped, as it is resident.

The goal (issue #30): at N=4 each phase's `<phase>_mib` (max over ranks) is <= 0.3x its N=1
value. These are byte counts, not timings: the machine's load does not change them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MiB = 2**20
PHASES = ("load", "step", "sync")
GOAL_WORLD, GOAL_RATIO = 4, 0.3
BATCH = dict(num_samples=8, prompt_len=16, response_len=48)
"""The global batch of the step phase: 8 samples x 64 tokens, sharded over the ranks."""


def parse_params(text: str) -> int:
    """'300M', '1.5B', '5m', '5000000' -> a parameter count; ValueError naming the field."""
    t = text.strip().upper()
    scale = {"K": 1e3, "M": 1e6, "B": 1e9}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if t[-1:] in "KMB" else t) * scale
    except ValueError:
        raise ValueError(f"--params: '{text}' is not a count such as 300M or 1.5B") from None
    if value < 1e6:
        raise ValueError(f"--params: {text} is below 1M; give at least 1M")
    return int(value)


def qwen2_params(shape: dict, tied: bool = True) -> int:
    """Parameters of a Qwen2 model of `shape` (q/k/v biases, RMSNorm weights, tied head)."""
    h, i, v, layers = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], shape["num_hidden_layers"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    attention = h * h + h + 2 * (h * kv + kv) + h * h
    layer = attention + 3 * h * i + 2 * h
    return v * h * (1 if tied else 2) + layers * layer + h


def qwen2_shape(params: int) -> dict:
    """A Qwen2-like shape of about `params` parameters: head dim 64, 2 key-value heads, MLP
    width ~5.4 x hidden (Qwen2.5-0.5B's 4864 / 896), depth ~hidden / 37 (its 24 layers at 896);
    the vocabulary shrinks for small models so that the decoder, not the embedding, dominates."""
    vocab = 32768 if params >= 100e6 else 8192 if params >= 20e6 else 2048
    best = None
    for hidden in range(128, 8193, 128):
        heads = hidden // 64
        intermediate = round(hidden * 5.43 / 64) * 64
        shape = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=heads,
                     num_key_value_heads=2, intermediate_size=intermediate)
        per_layer = qwen2_params({**shape, "num_hidden_layers": 2}) - qwen2_params(shape)
        layers = round((params - qwen2_params({**shape, "num_hidden_layers": 0})) / per_layer)
        if layers < 2:
            continue
        shape["num_hidden_layers"] = layers
        aspect = abs(math.log(layers / (hidden / 37)))
        if best is None or aspect < best[0]:
            best = (aspect, shape)
    if best is None:
        raise ValueError(f"--params: no Qwen2 shape of about {params} parameters")
    return best[1]


def qwen3_moe_shape(params: int) -> dict:
    """A Qwen3-MoE shape of about `params` parameters (`--moe`): `qwen2_shape`'s hidden size,
    heads and vocabulary, 8 experts of 1.5 x hidden, top-2 (Qwen3-30B-A3B's 128 of 768 at 2048,
    top-8, scaled down), as many layers as the count allows."""
    from polyrl.training.memory_plan import Shape

    dense = qwen2_shape(params)
    h = dense["hidden_size"]
    moe = dict(model_type="qwen3_moe", vocab_size=dense["vocab_size"], hidden_size=h, num_hidden_layers=1,
               num_attention_heads=dense["num_attention_heads"], num_key_value_heads=2, head_dim=64,
               intermediate_size=dense["intermediate_size"], moe_intermediate_size=round(1.5 * h / 64) * 64,
               num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=True)

    def count(layers: int) -> int:
        return Shape.from_config({**moe, "num_hidden_layers": layers}).params

    moe["num_hidden_layers"] = max(2, round((params - count(0)) / (count(1) - count(0))))
    moe.pop("tie_word_embeddings")
    return moe


def measure(model_dir: str, world: int, tmp: Path, options: dict) -> list[dict]:
    from _memory_rank import run_rank
    from fsdp2_memory import run_ranks

    return run_ranks(f"memory x{world}", tmp / f"world{world}", world, run_rank, model_dir, options)


def summarise(per_world: dict[int, list[dict]]) -> list[dict]:
    """One entry per world size: each phase's max over ranks, the ranks, the ratio vs N=1."""
    results = []
    first = min(per_world)
    for world, ranks in sorted(per_world.items()):
        entry: dict = {"world_size": world}
        for name in PHASES:
            entry[f"{name}_mib"] = max(r[f"{name}_mib"] for r in ranks)
            entry[f"{name}_rise_mib"] = max(r[f"{name}_rise_mib"] for r in ranks)
        entry["ranks"] = ranks
        if first == 1:
            base = next(r for r in results if r["world_size"] == 1) if world != 1 else entry
            entry["ratio_vs_1"] = {name: entry[f"{name}_mib"] / base[f"{name}_mib"] for name in PHASES}
        results.append(entry)
    return results


def goal(results: list[dict]) -> dict | None:
    """Whether each phase at N=4 is <= 0.3x its N=1 value (None: N=1 or N=4 not run)."""
    at = next((r for r in results if r["world_size"] == GOAL_WORLD and "ratio_vs_1" in r), None)
    if at is None:
        return None
    return {name: at["ratio_vs_1"][name] <= GOAL_RATIO for name in PHASES}


def run(params: int, worlds: list[int], bucket_mb: float, tmp: Path, mmap_threshold_mb: float = 0,
        moe: bool = False, tensor_parallel: bool = False) -> dict:
    from _tiny import build_model
    from logprobs import cpu_flags
    from memory_model import predict_bench

    shape = qwen3_moe_shape(params) if moe else qwen2_shape(params)
    model_dir = tmp / "model"
    num_params = build_model(model_dir, shape)
    options = {"strategy": "fsdp2", "bucket_mb": bucket_mb, "vocab": shape["vocab_size"],
               "mmap_threshold_mb": mmap_threshold_mb, **BATCH}
    # --tp: N ranks of one tensor-parallel group (actor.tensor_parallel_size=N), the model sliced
    per_world = {world: measure(str(model_dir), world, tmp, {**options, "tensor_parallel_size": world}
                                if tensor_parallel else options) for world in worlds}
    results = summarise(per_world)
    tokens = BATCH["num_samples"] * (BATCH["prompt_len"] + BATCH["response_len"])
    for entry in results:  # benchmarks/memory_model.py's formula for the same run, to compare
        entry["predicted"] = predict_bench(shape, entry["world_size"], tokens // entry["world_size"], bucket_mb)
    active = None
    if moe:  # what one token's forward uses: its top-k of the experts (polyrl/training/memory_plan.py)
        from polyrl.training.memory_plan import Shape

        active = Shape.from_config({"tie_word_embeddings": True, **shape}).active_params
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "active_params": active,
            "cpu_flags": cpu_flags(), "load_average": list(os.getloadavg()), "num_params": num_params,
            "model_mib": num_params * 4 / MiB, "shape": shape, "dtype": "float32", "strategy": "fsdp2",
            "bucket_mb": bucket_mb, "mmap_threshold_mb": mmap_threshold_mb, "batch": BATCH, "results": results,
            "tensor_parallel": tensor_parallel,
            "goal": {"world_size": GOAL_WORLD, "max_ratio": GOAL_RATIO, "met": goal(results)}}


def print_table(report: dict) -> None:
    print(f"{report['date']}  {report['num_params'] / 1e6:.1f}M parameters (fp32, {report['model_mib']:.0f} MiB), "
          + (f"mixture-of-experts: {report['active_params'] / 1e6:.1f}M active, "
             f"{report['shape']['num_experts']} experts, top-{report['shape']['num_experts_per_tok']}"
             if report.get("active_params") else "") + f"  "
          f"fsdp2{' (N = tensor_parallel_size)' if report.get('tensor_parallel') else ''} on gloo, "
          f"bucket {report['bucket_mb']} MiB  cpu: {' '.join(report['cpu_flags'])}  "
          f"load average {report['load_average'][0]:.1f}"
          + (f"  mmap threshold {report['mmap_threshold_mb']} MiB" if report.get('mmap_threshold_mb') else ""))
    print("peak resident MiB above the rank's baseline before the model, max over ranks "
          "(rise: above the phase's start); ratio vs N=1")
    print(f"{'N':>2} " + " ".join(f"{p + ' MiB':>10} {'rise':>7} {'ratio':>6} {'model':>7}" for p in PHASES))
    for r in report["results"]:
        ratio = r.get("ratio_vs_1", {})
        print(f"{r['world_size']:>2} " + " ".join(
            f"{r[p + '_mib']:10.1f} {r[p + '_rise_mib']:7.1f} {ratio.get(p, float('nan')):6.2f} "
            f"{r['predicted'][p + '_mib']:7.0f}" for p in PHASES))
    print("model: benchmarks/memory_model.py predict_bench (the same formula as docs/scaling.md)")
    met = report["goal"]["met"]
    if met is None:
        print(f"goal (N={GOAL_WORLD} <= {GOAL_RATIO}x N=1): not checked, run --world-sizes 1,...,{GOAL_WORLD}")
    else:
        print(f"goal (N={GOAL_WORLD} <= {GOAL_RATIO}x N=1): " +
              ", ".join(f"{p} {'met' if ok else 'NOT met'}" for p, ok in met.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="300M", help="model size, e.g. 300M, 5M, 1.5B (default 300M)")
    parser.add_argument("--world-sizes", default="1,2,4", help="comma-separated rank counts (default 1,2,4)")
    parser.add_argument("--bucket-mb", type=float, default=64.0, help="weight-sync bucket (weights.bucket_mb)")
    parser.add_argument("--mmap-threshold-mb", type=float, default=0,
                        help="serve allocations of at least this many MiB by mmap, returned when freed "
                             "(glibc mallopt), so the resident set follows what the code holds "
                             "(default 0: glibc's defaults)")
    parser.add_argument("--moe", action="store_true",
                        help="a Qwen3-MoE of about --params (8 experts, top-2) instead of a dense Qwen2")
    parser.add_argument("--tp", default=None,
                        help="comma-separated tensor-parallel sizes instead of --world-sizes: each on as many "
                             "ranks, one tp group (actor.tensor_parallel_size), e.g. 1,2")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = parser.parse_args(argv)
    try:
        params = parse_params(args.params)
        worlds = sorted({int(n) for n in (args.tp or args.world_sizes).split(",")})
    except ValueError as exc:
        text = str(exc) if str(exc).startswith("--") else \
            f"--world-sizes: '{args.world_sizes}' is not a list such as 1,2,4"
        print(f"error: {text}", file=sys.stderr)
        return 2
    if not worlds or worlds[0] < 1:
        print(f"error: --world-sizes: '{args.world_sizes}' must be positive counts such as 1,2,4", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        report = run(params, worlds, args.bucket_mb, Path(tmp), args.mmap_threshold_mb, args.moe, bool(args.tp))
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
