"""Asynchronous against synchronous standalone training, same resources, same task, one run.

Both train the embedded default (`polyrl/configs/embedded_default.yaml`: the bundled tiny model
learning 2-digit addition, 40 steps of 16 prompts x 8 samples) with standalone placement, one
policy rank and one rollout replica, one torch thread each (`--threads`), on one local Ray
instance started here. sync generates, then trains, each step; async (`trainer.mode=async`,
`async.max_staleness` = `--staleness`, partial rollouts `--partial`) lets the replica generate
the next batches while the policy trains. The runs alternate (sync, async, sync, ... for
`--repeats` pairs) so both see the same machine load.

A third run per repeat, "sync, all cores", is sync with twice the threads per actor: the two
actors of sync never compute at the same time, so each phase may use the cores of both. It is
the strongest sync on the same machine, and `speedup_vs_sync_all_cores` compares async with it
(`--no-all-cores` skips it).

`--workload dapo` adds DAPO dynamic sampling (`WORKLOADS`): a generation-heavy step, several
generation rounds per update once the model is mostly right; `generate_fraction` is sync's
generation seconds / training-step seconds.

Reported per mode (median over repeats): samples/s = trained samples / the summed seconds of the
training steps (validation is excluded, it is the same work in both modes); seconds of training
steps until held-out accuracy first reaches `--target` (validation every 5 steps); the final and
best held-out accuracy; async's mean staleness, trainer idle and partial-rollout count.

    python benchmarks/async.py             # = polyrl bench async: ~3 min on an idle 2-core machine
    python benchmarks/async.py --json      # last line is JSON
    python benchmarks/async.py --repeats 3 # steadier on a busy machine
    python benchmarks/async.py --workload dapo --max-rounds 16 --no-all-cores --json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


WORKLOADS = {
    "default": lambda args: [],
    # DAPO dynamic sampling (arXiv:2503.14476 sec. 3.2, polyrl/algorithms/dynamic_sampling.py):
    # groups whose 8 samples all get the same reward are dropped and more prompts are generated
    # until the step has data.train_batch_size informative groups. As the model learns, most
    # groups are all-correct, so a step generates several rounds for one update: generation
    # dominates the way it does in real runs, with the model's own (short) answers, no forced
    # lengths.
    # async.groups_per_request = the train batch: the replica then decodes as many sequences at a
    # time as a sync round does (the default 4 groups per call decodes 4 x n at a time, which on
    # CPU costs nearly as much per step as 16 x n: decode of a tiny model is overhead-bound)
    "dapo": lambda args: ["algorithm.dynamic_sampling=true",
                          f"algorithm.max_sampling_rounds={args.max_rounds}",
                          f"async.groups_per_request={args.groups_per_request}"],
}
"""--workload -> extra overrides."""

RUNS = {"sync": ("sync", 1), "async": ("async", 1), "sync_all_cores": ("sync", 2)}
"""Run name -> (trainer.mode, threads per actor as a multiple of --threads)."""


def config(out: Path, run: str, args: argparse.Namespace):
    from polyrl.cli.train import EMBEDDED_DEFAULT
    from polyrl.config import load_config
    from polyrl.job import JobConfig

    mode, factor = RUNS[run]
    overrides = [
        "rollout.placement=standalone", "rollout.num_replicas=1", "actor.world_size=1",
        f"actor.num_cpus_per_worker={args.threads * factor}", f"trainer.mode={mode}",
        f"trainer.total_steps={args.steps}", "trainer.progress_bar=false", "trainer.save_at_end=false",
        "logging.plot_at_end=false", f"trainer.output_dir={out}", f"trainer.seed={args.seed}",
    ]
    if mode == "async":
        overrides += [f"async.max_staleness={args.staleness}", f"async.partial_rollout={args.partial}"]
    overrides += WORKLOADS[args.workload](args)
    if args.n:
        overrides.append(f"rollout.n={args.n}")
    return load_config(JobConfig, files=[EMBEDDED_DEFAULT], overrides=overrides)


def run_once(run: str, args: argparse.Namespace, root: Path, index: int) -> dict:
    from polyrl.trainer.loop import Trainer

    out = root / f"{run}-{index}"
    cfg = config(out, run, args)
    mode = cfg.trainer.mode
    t0 = time.perf_counter()
    summary = Trainer(cfg).fit()
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "timing/step" in r]
    train_s = sum(r["timing/step"] for r in steps)
    # samples each step trained on (perf/samples_per_s = len(batch) / timing/step): with dynamic
    # sampling a step may train on fewer than train_batch_size x n when rounds ran out
    samples = sum(round(r["perf/samples_per_s"] * r["timing/step"]) for r in steps)
    elapsed, to_target = 0.0, None
    vals = [r.get("val/acc") for r in rows if "val/acc" in r]
    for r in rows:
        elapsed += r.get("timing/step", 0.0)
        if to_target is None and r.get("val/acc", -1) >= args.target and r["step"] > 0:
            to_target = elapsed
    out_row = {"samples_per_s": samples / train_s, "train_s": train_s, "wall_s": wall,
               "to_target_s": to_target, "final_acc": summary["final_accuracy"],
               "best_acc": max(vals) if vals else None, "initial_acc": summary["initial_accuracy"]}
    for phase in ("generate", "update", "sync_weights"):  # per-step medians (async generate = waiting)
        out_row[f"{phase}_s"] = median(r.get(f"timing/{phase}", 0.0) for r in steps)
        out_row[f"{phase}_mean_s"] = sum(r.get(f"timing/{phase}", 0.0) for r in steps) / len(steps)
    # the share of a step spent generating (summed over the run: dapo's rounds vary by step)
    out_row["generate_fraction"] = sum(r.get("timing/generate", 0.0) for r in steps) / train_s
    out_row["sampling_rounds_mean"] = sum(r.get("dynamic_sampling/rounds", 1.0) for r in steps) / len(steps)
    if mode == "async":
        out_row["staleness_mean"] = sum(r["async/staleness_mean"] for r in steps) / len(steps)
        out_row["trainer_idle_s"] = sum(r["async/trainer_idle_s"] for r in steps)
        out_row["partial_rollouts"] = steps[-1]["async/partial_rollouts_total"]
        out_row["discarded_stale"] = steps[-1]["async/discarded_stale_total"]
    return out_row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    p.add_argument("--repeats", type=int, default=1, help="sync/async pairs to run (median reported)")
    p.add_argument("--steps", type=int, default=40, help="training steps per run")
    p.add_argument("--threads", type=int, default=1, help="torch threads per actor")
    p.add_argument("--staleness", type=int, default=1, help="async.max_staleness")
    p.add_argument("--partial", choices=["abort", "wait"], default="abort", help="async.partial_rollout")
    p.add_argument("--target", type=float, default=0.9, help="held-out accuracy to time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="default",
                   help="default: the embedded task as is; dapo: with DAPO dynamic sampling "
                        "(generation-heavy, see WORKLOADS)")
    p.add_argument("--n", type=int, default=0, help="rollout.n (samples per prompt); 0 = the task's 8")
    p.add_argument("--groups-per-request", type=int, default=16,
                   help="dapo: async.groups_per_request (16 = the task's train batch)")
    p.add_argument("--max-rounds", type=int, default=8, help="dapo: algorithm.max_sampling_rounds")
    p.add_argument("--no-all-cores", dest="all_cores", action="store_false",
                   help="skip the 'sync, all cores' run (sync with twice the threads per actor)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    import ray

    from polyrl.distributed.ray_launch import init_ray
    from polyrl.platform import get_platform

    runs = ["sync", "async"] + (["sync_all_cores"] if args.all_cores else [])
    # one Ray instance for every run: 2 actors x their threads, whatever the core count
    init_ray(get_platform("cpu"), num_cpus=max(os.cpu_count() or 1, 4 * args.threads),
             namespace="polyrl-bench-async")
    results: dict[str, list[dict]] = {run: [] for run in runs}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.repeats):
                for mode in runs:
                    row = run_once(mode, args, Path(tmp), i)
                    results[mode].append(row)
                    print(f"{mode:14s} run {i + 1}: {row['samples_per_s']:.0f} samples/s, "
                          f"{row['train_s']:.1f} s of steps, {row['to_target_s'] if row['to_target_s'] is None else round(row['to_target_s'], 1)} s "
                          f"to {args.target:.0%}, final acc {row['final_acc']:.3f}; per step: generate "
                          f"{row['generate_s']:.3f} s, update {row['update_s']:.3f} s, weight sync "
                          f"{row['sync_weights_s']:.3f} s; generate fraction {row['generate_fraction']:.2f}, "
                          f"sampling rounds {row['sampling_rounds_mean']:.2f}", flush=True)
    finally:
        ray.shutdown()

    def med(mode: str, key: str):
        values = [r[key] for r in results.get(mode, []) if r.get(key) is not None]
        return median(values) if values else None

    summary = {
        "sync_samples_per_s": med("sync", "samples_per_s"),
        "async_samples_per_s": med("async", "samples_per_s"),
        "sync_to_target_s": med("sync", "to_target_s"),
        "async_to_target_s": med("async", "to_target_s"),
        "sync_final_accuracy": med("sync", "final_acc"),
        "async_final_accuracy": med("async", "final_acc"),
        "sync_best_accuracy": med("sync", "best_acc"),
        "async_best_accuracy": med("async", "best_acc"),
        "async_staleness_mean": med("async", "staleness_mean"),
        "async_trainer_idle_s": med("async", "trainer_idle_s"),
        "async_partial_rollouts": med("async", "partial_rollouts"),
        **{f"{m}_{phase}{kind}_s": med(m, f"{phase}{kind}_s") for m in ("sync", "async")
           for phase in ("generate", "update", "sync_weights") for kind in ("", "_mean")},
        "generate_fraction": med("sync", "generate_fraction"),
        "sync_sampling_rounds_mean": med("sync", "sampling_rounds_mean"),
        "async_samples_per_s_per_run": [r["samples_per_s"] for r in results["async"]],
        "sync_samples_per_s_per_run": [r["samples_per_s"] for r in results["sync"]],
        "workload": args.workload, "rollout_n": args.n or 8, "max_rounds": args.max_rounds,
        "groups_per_request": args.groups_per_request,
        "target_accuracy": args.target, "steps": args.steps, "repeats": args.repeats,
        "threads": args.threads, "max_staleness": args.staleness, "partial_rollout": args.partial,
        "load_average": os.getloadavg()[0],
    }
    summary["speedup"] = summary["async_samples_per_s"] / summary["sync_samples_per_s"]
    if args.all_cores:
        summary.update({f"sync_all_cores_{k}": med("sync_all_cores", key) for k, key in (
            ("samples_per_s", "samples_per_s"), ("to_target_s", "to_target_s"),
            ("final_accuracy", "final_acc"), ("generate_s", "generate_s"), ("update_s", "update_s"))})
        summary["speedup_vs_sync_all_cores"] = (summary["async_samples_per_s"]
                                                / summary["sync_all_cores_samples_per_s"])
    # Amdahl: hiding all of sync's generation behind its update is the most overlap can give.
    # From per-step means (totals over the run), not medians: with dynamic sampling the rounds,
    # and so the generation time, differ from step to step.
    gen = summary["sync_generate_mean_s"]
    rest = summary["sync_update_mean_s"] + summary["sync_sync_weights_mean_s"]
    summary["overlap_bound"] = (gen + rest) / max(gen, rest)
    if summary["sync_to_target_s"] and summary["async_to_target_s"]:
        summary["to_target_speedup"] = summary["sync_to_target_s"] / summary["async_to_target_s"]
    print(f"\nsamples/s: sync {summary['sync_samples_per_s']:.0f}, async {summary['async_samples_per_s']:.0f} "
          f"(speedup {summary['speedup']:.2f}x, overlap bound {summary['overlap_bound']:.2f}x, "
          f"generate fraction {summary['generate_fraction']:.2f}); final accuracy: sync {summary['sync_final_accuracy']:.3f}, "
          f"async {summary['async_final_accuracy']:.3f}; load average {summary['load_average']:.1f}")
    if args.all_cores:
        print(f"sync, all cores: {summary['sync_all_cores_samples_per_s']:.0f} samples/s (async / it: "
              f"{summary['speedup_vs_sync_all_cores']:.2f}x), final accuracy "
              f"{summary['sync_all_cores_final_accuracy']:.3f}")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
