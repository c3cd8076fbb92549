"""Where one GRPO step's time goes: `polyrl bench grpo --profile SIZE:DTYPE [--threads N] [--json]`.

The step `polyrl bench grpo` times (benchmarks/grpo.py: same model shapes, prompts, batch, dtype
settings), run with `ray.enabled=false` so the policy rank and its native engine are objects of
this process and one `torch.profiler` sees all of it: step 1 warms up, step 2 is timed without the
profiler (the roofline fraction uses it), step 3 runs under the profiler. Each op's self time goes
to one phase (generation with the reward, the update, the rest of the step: advantages, weight
sync) and one group:

  matmul             weight matmuls (mm, addmm, linear, oneDNN's packed `_linear_pointwise`),
                     forward and backward, with their FLOPs (from the recorded input shapes) and
                     the GFLOP/s they reach against the plain-matmul peak of the model's training
                     shapes that `polyrl bench grpo` measures (`grpo.matmul_peak`)
  attention          inside an `...Attention` module (RoPE, SDPA, reshapes) or bmm / softmax ops,
                     and their backward
  norms/activations  inside an `...RMSNorm` / activation module, rms_norm / silu ops, and backward
  dtype casts        every copy_ / to / _to_copy not inside one of the above ops (bf16 autocast,
                     the RMSNorm's float32 round trip, log-probs in float32)
  optimizer          inside `Optimizer.step` / `zero_grad`, and the foreach ops (grad clipping)
  sampling           inside the native engine's `sample` (softmax, top-k/p, multinomial)
  other              every other op: element-wise ops, log-softmax / loss, embedding, KV-cache
                     writes, views
  python between ops the step's and the phases' markers' own self time: the Python (engine loop,
                     trainer, batch building) that runs between ops

A backward op belongs to the group of the forward op that made its autograd node (the profiler's
sequence numbers link the two). The parts of each phase sum to the phase's profiled time, and the
phases to the step's (`check_sums`; a test holds it on a tiny model). Profiled times are wall
times of the recording thread with the profiler's own overhead in them; the shares, not the
absolute milliseconds, are the result.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rollout import _OP_GROUPS  # noqa: E402  (the decode profile's op names, reused)

GROUPS = ("matmul", "attention", "norms/activations", "dtype casts", "optimizer", "sampling", "other",
          "python between ops")
PHASES = ("generate", "update", "rest")
STEP, GENERATE, UPDATE, SAMPLE = "grpo::step", "grpo::generate", "grpo::update", "grpo::sample"
MODULE = "grpo::module::"
"""Prefix of the markers the module hooks put around norm / activation / attention modules."""

MATMUL_OPS = {*_OP_GROUPS["weight matmuls"], "aten::linear"}
ATTENTION_OPS = {*_OP_GROUPS["attention (KV read + softmax)"], "aten::_softmax_backward_data",
                 "aten::_safe_softmax", "aten::scaled_dot_product_attention",
                 "aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_flash_attention_for_cpu_backward"}
NORM_ACT_OPS = {*_OP_GROUPS["norms"], "aten::_fused_rms_norm_backward", "aten::silu", "aten::silu_backward",
                "aten::gelu", "aten::gelu_backward"}
CAST_OPS = {"aten::copy_", "aten::to", "aten::_to_copy"}
FOREACH_PREFIXES = ("aten::_foreach_", "aten::_fused_adam")


def module_group(module: torch.nn.Module) -> str | None:
    """The group a module's forward belongs to, by its class name (Hugging Face's Qwen2 modules)."""
    name = type(module).__name__
    if name.endswith("RMSNorm") or name.endswith("Activation") or name in ("SiLU", "GELU"):
        return "norms/activations"
    if name.endswith("Attention"):
        return "attention"
    return None


@contextlib.contextmanager
def module_markers():
    """A `record_function` range around every norm / activation / attention module's forward
    (global module hooks, removed on exit): the ops inside them carry no name of their own."""
    from torch.autograd.profiler import record_function
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    open_ranges: dict[int, list] = {}

    def enter(module, args):
        group = module_group(module)
        if group is not None:
            marker = record_function(MODULE + group)
            marker.__enter__()
            open_ranges.setdefault(id(module), []).append(marker)

    def leave(module, args, output):
        stack = open_ranges.get(id(module))
        if stack:
            stack.pop().__exit__(None, None, None)

    handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def sampling_marker():
    """The native engine's `sample` inside a `record_function` range (the engine has no marker)."""
    from torch.autograd.profiler import record_function

    from polyrl.rollout.native import scheduler

    original = scheduler.sample

    def marked(*args, **kwargs):
        with record_function(SAMPLE):
            return original(*args, **kwargs)

    scheduler.sample = marked
    try:
        yield
    finally:
        scheduler.sample = original


# ----------------------------------------------------------------------------- classification
def _chain(event) -> list:
    chain = []
    while event is not None:
        chain.append(event)
        event = event.cpu_parent
    return chain


def matmul_flops(event) -> float:
    """2 M K N of one weight matmul from its recorded input shapes (0 where they are not 2-D)."""
    shapes = event.input_shapes
    if event.name == "aten::mm":
        x, w = shapes[0], shapes[1]
    elif event.name == "aten::addmm":
        x, w = shapes[1], shapes[2]  # (bias, X [M, K], W^T [K, N], ...)
    elif event.name == "mkldnn::_linear_pointwise":  # (X, W, ...) or the binary (X, other, W, B, attr)
        x, w = shapes[0], shapes[2] if len(shapes) == 5 else shapes[1]
        if not x or len(w) != 2:
            return 0.0
        rows = 1
        for d in x[:-1]:
            rows *= d
        return 2.0 * rows * x[-1] * w[0]
    else:
        return 0.0
    if len(x) != 2 or len(w) != 2:
        return 0.0
    return 2.0 * x[0] * x[1] * w[1]


class Classifier:
    """Phase and group of every event of one profiled step (see the module docstring)."""

    def __init__(self, events):
        self.forward_group: dict[int, str] = {}
        self.backward_nodes: list = []
        for event in events:  # forward ops with an autograd node: their group, for the backward
            if event.sequence_nr >= 0 and not self.in_backward(event):
                self.forward_group[event.sequence_nr] = self._by_chain(event, follow_backward=False)

    def phase(self, event) -> str | None:
        """generate / update / rest, or None for an event outside the profiled step."""
        names = [a.name for a in _chain(event)]
        if STEP not in names:
            return None
        if GENERATE in names:
            return "generate"
        if UPDATE in names:
            return "update"
        return "rest"

    def group(self, event) -> str:
        return self._by_chain(event, follow_backward=True)

    @staticmethod
    def in_backward(event) -> bool:
        return any(a.name.startswith("autograd::engine::evaluate_function") for a in _chain(event))

    def _by_chain(self, event, follow_backward: bool) -> str:
        chain = _chain(event)
        names = [a.name for a in chain]
        if any(n.startswith("Optimizer.") for n in names) or any(n.startswith(FOREACH_PREFIXES) for n in names):
            return "optimizer"
        if SAMPLE in names:
            return "sampling"
        if event.name in (STEP, GENERATE, UPDATE):
            return "python between ops"
        for node in chain:  # the nearest named op or marker decides: a copy_ inside addmm is matmul
            name = node.name
            if name in MATMUL_OPS:
                return "matmul"
            if name in ATTENTION_OPS:
                return "attention"
            if name in NORM_ACT_OPS:
                return "norms/activations"
            if name in CAST_OPS:
                return "dtype casts"
            if name.startswith(MODULE):
                return name.removeprefix(MODULE)
            if follow_backward and name.startswith("autograd::engine::evaluate_function"):
                return self.forward_group.get(node.sequence_nr, "other")
        return "other"


def breakdown(events) -> dict[str, Any]:
    """Self time (ms) per phase and group, matmul FLOPs and time per phase, the step's profiled
    total (its marker's duration) and the top ops of "other"."""
    classifier = Classifier(events)
    ms = {phase: {group: 0.0 for group in GROUPS} for phase in PHASES}
    flops = {phase: 0.0 for phase in PHASES}
    backward = {"ms": 0.0, "flops": 0.0}  # the update's backward matmuls, apart
    other_ops: dict[str, float] = {}
    step_ms = outside_ms = 0.0
    for event in events:
        self_ms = event.self_cpu_time_total / 1e3
        if event.name == STEP:
            step_ms += event.cpu_time_total / 1e3
        phase = classifier.phase(event)
        if phase is None:
            outside_ms += self_ms
            continue
        group = classifier.group(event)
        ms[phase][group] += self_ms
        if group == "matmul":
            flops[phase] += matmul_flops(event)
            if phase == "update" and classifier.in_backward(event):
                backward["ms"] += self_ms
                backward["flops"] += matmul_flops(event)
        if group == "other":
            other_ops[event.name] = other_ops.get(event.name, 0.0) + self_ms
    top = dict(sorted(((k, round(v, 2)) for k, v in other_ops.items()), key=lambda kv: -kv[1])[:10])
    return {"ms": ms, "matmul_flops": flops, "update_backward_matmul": backward, "step_ms": step_ms,
            "outside_step_ms": outside_ms, "top_other_ops_ms": top}


def check_sums(result: dict, rel: float = 1e-6) -> None:
    """The groups of every phase, summed over the phases, equal the step marker's duration."""
    parts = sum(sum(groups.values()) for groups in result["ms"].values())
    if abs(parts - result["step_ms"]) > rel * max(result["step_ms"], 1e-9) + 1e-3:
        raise AssertionError(f"the breakdown's parts sum to {parts:.3f} ms, the step took {result['step_ms']:.3f} ms")


# ----------------------------------------------------------------------------- the run
def profile_step(model_dir: str, files: dict, out: Path, dtype: str, threads: int) -> dict[str, Any]:
    """Three in-process GRPO steps of `polyrl bench grpo`'s workload (ray.enabled=false); returns
    the breakdown of step 3, the wall seconds and phases of step 2 (unprofiled) and its metrics."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    from grpo import cpu_seconds, polyrl_config
    from polyrl.trainer.loop import Trainer

    torch.set_num_threads(threads)
    cfg = polyrl_config(model_dir, files, out, dtype, 3, threads)
    cfg.ray.enabled = False
    found: dict[str, Any] = {}

    class Profiled(Trainer):
        def update(self, batch, step):
            with record_function(UPDATE):
                return super().update(batch, step)

        def train_step(self, step):
            if step < self.total_steps:  # 1: warm-up, 2: timed without the profiler
                start, cpu = time.perf_counter(), cpu_seconds()
                metrics = super().train_step(step)
                found["timed_s"], found["timed_metrics"] = time.perf_counter() - start, metrics
                found["timed_cpu_s"] = cpu_seconds() - cpu
                return metrics
            next_batch = self.topology.next_batch

            def generate(*args, **kwargs):
                with record_function(GENERATE):
                    return next_batch(*args, **kwargs)

            self.topology.next_batch = generate
            try:
                with sampling_marker(), module_markers(), \
                        profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                    with record_function(STEP):
                        metrics = super().train_step(step)
            finally:
                del self.topology.next_batch
            found["events"] = prof.events()
            return metrics

    Profiled(cfg).fit()
    result = breakdown(found["events"])
    check_sums(result)
    timed = found["timed_metrics"]
    result["timed_step_s"], result["timed_cpu_s"] = found["timed_s"], found["timed_cpu_s"]
    result["timed_phases_s"] = {k.removeprefix("timing/"): round(v, 3) for k, v in timed.items()
                                if k.startswith("timing/") and k != "timing/step"}
    result["length_mean"] = timed["response/length_mean"]
    return result


def matmul_peaks(shape: dict, dtype: str, prompt_len: float) -> dict[str, float | None]:
    """`polyrl bench grpo`'s plain-matmul peak of the model's training shapes, best of 30 (wall),
    and where torch runs one thread the same in process CPU time, which other jobs on the
    machine inflate less (the decode breakdown of benchmarks/rollout.py measures so too)."""
    from grpo import COMPLETION_TOKENS, PROMPTS, SAMPLES, flop_shape, matmul_peak

    args = (flop_shape(shape), PROMPTS * SAMPLES * round(prompt_len + COMPLETION_TOKENS), getattr(torch, dtype))
    one_thread = torch.get_num_threads() == 1
    return {"wall": matmul_peak(*args, reps=30),
            "cpu_time": matmul_peak(*args, reps=30, clock=time.process_time) if one_thread else None}


def best_peaks(*measured: dict) -> dict[str, float | None]:
    """The higher of each peak over several measurements (before and after the step: a busy
    machine lowers a measurement, never raises it)."""
    return {k: max((m[k] for m in measured if m[k] is not None), default=None) for k in measured[0]}


def summarize(result: dict, shape: dict, dtype: str, prompt_len: float, peaks: dict) -> dict[str, Any]:
    """The JSON object: ms and share per group (step and per phase), matmul GFLOP/s per phase
    against the peak, the step's roofline fraction (timed step, as `polyrl bench grpo`; also in
    CPU seconds against the CPU-time peak at one thread)."""
    from grpo import flop_shape, step_flops

    peak = peaks["wall"]
    step_ms = result["step_ms"]
    groups = {g: round(sum(result["ms"][p][g] for p in PHASES), 2) for g in GROUPS}
    phases = {}
    for phase in PHASES:
        total = sum(result["ms"][phase].values())
        matmul_ms = result["ms"][phase]["matmul"]
        gflop_s = result["matmul_flops"][phase] / 1e9 / (matmul_ms / 1e3) if matmul_ms else None
        phases[phase] = {"ms": round(total, 2), "share_of_step": round(total / step_ms, 4),
                         "groups_ms": {g: round(v, 2) for g, v in result["ms"][phase].items()},
                         "matmul_gflop": round(result["matmul_flops"][phase] / 1e9, 2),
                         "matmul_gflop_s": round(gflop_s, 1) if gflop_s else None,
                         "matmul_fraction_of_peak": round(gflop_s * 1e9 / peak, 3) if gflop_s else None}
    update = phases["update"]
    back = result["update_backward_matmul"]
    fwd_ms, fwd_flops = result["ms"]["update"]["matmul"] - back["ms"], result["matmul_flops"]["update"] - back["flops"]
    for part, part_ms, part_flops in (("forward", fwd_ms, fwd_flops), ("backward", back["ms"], back["flops"])):
        rate = part_flops / (part_ms / 1e3) if part_ms > 0 else None
        update[f"matmul_{part}_ms"] = round(part_ms, 2)
        update[f"matmul_{part}_gflop_s"] = round(rate / 1e9, 1) if rate else None
        update[f"matmul_{part}_fraction_of_peak"] = round(rate / peak, 3) if rate else None
    matmul_ms = groups["matmul"]
    all_flops = sum(result["matmul_flops"].values())
    flops = step_flops(flop_shape(shape), prompt_len, result["length_mean"])
    return {
        "dtype": dtype, "torch_threads": torch.get_num_threads(),
        "profiled_step_ms": round(step_ms, 2), "outside_step_ms": round(result["outside_step_ms"], 2),
        "groups_ms": groups, "groups_share": {g: round(v / step_ms, 4) for g, v in groups.items()},
        "phases": phases,
        "matmul": {"gflop": round(all_flops / 1e9, 2),
                   "gflop_s": round(all_flops / 1e9 / (matmul_ms / 1e3), 1) if matmul_ms else None,
                   "peak_gflop_s": round(peak / 1e9, 1),
                   "fraction_of_peak": round(all_flops / (matmul_ms / 1e3) / peak, 3) if matmul_ms else None},
        "timed_step_s": round(result["timed_step_s"], 3), "timed_cpu_s": round(result["timed_cpu_s"], 3),
        "timed_phases_s": result["timed_phases_s"],
        "step_gflop": round(flops / 1e9, 1),
        "roofline_fraction": round(flops / result["timed_step_s"] / peak, 3),
        "peak_cpu_time_gflop_s": round(peaks["cpu_time"] / 1e9, 1) if peaks["cpu_time"] else None,
        "roofline_fraction_cpu_time": (round(flops / result["timed_cpu_s"] / peaks["cpu_time"], 3)
                                       if peaks["cpu_time"] else None),
        # the matmuls' share of the profiled step applied to the timed step's CPU seconds: their
        # rate in CPU time, an estimate that holds where other jobs preempt all ops alike
        "matmul_fraction_of_peak_cpu_time_est": (
            round(all_flops / (groups["matmul"] / step_ms * result["timed_cpu_s"]) / peaks["cpu_time"], 3)
            if peaks["cpu_time"] and groups["matmul"] else None),
        "length_mean": round(result["length_mean"], 2),
        "top_other_ops_ms": result["top_other_ops_ms"],
    }


def print_table(summary: dict) -> None:
    phases = summary["phases"]
    print(f"{'group':>18} | " + " | ".join(f"{p:>9} ms" for p in PHASES) + f" | {'step ms':>9} | share")
    for group in GROUPS:
        cells = " | ".join(f"{phases[p]['groups_ms'][group]:12.1f}" for p in PHASES)
        print(f"{group:>18} | {cells} | {summary['groups_ms'][group]:9.1f} | {summary['groups_share'][group]:6.1%}")
    totals = " | ".join(f"{phases[p]['ms']:12.1f}" for p in PHASES)
    print(f"{'total':>18} | {totals} | {summary['profiled_step_ms']:9.1f} | 100.0%")
    m = summary["matmul"]
    for phase in ("generate", "update"):
        p = phases[phase]
        if p["matmul_gflop_s"]:
            print(f"matmul in {phase}: {p['matmul_gflop']} GFLOP at {p['matmul_gflop_s']} GFLOP/s "
                  f"= {p['matmul_fraction_of_peak']:.2f} of the peak" + (
                      f" (forward {p['matmul_forward_gflop_s']}, backward {p['matmul_backward_gflop_s']} GFLOP/s)"
                      if phase == "update" else ""))
    print(f"matmul in the step: {m['gflop']} GFLOP at {m['gflop_s']} GFLOP/s; peak {m['peak_gflop_s']} GFLOP/s "
          f"(plain F.linear, the model's training shapes) -> {m['fraction_of_peak']:.2f}")
    print(f"timed step (no profiler): {summary['timed_step_s']:.2f} s ({summary['timed_cpu_s']:.2f} CPU-s), "
          f"phases {summary['timed_phases_s']}; {summary['step_gflop']} GFLOP/step -> roofline fraction "
          f"{summary['roofline_fraction']:.2f}" + (
              f"; in CPU time {summary['roofline_fraction_cpu_time']:.2f} of {summary['peak_cpu_time_gflop_s']} GFLOP/s"
              if summary["roofline_fraction_cpu_time"] is not None else ""))
    if summary["matmul_fraction_of_peak_cpu_time_est"] is not None:
        print(f"matmuls: {summary['groups_share']['matmul']:.0%} of the profiled step; of the timed step's "
              f"CPU seconds that is {summary['matmul_fraction_of_peak_cpu_time_est']:.2f} of the CPU-time peak "
              f"(estimate); the rest of the step is the gap to the peak")
    print("other, top ops (ms):", json.dumps(summary["top_other_ops_ms"]))


def main(argv: list[str] | None = None) -> int:
    """`polyrl bench grpo --profile SIZE:DTYPE` (= `polyrl bench grpo_profile SIZE:DTYPE`)."""
    import argparse
    import logging

    from _contention import machine
    from _tiny import build_model
    from grpo import SHAPES, _rows

    from polyrl.data.synthetic import write_arithmetic_dataset

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", metavar="SIZE:DTYPE", help="e.g. 30M:bfloat16")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    name, _, dtype = args.case.partition(":")
    if name not in SHAPES or dtype not in ("float32", "bfloat16"):
        parser.error(f"--profile {args.case!r}: expected SIZE:DTYPE with SIZE in {list(SHAPES)} "
                     "and DTYPE float32 or bfloat16")
    threads = args.threads
    logging.getLogger("polyrl").setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    header = machine()
    print(f"{header['date']}; {header['cpu']}; flags {' '.join(header['cpu_flags']) or 'none'}; "
          f"{header['cores']} cores; load average {header['load_average']}; torch {torch.__version__}, "
          f"{threads} torch thread(s)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        files = write_arithmetic_dataset(Path(tmp) / "data", n_train=512, n_val=16, seed=0)
        prompt_len = mean(len(r["prompt"][0]["content"]) for r in _rows(files["train"]))  # 1 token/char
        params = build_model(str(Path(tmp) / name), SHAPES[name])
        torch.set_num_threads(threads)
        before = matmul_peaks(SHAPES[name], dtype, prompt_len)
        result = profile_step(str(Path(tmp) / name), files, Path(tmp) / "run", dtype, threads)
        peaks = best_peaks(before, matmul_peaks(SHAPES[name], dtype, prompt_len))
    summary = {**header, "load_average_end": [round(x, 2) for x in os.getloadavg()], "size": name,
               "params": params, **summarize(result, SHAPES[name], dtype, prompt_len, peaks)}
    print(f"{name} ({params / 1e6:.1f}M) {dtype}: one GRPO step under torch.profiler "
          f"(self time per op, wall ms of the recording thread)")
    print_table(summary)
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
