"""A whole training loop on one device, without Ray (`scripts/gpu_check.sh --loop`): what a lent
GPU proves end to end in at most 8 minutes, and what CI runs on CPU with a smaller model so the
script cannot rot. One PASS / FAIL line per check, then a JSON summary; exit 1 if any failed.

    python scripts/gpu_loop.py [--device cuda|cpu] [--json PATH]

Checks (each is the real command `polyrl train ray.enabled=false ...`, docs/training.md "One
process, no Ray", run in a child process that cannot import Ray):
  learn        the bundled task (the embedded default). cuda: the built-in engine in bf16
               (rollout.dtype and actor.compute_dtype; fp32 master weights), all 40 steps; cpu:
               fp32, 10 steps. Held-out accuracy must rise by at least 30 points.
  throughput   a random Qwen2 built on the device from a config (cuda: Qwen2.5-0.5B's shape,
               bf16; cpu: a 2-layer one, fp32) and the bundled tokenizer, 3 steps with long
               responses (a random model rarely stops): rollout tokens/s, training tokens/s
               and MFU (cuda, a known peak), weight-sync seconds and
               rollout/logprob_diff_mean|max, averaged over the steps after the first.

Needs torch and what polyrl's loop imports (scripts/gpu_carry.sh builds the rest for a device
image that lacks it); no Ray, no network: the model is built from a config and nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # one line per check, not bars
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

NO_RAY = """
import sys
class NoRay:
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("Ray is blocked: the loop must run without it (ray.enabled=false)")
sys.meta_path.insert(0, NoRay())
from polyrl.cli.main import main
sys.exit(main(sys.argv[1:]))
"""
"""The child's program: `polyrl train` where importing Ray fails, so a loop that needed Ray
fails here too, also on a machine that has it (CI)."""

SHAPES = {
    # Qwen2.5-0.5B (494M parameters with tied embeddings); its vocabulary is larger than the
    # bundled tokenizer's, whose decoding skips the ids it lacks
    "cuda": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    "cpu": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512),
}
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H20": 148.0, "B200": 2250.0, "A100": 312.0}
"""Dense bf16 tensor-core peak per device name (the vendors' data sheets, no sparsity)."""
MIN_RISE = 0.30
"""Held-out accuracy points the learn check asks for."""

COMMON = ["ray.enabled=false", "trainer.progress_bar=false", "logging.samples_every=0",
          "logging.plot_at_end=false"]  # no matplotlib on the device
LEARN = {
    "cuda": ["platform=cuda", "rollout.dtype=bfloat16", "actor.compute_dtype=bfloat16"],
    "cpu": ["platform=cpu", "trainer.total_steps=10"],
}
THROUGHPUT = {
    "cuda": ["platform=cuda", "rollout.dtype=bfloat16", "actor.param_dtype=bfloat16",
             "actor.compute_dtype=bfloat16", "data.train_batch_size=32", "rollout.n=8",
             "rollout.response_length=512"],
    "cpu": ["platform=cpu", "data.train_batch_size=4", "rollout.n=4", "rollout.response_length=32"],
}
THROUGHPUT_COMMON = ["trainer.total_steps=3", "trainer.val_before_train=false", "trainer.val_every=0",
                     "trainer.save_at_end=false", "logging.plot_at_end=false", "data.val_files=[]"]
TIMEOUT_S = {"learn": 200, "throughput": 240}
"""Per check: with the model build, the two fit the 8 minutes the whole script may take."""

RESULTS: list[dict] = []
TORCH_DIR: Path | None = None

LOOP_IMPORTS = ("transformers", "tokenizers", "safetensors", "pydantic", "pydantic_core", "yaml", "regex",
                "numpy", "rich", "huggingface_hub", "pyarrow", "ray")
"""What the loop imports besides torch (scripts/gpu_carry.sh lists all), and pyarrow and Ray,
which it does without: where each comes from on this machine is the first line of output, so a
lent device's image is known after one run."""


def image_packages() -> dict[str, str]:
    """Each of LOOP_IMPORTS: its version (with its directory where that is not torch's, e.g. the
    carried build/gpu_carry) or "missing", found without importing it."""
    import importlib.util
    from importlib import metadata

    found = {}
    for name in LOOP_IMPORTS:
        spec = importlib.util.find_spec(name)
        if spec is None:
            found[name] = "missing"
            continue
        dist = {"yaml": "pyyaml", "pydantic_core": "pydantic-core"}.get(name, name)
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            version = "?"
        where = Path(spec.origin or "").parent.parent
        found[name] = version if where == TORCH_DIR else f"{version} ({where})"  # carried: its dir
    return found


def report(name: str, ok: bool, detail: str, **numbers) -> None:
    RESULTS.append({"check": name, "status": "PASS" if ok else "FAIL", "detail": detail, **numbers})
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def train(out: Path, overrides: list[str], timeout_s: float) -> tuple[int, str, float]:
    """`polyrl train` (Ray blocked) into `out`; returns its exit code, log tail and wall seconds."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", NO_RAY, "train", *COMMON, *overrides,
                               f"--output-dir={out}"], capture_output=True, text=True, env=env,
                              timeout=timeout_s, cwd=REPO)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-3000:]
        return 124, tail.decode(errors="replace") if isinstance(tail, bytes) else tail, timeout_s
    return proc.returncode, (proc.stdout + proc.stderr)[-3000:], time.perf_counter() - start


CARRIED_DATA = REPO / "build" / "gpu_carry" / "data"
"""The bundled task as JSONL, written by scripts/gpu_carry.sh beside the carried packages."""


def data_overrides() -> list[str]:
    """The bundled arithmetic files: the parquet originals where pyarrow imports, else their
    JSONL copies from scripts/gpu_carry.sh (pyarrow is too large to carry to a device; JSONL
    reads with the standard library)."""
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        files = [CARRIED_DATA / f"arithmetic_{split}.jsonl" for split in ("train", "val")]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"pyarrow is not installed and {', '.join(missing)} is missing: "
                                    "run scripts/gpu_carry.sh where pyarrow is and carry build/gpu_carry")
        return [f"data.train_files=[{files[0]}]", f"data.val_files=[{files[1]}]"]
    return []


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def learn(device: str, work: Path) -> None:
    out = work / "learn"
    try:
        data = data_overrides()
    except FileNotFoundError as exc:
        return report("learn", False, str(exc))
    rc, log, wall = train(out, [*LEARN[device], *data], TIMEOUT_S["learn"])
    if rc != 0:
        return report("learn", False, f"polyrl train exited {rc}:\n{log}", wall_s=round(wall, 1))
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["initial_accuracy"], summary["final_accuracy"]
    curve = {r["step"]: round(r["val/acc"], 3) for r in rows(out) if "val/acc" in r}
    rise = after - before
    report("learn", rise >= MIN_RISE,
           f"held-out accuracy {before:.1%} -> {after:.1%} ({rise * 100:+.1f} points, needs "
           f"+{MIN_RISE * 100:.0f}) in {summary['steps']} steps, {wall:.0f}s; curve {curve}",
           initial_accuracy=before, final_accuracy=after, curve=curve, steps=summary["steps"],
           wall_s=round(wall, 1))


def build_model(device: str, out: Path) -> tuple[Path, int]:
    """A random Qwen2 of the device's shape, made on the device (no download), saved with the
    bundled tokenizer; returns its directory and parameter count."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from polyrl.builtin import resolve

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = Qwen2Config(**SHAPES[device], tie_word_embeddings=True, max_position_embeddings=4096,
                         eos_token_id=1, pad_token_id=0, bos_token_id=None)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(out))
    tokenizer = Path(resolve("builtin:tiny-arith"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, out / name)
    del model
    return out, params


def throughput(device: str, work: Path) -> None:
    try:
        model, params = build_model(device, work / "model")
    except Exception as exc:  # the check fails with its cause; the summary still prints
        return report("throughput", False, f"building the random model: {type(exc).__name__}: {exc}")
    out = work / "throughput"
    try:
        data = data_overrides()
    except FileNotFoundError as exc:
        return report("throughput", False, str(exc))
    rc, log, wall = train(out, [f"model.path={model}", *THROUGHPUT[device], *THROUGHPUT_COMMON, *data[:1]],
                          TIMEOUT_S["throughput"])
    if rc != 0:
        return report("throughput", False, f"polyrl train exited {rc}:\n{log}", wall_s=round(wall, 1))
    steady = [r for r in rows(out) if r.get("step", 0) >= 2] or rows(out)  # step 1 warms up

    def mean(key: str) -> float | None:
        values = [r[key] for r in steady if key in r]
        return sum(values) / len(values) if values else None

    numbers = {
        "params": params,
        "rollout_tokens_per_s": mean("perf/generate_tokens_per_s"),
        "train_tokens_per_s": mean("perf/update_tokens_per_s"),
        "weight_sync_s": mean("timing/sync_weights"),
        "logprob_diff_mean": mean("rollout/logprob_diff_mean"),
        "logprob_diff_max": max((r["rollout/logprob_diff_max"] for r in steady
                                 if "rollout/logprob_diff_max" in r), default=None),
        "response_length_mean": mean("response/length_mean"),
        "mfu": None, "device_name": None, "wall_s": round(wall, 1),
    }
    numbers["mfu"], numbers["device_name"] = mfu(device, params, steady, numbers["train_tokens_per_s"])
    missing = [k for k in ("rollout_tokens_per_s", "train_tokens_per_s", "weight_sync_s", "logprob_diff_mean")
               if numbers[k] is None]
    finite = all(v == v for v in numbers.values() if isinstance(v, float))  # no NaN
    fmt = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
    detail = (f"{params / 1e6:.1f}M params: rollout {fmt(numbers['rollout_tokens_per_s'], ',.0f')} tok/s, "
              f"training {fmt(numbers['train_tokens_per_s'], ',.0f')} tok/s, MFU {fmt(numbers['mfu'], '.1%')}, "
              f"weight sync {fmt(numbers['weight_sync_s'], '.3f')} s, logprob diff mean "
              f"{fmt(numbers['logprob_diff_mean'], '.2e')} max {fmt(numbers['logprob_diff_max'], '.2e')}"
              + (f"; missing: {', '.join(missing)}" if missing else ""))
    report("throughput", not missing and finite, detail, **numbers)


def mfu(device: str, params: int, steady: list[dict], tokens_per_s: float | None) -> tuple[float | None, str | None]:
    """Training model FLOPs utilisation: 6 N per token (forward + backward) plus attention (12 L d s
    per sequence of length s, per token 6 L d s over causal halves), over the device's bf16 peak."""
    if device != "cuda" or not tokens_per_s:
        return None, None
    import torch

    name = torch.cuda.get_device_name(0)
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    if peak is None:
        return None, name
    shape = SHAPES[device]
    seq = [r["perf/update_tokens_per_s"] * r["timing/update"] / max(r["perf/samples_per_s"] * r["timing/step"], 1)
           for r in steady if "timing/update" in r]
    mean_seq = sum(seq) / len(seq) if seq else 0.0
    per_token = 6 * params + 6 * shape["num_hidden_layers"] * shape["hidden_size"] * mean_seq
    return per_token * tokens_per_s / (peak * 1e12), name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--json", help="write the JSON summary here too")
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAIL all: no CUDA device visible to torch (run with --device cpu for the CPU form)")
        return 1
    print(f"polyrl loop check on {args.device}: torch {torch.__version__}", flush=True)
    global TORCH_DIR
    TORCH_DIR = Path(torch.__file__).parent.parent
    packages = image_packages()
    print("packages: " + ", ".join(f"{k} {v}" for k, v in packages.items()), flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="polyrl-loop-") as tmp:
        learn(args.device, Path(tmp))
        throughput(args.device, Path(tmp))
    failed = [r for r in RESULTS if r["status"] == "FAIL"]
    summary = {"device": args.device, "torch": torch.__version__, "wall_s": round(time.perf_counter() - start, 1),
               "passed": not failed, "packages": packages, "checks": RESULTS}
    print(json.dumps(summary, indent=2, default=str), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
