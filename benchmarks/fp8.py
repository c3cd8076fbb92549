"""FP8 quantization throughput: block-wise e4m3 quantization vs a plain copy of the same tensors.

The linear weights of the ~30M-parameter Qwen2-shaped state dict of `benchmarks/weights.py`
(63 tensors, 25.5M parameters; embeddings, norms and biases are never quantized) are streamed
through `polyrl.weights.fp8.quantize_named_tensors`, as a sending engine adapter does at every
weight sync, in fp32 and in bf16. Two plain copies of the same tensors are the baselines, timed
rep by rep alternating with the quantizer so all three see the same machine load:
    copy_   into preallocated tensors (memcpy; what `ratio` divides by)
    clone   allocating its output, as quantization does (`clone_ratio`)
Throughput is bytes of *input* weights per second of wall time (median of the reps); `cpu_ratio`
is the same ratio in CPU seconds of this process, which a busy neighbour disturbs less. Each
dtype's output is also checked once against the e4m3 error bound (16 * scale_inv per block,
`within_bound`).

    python benchmarks/fp8.py                     # ~10 s on 2 cores
    python benchmarks/fp8.py --quick --json      # 3 reps; the last stdout line is JSON
    python benchmarks/fp8.py --accelerator       # also on this machine's GPU/NPU (platform layer)
    polyrl bench fp8 --json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polyrl.weights.fp8 import (  # noqa: E402
    FP8_BLOCK,
    dequantize_block_fp8,
    is_quantizable,
    quantize_named_tensors,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def model_tensors() -> dict[str, torch.Tensor]:
    """The weight-sync benchmark's 30M state dict, loaded by path: under pytest `tests/` is on
    sys.path too, and its `weights/` folder would shadow a plain `import weights`."""
    spec = importlib.util.spec_from_file_location("polyrl_bench_weights", Path(__file__).with_name("weights.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.model_tensors()


def linear_weights(dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    return {name: t.to(device=device, dtype=dtype) for name, t in model_tensors().items()
            if is_quantizable(name, t)}


def timed(work, sync) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of work() and the device sync after it."""
    t0, c0 = time.perf_counter(), time.process_time()
    work()
    sync()
    return time.perf_counter() - t0, time.process_time() - c0


def drain(named) -> None:
    for _ in named:  # each tensor is dropped as soon as it is taken, as a bucketed sender does
        pass


def within_bound(tensors: dict[str, torch.Tensor]) -> bool:
    """|w - dequant(q)| <= 16 * scale_inv in every block (half a step of e4m3's top binade)."""
    quantized = dict(quantize_named_tensors(tensors.items()))
    for name, w in tensors.items():
        q, s = quantized[name], quantized[name + "_scale_inv"]
        err = (w.float() - dequantize_block_fp8(q, s)).abs()
        # Half an e4m3 step at the top of the range (16 * scale_inv) plus float32 rounding of
        # w / scale_inv and q * scale_inv (values up to 448 * scale_inv, 2^-24 relative each).
        limit = dequantize_block_fp8(torch.ones_like(q, dtype=torch.float32), s) * (16 + 448 * 2**-21)
        if not bool((err <= limit).all()):
            return False
    return True


def bench_dtype(dtype: torch.dtype, device: torch.device, reps: int, sync) -> dict:
    tensors = linear_weights(dtype, device)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    dst = [torch.empty_like(t) for t in tensors.values()]
    work = {
        "copy": lambda: [d.copy_(t) for d, t in zip(dst, tensors.values())],
        "clone": lambda: [t.clone() for t in tensors.values()],
        "quant": lambda: drain(quantize_named_tensors(tensors.items())),
    }
    for fn in work.values():  # warm-up: allocator, page tables, caches
        timed(fn, sync)
    times = {key: [] for key in work}
    for _ in range(reps):  # alternate, so every variant sees the same machine load
        for key, fn in work.items():
            times[key].append(timed(fn, sync))
    wall = {key: statistics.median(w for w, _ in rows) for key, rows in times.items()}
    cpu = {key: statistics.median(c for _, c in rows) for key, rows in times.items()}
    row = {
        "bytes": nbytes,
        "out_bytes": sum(t.numel() * t.element_size() for _, t in quantize_named_tensors(tensors.items())),
        "copy_bytes_per_s": nbytes / wall["copy"],
        "clone_bytes_per_s": nbytes / wall["clone"],
        "quant_bytes_per_s": nbytes / wall["quant"],
        "ratio": wall["copy"] / wall["quant"],
        "clone_ratio": wall["clone"] / wall["quant"],
        # CPU seconds of this process: less sensitive to a shared machine (CPU runs only).
        "quant_cpu_bytes_per_s": nbytes / max(cpu["quant"], 1e-9),
        "cpu_ratio": cpu["copy"] / max(cpu["quant"], 1e-9),
        "within_bound": within_bound(tensors),
    }
    return row


def run_on(device: torch.device, reps: int, sync) -> dict:
    return {key: bench_dtype(dtype, device, reps, sync) for key, dtype in DTYPES.items()}


def print_table(label: str, rows: dict) -> None:
    print(f"{label}: {'dtype':<6}{'quant GB/s':>12}{'copy_ GB/s':>12}{'clone GB/s':>12}{'ratio':>8}"
          f"{'x clone':>9}{'cpu ratio':>10}{'out/in':>8}  bound ok")
    for key, r in rows.items():
        print(f"{'':<{len(label) + 2}}{key:<6}{r['quant_bytes_per_s'] / 1e9:>12.2f}{r['copy_bytes_per_s'] / 1e9:>12.2f}"
              f"{r['clone_bytes_per_s'] / 1e9:>12.2f}{r['ratio']:>8.3f}{r['clone_ratio']:>9.3f}{r['cpu_ratio']:>10.3f}"
              f"{r['out_bytes'] / r['bytes']:>8.3f}  {r['within_bound']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    ap.add_argument("--quick", action="store_true", help="3 reps")
    ap.add_argument("--reps", type=int, default=None, help="timed reps per dtype (default 15, 3 with --quick)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: steadier on a shared machine)")
    ap.add_argument("--accelerator", action="store_true",
                    help="also run on device 0 of the detected platform (skipped when it has none)")
    args = ap.parse_args(argv)
    reps = args.reps or (3 if args.quick else 15)
    torch.set_num_threads(args.threads)

    sample = {n: t for n, t in model_tensors().items() if is_quantizable(n, t)}
    params = sum(t.numel() for t in sample.values())
    print(f"fp8 block {FP8_BLOCK[0]}x{FP8_BLOCK[1]} e4m3: {len(sample)} linear weights, {params / 1e6:.1f}M parameters; "
          f"{reps} reps; torch threads {torch.get_num_threads()}")
    results = {"params": params, "tensors": len(sample), "reps": reps, "threads": torch.get_num_threads(),
               "block": list(FP8_BLOCK), "cpu": run_on(torch.device("cpu"), reps, lambda: None)}
    print_table("cpu", results["cpu"])
    if args.accelerator:
        from polyrl.platform import current_platform

        platform = current_platform()
        if platform.ray_resource is not None and platform.device_count > 0:
            results["accelerator"] = {"device": platform.describe(),
                                      **run_on(platform.torch_device(0), reps, platform.synchronize)}
            print_table(platform.name, {k: results["accelerator"][k] for k in DTYPES})
        else:
            print(f"--accelerator: no device on this machine ({platform.describe()}); skipped")
    results["ratio"] = results["cpu"]["bf16"]["ratio"]
    print(f"ratio (cpu, bf16 input, quantize / copy): {results['ratio']:.3f}")
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
