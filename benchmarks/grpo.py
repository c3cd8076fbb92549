"""GRPO step time: polyrl's Trainer vs TRL's `GRPOTrainer` on CPU, same models, same run.

Both train the same random-init Qwen2 models (~4M and ~30M parameters, `benchmarks/_tiny.py`) on the
same synthetic arithmetic prompts (`polyrl.data.synthetic`, verl schema) with the same reward
(polyrl's "arithmetic" scorer; a TRL reward function doing the same exact-match-after-EOS check),
the same batch (8 prompts x 8 samples, one optimizer step per batch), the same completion limit
(32 tokens; a random model almost never samples EOS, so nearly every completion has all 32; both
mean lengths are reported), the same learning rate, no reference model / KL (polyrl's default; TRL
beta=0), in fp32 and in bf16 (polyrl: rollout.dtype=bfloat16 actor.compute_dtype=bfloat16; TRL:
bf16=True), the same torch thread count (`--threads`, default all cores).

polyrl runs in this process (hybrid placement, native engine, one rank on a local Ray instance);
the two trainers take turns, one step each (TRL step k, then polyrl step k), so both see the same
machine conditions. Seconds per step is the mean over steps 2..N (step 1 is warm-up): for polyrl
the `Trainer.train_step` call, for TRL the time from the end of the previous step (once polyrl's
step has run) to the end of this one. Also reported: the median, CPU seconds per step (this process
plus polyrl's policy worker, every thread; with --threads 1 it matches wall time on an idle machine
and barely moves on a busy one), each side's phases (generate / rest), the matmul FLOPs a step
cannot avoid and the fraction of plain-matmul peak each side reaches (`roofline_fraction`).

    python benchmarks/grpo.py                    # = polyrl bench grpo: ~3 min on an idle 2-core machine
    python benchmarks/grpo.py --quick --json     # ~1 min (4M only, 4 steps); last line is JSON
    python benchmarks/grpo.py --threads 1        # steadier on a busy machine (and CPU-s ~ wall)
    python benchmarks/grpo.py --contention       # every second step beside one busy process (pinned to a core)
    python benchmarks/grpo.py --sizes moe        # the mixture-of-experts cell (a ~32M / ~7.5M-active Qwen3-MoE)

`--contention`: in the same run, every second step (TRL's and polyrl's) beside one busy
competitor process pinned to the last core (`benchmarks/_contention.py`), started before TRL's step
and stopped after polyrl's: step 1 warms up, then idle and loaded steps alternate, so the other
load on the machine drifts over both alike. Per cell `speedup_under_contention` (TRL's s/step over
polyrl's, both on the loaded steps) and `kept_fraction` (polyrl's idle s/step over its loaded
s/step); the idle columns are the idle steps; the date, CPU, flags and load average come with
the JSON.

Needs TRL (`pip install -e .[bench]`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import resource
import sys
import tempfile
import time
import warnings
from pathlib import Path
from statistics import mean, median

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from _moe import MOE_MODELS  # noqa: E402
from _tiny import EOS_ID, MODELS, build_model  # noqa: E402

SHAPES = {**MODELS, "moe": MOE_MODELS["moe"]}
"""`--sizes`: the dense 4M and 30M, and `moe` (benchmarks/_moe.py: a Qwen3-MoE of ~32M total /
~7.5M active parameters, 16 experts, top-2)."""


def flop_shape(shape: dict) -> dict:
    """The dense shape whose matmul FLOPs per token equal `shape`'s: an MoE's k experts as one MLP
    of k x moe_intermediate_size (the router's E x h is negligible)."""
    if "num_experts" not in shape:
        return shape
    return {**shape, "intermediate_size": shape["num_experts_per_tok"] * shape["moe_intermediate_size"]}

PROMPTS, SAMPLES, COMPLETION_TOKENS, LR = 8, 8, 32, 1e-6


def cpu_seconds() -> float:
    """CPU time (user + system) of this process, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ----------------------------------------------------------------------------- polyrl
def polyrl_config(model_dir: str, files: dict, out: Path, dtype: str, steps: int, threads: int):
    from polyrl.config import load_config
    from polyrl.job import JobConfig

    overrides = [
        f"model.path={model_dir}", f"data.train_files=[{files['train']}]", "data.val_files=[]",
        f"data.train_batch_size={PROMPTS}", f"rollout.n={SAMPLES}",
        f"rollout.response_length={COMPLETION_TOKENS}", f"actor.lr={LR}",
        f"trainer.total_steps={steps}", "trainer.val_before_train=false", "trainer.val_every=0",
        "trainer.save_at_end=false", "trainer.progress_bar=false", f"trainer.output_dir={out}",
        f"actor.num_cpus_per_worker={threads}",
    ]
    if dtype == "bfloat16":
        overrides += ["rollout.dtype=bfloat16", "actor.compute_dtype=bfloat16"]
    return load_config(JobConfig, overrides=overrides)


class Steps:
    """Per-step wall and CPU seconds of one side."""

    def __init__(self):
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def summary(self, **extra) -> dict:
        return dict(s_per_step=mean(self.wall[1:]), median_s=median(self.wall[1:]),
                    cpu_s=mean(self.cpu[1:]) if self.cpu else float("nan"),
                    step_s=[round(t, 2) for t in self.wall if t == t], **extra)  # not pick's placeholder

    def pick(self, steps: list[int]) -> "Steps":
        """Only `steps` (indices), behind a placeholder warm-up entry (`summary` skips the first)."""
        out = Steps()
        out.wall = [float("nan")] + [self.wall[i] for i in steps]
        out.cpu = [float("nan")] + [self.cpu[i] for i in steps] if self.cpu else []
        return out


# ----------------------------------------------------------------------------- TRL
def arithmetic_reward(prompts, completions, ground_truth, completion_ids, **_):
    """polyrl's arithmetic scorer: the EOS-terminated completion must equal the answer."""
    from polyrl.rewards.arithmetic import arithmetic_score

    out = []
    for completion, truth, ids in zip(completions, ground_truth, completion_ids):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        out.append(arithmetic_score(text, truth, finished_with_eos=bool(ids) and ids[-1] == EOS_ID))
    return out


def _trl_config(out: Path, dtype: str, steps: int):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out / "trl"), max_steps=steps, learning_rate=LR, lr_scheduler_type="constant",
        adam_beta2=0.99, max_grad_norm=1.0, weight_decay=0.0, seed=0,
        per_device_train_batch_size=PROMPTS * SAMPLES, gradient_accumulation_steps=1,
        num_generations=SAMPLES, generation_batch_size=PROMPTS * SAMPLES, num_iterations=1,
        max_completion_length=COMPLETION_TOKENS, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, use_vllm=False, use_cpu=True, bf16=dtype == "bfloat16", fp16=False,
        gradient_checkpointing=False, save_strategy="no", report_to="none", logging_steps=1,
        disable_tqdm=True, log_completions=False, dataloader_num_workers=0,
    )


def _rows(path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def run_pair(model_dir: str, files: dict, out: Path, dtype: str, steps: int, threads: int,
             contended: bool = False) -> tuple[dict, dict]:
    """polyrl's `Trainer.fit()` in this thread; TRL's `GRPOTrainer.train()` in a second one, let
    through one step at a time: before polyrl's step k, TRL runs its step k, so both see the same
    machine conditions. A TRL step is timed from its go-ahead to its `on_step_end`: the previous
    step's logging, data, generation, scoring, loss, backward and optimizer step.
    `contended`: steps 3, 5, ... (TRL's and polyrl's) run beside a busy competitor; each side's
    summary is over the idle steps 2, 4, ..., and its "loaded" entry over the others.
    """
    import threading

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOTrainer

    from _contention import competitor
    from polyrl.trainer.loop import Trainer
    from polyrl.training.model_loading import load_tokenizer

    hf_logging.disable_progress_bar()
    torch.set_num_threads(threads)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]}
                                 for r in _rows(files["train"])])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        config = _trl_config(out, dtype, steps)
    ours, theirs = Steps(), Steps()
    records: list[dict] = []
    generate_s: list[float] = []
    history: list[dict] = []
    loaded: list[bool] = []  # per step: beside the competitor
    go, done = threading.Semaphore(0), threading.Semaphore(0)
    stop = threading.Event()
    failure: list[BaseException] = []
    timeout = 1800.0

    class Gate(TrainerCallback):
        """Holds TRL before each step until polyrl's side lets it go."""

        def wait(self, control) -> None:
            if not go.acquire(timeout=timeout) or stop.is_set():
                control.should_training_stop = True
            self.start, self.start_cpu = time.perf_counter(), cpu_seconds()

        def on_train_begin(self, args, state, control, **kwargs):
            self.wait(control)

        def on_step_end(self, args, state, control, **kwargs):
            theirs.wall.append(time.perf_counter() - self.start)
            theirs.cpu.append(cpu_seconds() - self.start_cpu)  # polyrl's side waits meanwhile
            done.release()
            if state.global_step < args.max_steps:
                self.wait(control)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                history.append(dict(logs))

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        trl = GRPOTrainer(model=model, reward_funcs=arithmetic_reward, args=config, train_dataset=dataset,
                          processing_class=load_tokenizer(model_dir), callbacks=[Gate()])
    generate = getattr(trl, "_generate_single_turn", None)  # TRL >= 1.0; timed like timing/generate

    def timed_generate(*args, **kwargs):
        start = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            generate_s.append(time.perf_counter() - start)

    if generate is not None:
        trl._generate_single_turn = timed_generate

    def run_trl() -> None:
        torch.set_num_threads(threads)
        try:
            # the HF Trainer prints every log dict; TRL's deprecation warnings are none of ours
            with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                trl.train()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            failure.append(exc)
        finally:
            done.release()  # never leave polyrl's side waiting

    class Alternating(Trainer):
        def setup(self):
            super().setup()
            import psutil
            import ray

            worker = self.policy.workers[0]  # its engine generates too (hybrid placement)
            self.worker = psutil.Process(ray.get(worker.__ray_call__.remote(lambda _: os.getpid())))

        def cpu_seconds(self) -> float:
            """CPU time of this process and of the policy worker, every thread of each."""
            worker = self.worker.cpu_times()
            return cpu_seconds() + worker.user + worker.system

        def train_step(self, step):
            loaded.append(contended and len(loaded) % 2 == 0 and len(loaded) > 0)
            with competitor("pinned") if loaded[-1] else contextlib.nullcontext():
                go.release()
                if not done.acquire(timeout=timeout) or failure:
                    raise RuntimeError("TRL's step failed or timed out") from (failure[0] if failure else None)
                start, cpu = time.perf_counter(), self.cpu_seconds()
                metrics = super().train_step(step)
                ours.wall.append(time.perf_counter() - start)
                ours.cpu.append(self.cpu_seconds() - cpu)
            records.append(metrics)
            return metrics

    thread = threading.Thread(target=run_trl, name="trl", daemon=True)
    thread.start()
    try:
        Alternating(polyrl_config(model_dir, files, out / "polyrl", dtype, steps, threads)).fit()
    finally:
        stop.set()
        go.release()
        thread.join(timeout=60)
    if failure:
        raise failure[0]

    def sides(steps: list[int]) -> tuple[dict, dict]:
        """Both sides' summaries over `steps` (indices; 0, the warm-up, never among them)."""
        phases = {k.removeprefix("timing/"): round(mean(records[i][k] for i in steps), 3)
                  for k in records[0] if k.startswith("timing/") and k != "timing/step"}
        polyrl_side = ours.pick(steps).summary(length_mean=mean(r["response/length_mean"] for r in records),
                                               phases=phases)
        phases = {}
        if len(generate_s) == len(theirs.wall):
            trl_generate = mean(generate_s[i] for i in steps)
            phases = {"generate": round(trl_generate, 3),
                      "rest": round(mean(theirs.wall[i] for i in steps) - trl_generate, 3)}
        trl_side = theirs.pick(steps).summary(length_mean=mean(m["completions/mean_length"] for m in history),
                                              phases=phases)
        return polyrl_side, trl_side

    polyrl_side, trl_side = sides([i for i in range(1, len(loaded)) if not loaded[i]])
    if contended:
        polyrl_side["loaded"], trl_side["loaded"] = sides([i for i in range(1, len(loaded)) if loaded[i]])
    return polyrl_side, trl_side


# ----------------------------------------------------------------------------- FLOPs
def step_flops(shape: dict, prompt_len: float, response_len: float) -> float:
    """Matmul FLOPs one GRPO step cannot avoid: generation (prompt prefill once per prompt, a
    forward per generated token but the last), then forward + backward (3x forward) of every
    sample over prompt + response minus its last token, logits only at response positions."""
    H, I, V, layers = (shape[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers"))
    kv = shape["num_key_value_heads"] * H // shape["num_attention_heads"]
    body = 2 * layers * (H * (H + 2 * kv) + H * H + 3 * H * I)  # per token
    head = 2 * V * H

    def attn(first: float, last: float) -> float:  # QK^T and AV over contexts first..last
        return 2 * 2 * layers * H * (first + last) / 2 * max(last - first + 1, 0)

    p, r, samples = prompt_len, response_len, PROMPTS * SAMPLES
    generate = PROMPTS * (body * p + attn(1, p) + head) + samples * ((body + head) * (r - 1) + attn(p + 1, p + r - 1))
    train = 3 * samples * (body * (p + r - 1) + attn(1, p + r - 1) + head * r)
    return generate + train


def matmul_peak(shape: dict, tokens: int, dtype: torch.dtype, reps: int = 5, clock=time.perf_counter) -> float:
    """FLOP/s of plain F.linear calls with the model's training-forward shapes, best of `reps`
    (`clock`: time.process_time at one thread counts other jobs' time less)."""
    import torch.nn.functional as F

    H, I, V = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = shape["num_key_value_heads"] * H // shape["num_attention_heads"]
    weights = [torch.randn(o, i, dtype=dtype) * 0.02 for o, i in ((H + 2 * kv, H), (H, H), (2 * I, H), (H, I), (V, H))]
    xs = {i: torch.randn(tokens, i, dtype=dtype) for i in (H, I)}
    flops = 2 * tokens * sum(w.numel() for w in weights)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps):
            start = clock()
            for w in weights:
                F.linear(xs[w.shape[1]], w)
            best = min(best, clock() - start)
    return flops / best


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--quick", action="store_true", help="4M model only, fewer steps (~3 minutes)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run, the first is warm-up")
    parser.add_argument("--sizes", default=None, help="comma-separated model sizes (4M,30M,moe)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="torch threads of each trainer (default: all cores)")
    parser.add_argument("--contention", action="store_true",
                        help="every second step beside one busy process pinned to a core (idle and "
                             "loaded steps alternate in one run)")
    parser.add_argument("--profile", metavar="SIZE:DTYPE", default=None,
                        help="instead: where one step's time goes, e.g. 30M:bfloat16 (benchmarks/grpo_profile.py)")
    args = parser.parse_args(argv)
    if args.profile:
        from grpo_profile import main as profile_main

        return profile_main([args.profile, f"--threads={args.threads}", *(["--json"] if args.json else [])])
    sizes = (args.sizes or ("4M" if args.quick else "4M,30M")).split(",")
    dtypes = args.dtypes.split(",")
    for name in sizes:
        if name not in SHAPES:
            parser.error(f"unknown size {name}; choose from {', '.join(SHAPES)}")
    try:
        import trl
    except ImportError:
        print("polyrl bench grpo needs TRL: pip install -e .[bench]", file=sys.stderr)
        return 2
    from polyrl.data.synthetic import write_arithmetic_dataset

    logging.getLogger("polyrl").setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"note: load average {load:.1f} on {cores} cores before the start; other processes skew "
              f"step times (alternating steps keeps the ratio fair; --threads 1 keeps it steadier)", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        files = write_arithmetic_dataset(Path(tmp) / "data", n_train=512, n_val=16, seed=0)
        prompt_len = mean(len(r["prompt"][0]["content"]) for r in _rows(files["train"]))  # 1 token/char
        for name in sizes:
            steps = args.steps or (4 if args.quick else {"4M": 6}.get(name, 4))
            model_dir = str(Path(tmp) / name)
            params = build_model(model_dir, SHAPES[name])
            for dtype in dtypes:
                ours, theirs = run_pair(model_dir, files, Path(tmp) / f"{name}-{dtype}", dtype,
                                        1 + 2 * (steps - 1) if args.contention else steps, args.threads,
                                        contended=args.contention)
                row = dict(params=params, dtype=dtype, polyrl_s_per_step=round(ours["s_per_step"], 3),
                           trl_s_per_step=round(theirs["s_per_step"], 3),
                           speedup=round(theirs["s_per_step"] / ours["s_per_step"], 2),
                           steps_measured=steps - 1,
                           polyrl_median_s=round(ours["median_s"], 3), trl_median_s=round(theirs["median_s"], 3),
                           median_speedup=round(theirs["median_s"] / ours["median_s"], 2),
                           polyrl_cpu_s_per_step=round(ours["cpu_s"], 3), trl_cpu_s_per_step=round(theirs["cpu_s"], 3),
                           cpu_speedup=round(theirs["cpu_s"] / ours["cpu_s"], 2),
                           polyrl_length_mean=round(ours["length_mean"], 2),
                           trl_length_mean=round(theirs["length_mean"], 2),
                           polyrl_phases_s=ours["phases"], trl_phases_s=theirs["phases"])
                flops = step_flops(flop_shape(SHAPES[name]), prompt_len, ours["length_mean"])
                peak = matmul_peak(flop_shape(SHAPES[name]), PROMPTS * SAMPLES * round(prompt_len + COMPLETION_TOKENS),
                                   getattr(torch, dtype))
                row.update(step_gflop=round(flops / 1e9, 1), matmul_peak_gflop_s=round(peak / 1e9, 1),
                           polyrl_roofline_fraction=round(flops / ours["s_per_step"] / peak, 3),
                           trl_roofline_fraction=round(flops / theirs["s_per_step"] / peak, 3))
                if args.contention:
                    row.update(under_contention(ours, theirs))
                results.append(row)
                print(f"{name:>4} {params / 1e6:5.1f}M {dtype:>8}: polyrl {row['polyrl_s_per_step']:6.2f} s/step | "
                      f"TRL {row['trl_s_per_step']:6.2f} s/step | speedup {row['speedup']:5.2f}x | "
                      f"median speedup {row['median_speedup']:5.2f}x | CPU-s/step {row['polyrl_cpu_s_per_step']:.2f} "
                      f"vs {row['trl_cpu_s_per_step']:.2f} ({row['cpu_speedup']:.2f}x) | "
                      f"mean length {row['polyrl_length_mean']:.1f} vs {row['trl_length_mean']:.1f}", flush=True)
                print(f"      polyrl steps (s): {ours['step_s']}, phases: {ours['phases']}", flush=True)
                print(f"      TRL steps (s):    {theirs['step_s']}, phases: {theirs['phases']}", flush=True)
                if args.contention:
                    contended = row["contention"]
                    print(f"      beside a busy process: polyrl {contended['polyrl_s_per_step']:6.2f} s/step "
                          f"(kept {row['kept_fraction']:.2f}) | TRL {contended['trl_s_per_step']:6.2f} s/step "
                          f"(kept {contended['trl_kept_fraction']:.2f}) | speedup {row['speedup_under_contention']:.2f}x; "
                          f"polyrl phases {contended['polyrl_phases_s']}", flush=True)
                print(f"      {row['step_gflop']} GFLOP/step; matmul peak {row['matmul_peak_gflop_s']} GFLOP/s; "
                      f"roofline fraction polyrl {row['polyrl_roofline_fraction']:.2f}, "
                      f"TRL {row['trl_roofline_fraction']:.2f}", flush=True)
    print(f"workload: {PROMPTS} prompts x {SAMPLES} samples, <= {COMPLETION_TOKENS} completion tokens, "
          f"lr {LR}, beta 0, 1 optimizer step per batch; TRL {trl.__version__}, torch {torch.__version__}, "
          f"{args.threads} torch threads, {cores} cores, load average {load:.1f} at start, "
          f"{os.getloadavg()[0]:.1f} at end")
    if args.json:
        header = {}
        if args.contention:
            from _contention import machine

            header = {**machine(), "load_average_start": round(load, 2), "torch_threads": args.threads}
        print(json.dumps({**header, "results": results}))
    return 0


def under_contention(ours: dict, theirs: dict) -> dict:
    """The loaded steps of a `contended` pair against its idle ones."""
    loaded, trl_loaded = ours["loaded"], theirs["loaded"]
    return {"speedup_under_contention": round(trl_loaded["s_per_step"] / loaded["s_per_step"], 2),
            "kept_fraction": round(ours["s_per_step"] / loaded["s_per_step"], 2),
            "contention": {"polyrl_s_per_step": round(loaded["s_per_step"], 3),
                           "trl_s_per_step": round(trl_loaded["s_per_step"], 3),
                           "trl_kept_fraction": round(theirs["s_per_step"] / trl_loaded["s_per_step"], 2),
                           "polyrl_cpu_s_per_step": round(loaded["cpu_s"], 3),
                           "trl_cpu_s_per_step": round(trl_loaded["cpu_s"], 3),
                           "polyrl_step_s": loaded["step_s"], "trl_step_s": trl_loaded["step_s"],
                           "polyrl_phases_s": loaded["phases"], "trl_phases_s": trl_loaded["phases"]}}


if __name__ == "__main__":
    sys.exit(main())
