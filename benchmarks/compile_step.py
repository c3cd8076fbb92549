"""Two levers on the training step, measured in-process against today's step, same run.

One training step = `DDPEngine.forward` (log-probs + entropy metric, as the actor asks) of one
GRPO micro-batch, a policy-gradient loss, `backward`, `optimizer_step` (grad clip + AdamW), on the
30M random-init model of `benchmarks/_tiny.py` with `polyrl bench grpo`'s batch (8 prompts x 8
samples x 32 response tokens: one micro-batch), built by `benchmarks/logprobs.py`'s `update_case`.
Variants, each against `eager` (today's engine) on its own copy of the same weights:

- `compile`: the engine's forward under `torch.compile` (inductor; on CPU it generates C++ that
  fuses the element-wise work around the matmuls, and AOTAutograd compiles the backward). The
  first step's extra time is reported as compile seconds.
- `bf16-weights` (bf16 only): the casts lever's upper bound. Under autocast every forward casts
  each fp32 master weight to bf16 (autocast caches a cast only within one autocast region) and
  the backward casts each bf16 weight gradient back to fp32. Measured directly: the seconds of
  casting every trainable weight to bf16 and a bf16 tensor of each shape to fp32, once each, i.e.
  all a per-step bf16 weight cache could save per forward (`cast_s`, `cast_fraction` of the step).
  And, for scale, `bf16-params`: the model held in bf16 with fp32 master weights in AdamW and no
  autocast at all (no casts of weights or activations; a different numerics: the residual stream
  and norms run in bf16), with its log-prob difference to the autocast step.

Timing: median seconds per step over interleaved repetitions (eager, variant, eager, ...), so both
see the same machine load; `speedup` = eager / variant. Numerics: the max |difference| of the first
step's log-probs and the relative difference of its gradient norm against eager.

    python benchmarks/compile_step.py [--threads 1] [--reps 5] [--dtypes float32,bfloat16] [--json]
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from logprobs import cpu_flags, update_case  # noqa: E402


def _engine(model, dtype: str, compile_mode: str):
    """The engine as a run builds it, with `actor.compile` forced on or off."""
    from polyrl.platform import get_platform
    from polyrl.training.ddp import DDPEngine
    from polyrl.training.config import ActorConfig

    cfg = ActorConfig(compute_dtype=dtype, lr=1e-6, compile=compile_mode)
    return DDPEngine(model, cfg, get_platform("cpu"), torch.device("cpu"), horizon=10_000)


def _step(engine, mb, adv):
    """(seconds, log-probs, grad norm, the engine's compile seconds) of one forward + backward +
    optimizer step."""
    t0 = time.perf_counter()
    lp, _ = engine.forward(mb, with_entropy=True)
    loss = (lp * adv * mb.response_mask).sum() / mb.response_mask.sum()
    engine.backward(loss)
    res = engine.optimizer_step(float(loss.detach()))
    return time.perf_counter() - t0, lp.detach().float(), res.grad_norm, res.compile_s


class Bf16Params:
    """The model in bf16, fp32 master weights in AdamW, no autocast (for scale: another numerics)."""

    def __init__(self, model, platform):
        from polyrl.training.logprobs import response_logprobs

        self.master = [p for p in model.parameters() if p.requires_grad]
        self.model = copy.deepcopy(model).to(torch.bfloat16)
        self.work = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.master, lr=1e-6, betas=(0.9, 0.99), eps=1e-8, foreach=True)
        self.platform, self.head = platform, response_logprobs

    def step(self, mb, adv):
        t0 = time.perf_counter()
        with self.platform.training_attention(torch.bfloat16):
            lp, _ = self.head(self.model, mb, with_entropy=True)
        loss = (lp * adv * mb.response_mask).sum() / mb.response_mask.sum()
        loss.backward()
        for m, w in zip(self.master, self.work):
            m.grad = w.grad.float()
            w.grad = None
        norm = float(torch.nn.utils.clip_grad_norm_(self.master, 1.0))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, w in zip(self.master, self.work):
                w.copy_(m)
        return time.perf_counter() - t0, lp.detach().float(), norm, None


def _cast_seconds(model) -> float:
    """Seconds to cast every trainable weight to bf16 and a bf16 gradient of each back to fp32."""
    params = [p.detach() for p in model.parameters() if p.requires_grad]
    grads = [torch.zeros(p.shape, dtype=torch.bfloat16) for p in params]
    t0 = time.perf_counter()
    for p, g in zip(params, grads):
        p.to(torch.bfloat16)
        g.to(torch.float32)
    return time.perf_counter() - t0


def run_case(model_dir: str, dtype: str, reps: int) -> list[dict]:
    from polyrl.platform import get_platform

    (step, _), _ = update_case(model_dir, 8, 8, 32, dtype)
    # the model, micro-batch and advantages update_case built (its step closure holds them)
    held = inspect.getclosurevars(step).nonlocals
    model, mb, adv = held["model"], held["mb"], held["adv"]
    rows = []
    variants = {"compile": lambda: _engine(copy.deepcopy(model), dtype, "on")}
    if dtype == "bfloat16":
        variants["bf16-params"] = lambda: Bf16Params(copy.deepcopy(model), get_platform("cpu"))
    for name, build in variants.items():
        base = _engine(copy.deepcopy(model), dtype, "off")
        other = build()
        run_other = (lambda: other.step(mb, adv)) if isinstance(other, Bf16Params) else (lambda: _step(other, mb, adv))
        t_base0, lp_base, norm_base, _ = _step(base, mb, adv)
        t_other0, lp_other, norm_other, first_compile_s = run_other()
        times = {"eager": [], name: []}
        casts = []
        for _ in range(reps):
            times["eager"].append(_step(base, mb, adv)[0])
            times[name].append(run_other()[0])
            if dtype == "bfloat16":
                casts.append(_cast_seconds(model))
        row = {"dtype": dtype, "variant": name, "eager_s": median(times["eager"]),
               "variant_s": median(times[name]), "first_step_eager_s": t_base0, "first_step_variant_s": t_other0,
               "max_abs_logprob_diff": float((lp_base - lp_other).abs().max()),
               "grad_norm_rel_diff": abs(norm_base - norm_other) / max(abs(norm_base), 1e-30)}
        row["speedup"] = row["eager_s"] / row["variant_s"]
        if name == "compile":  # the engine's perf/compile_s, and the first step's extra wall time
            row["compile_s"] = first_compile_s
            row["first_step_extra_s"] = t_other0 - row["variant_s"]
        if casts:
            row["cast_s"] = median(casts)
            row["cast_fraction"] = row["cast_s"] / row["eager_s"]
        rows.append(row)
        extra = "".join(f", {k} {row[k]:.4g}" for k in ("compile_s", "first_step_extra_s", "cast_s", "cast_fraction") if k in row)
        print(f"{dtype:9s} {name:12s} eager {row['eager_s']:.3f} s, {name} {row['variant_s']:.3f} s, speedup "
              f"{row['speedup']:.3f}{extra}; max |dlogp| {row['max_abs_logprob_diff']:.2e}, grad-norm rel diff "
              f"{row['grad_norm_rel_diff']:.2e}; load average {os.getloadavg()[0]:.1f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions per variant (median)")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from _tiny import MODELS, build_model

    print(f"CPU flags: {' '.join(cpu_flags())}; torch {torch.__version__}; {args.threads} thread(s); "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "30M"
        build_model(path, MODELS["30M"])
        for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
            results += run_case(str(path), dtype, args.reps)
    if args.json:
        print(json.dumps({"cpu_flags": cpu_flags(), "threads": args.threads, "reps": args.reps,
                          "torch": torch.__version__, "load_average": os.getloadavg(), "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
