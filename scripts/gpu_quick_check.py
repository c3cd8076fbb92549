"""The device-sized GPU check (`scripts/gpu_check.sh --quick`): what a lent accelerator can prove in
a few minutes with torch alone (no Ray, vLLM, SGLang or network). One PASS / FAIL / SKIP line per
check; exit 1 if any failed.

    python scripts/gpu_quick_check.py [--device cuda] [--mfu-model 0.5b|tiny] [--json PATH]

Checks:
  native-greedy      the built-in engine on the device: greedy tokens equal the trainer's argmax
                     (the training forward of the same checkpoint, fp32), and its log-probs equal
                     the trainer's (`engine.logprobs`) to 1e-4; the max difference is printed
  batch-invariant-logprobs  rollout.batch_invariant: engine and trainer log-probs equal bit for
                     bit on the device (fp32, bf16)
  native-throughput  bf16 decode tokens/s of the built-in engine on a ~0.5B random Qwen2
  ddp-step           one PPO update through the DDP engine on a 1-rank group of the run's backend
  fsdp2-step         the same through FSDP2: equal loss, and weights equal to DDP's to bf16-free fp32
  packed-logprobs    actor.packing=on gives the padded plan's log-probs on the device
  weight-sync        the leader's object broadcast and a bucketed weight send over the 1-rank
                     device group (`Platform.group_backend`: CPU tensors through gloo, device
                     tensors through NCCL; a NCCL-only group refuses the CPU objects)
  fp8-quantizer      block FP8 on the device: bit-equal to the CPU result, and to torch's own
                     float8_e4m3fn cast of the block-scaled weight; a `torch._scaled_mm` with it
  bf16-mfu           a bf16 PPO update's model FLOPs utilisation on the ~0.5B random model

The device machine lent to polyrl's sessions has torch but not Ray: this script imports only the
parts of polyrl that run inside a rank (engines, training engines, collectives, weight buckets).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # one line per check, not bars
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from polyrl.batch import Ragged, RolloutBatch  # noqa: E402
from polyrl.builtin import resolve  # noqa: E402
from polyrl.platform import get_platform  # noqa: E402

# Qwen2.5-0.5B's shape (494M parameters with tied embeddings), random weights
SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
}
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H20": 148.0, "B200": 2250.0, "A100": 312.0}
"""Dense bf16 tensor-core peak per device name (the vendors' data sheets, no sparsity)."""

RESULTS: list[dict] = []


def report(name: str, status: str, detail: str) -> None:
    RESULTS.append({"check": name, "status": status, "detail": detail})
    print(f"{status} {name}: {detail}", flush=True)


def check(fn):
    def run(*args, **kwargs):
        name = fn.__name__.replace("_", "-")
        try:
            detail = fn(*args, **kwargs)
        except SkipCheck as skip:
            report(name, "SKIP", str(skip))
        except Exception as exc:  # every failure is a FAIL line with its cause, then the next check
            report(name, "FAIL", f"{type(exc).__name__}: {exc}")
            traceback.print_exc(limit=6)
        else:
            report(name, "PASS", detail)
    return run


class SkipCheck(Exception):
    pass


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_model_dir(shape: dict, out: Path, dtype: torch.dtype) -> Path:
    """A random Qwen2ForCausalLM of `shape` written with save_pretrained (no tokenizer)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(**shape, tie_word_embeddings=True, max_position_embeddings=4096,
                         eos_token_id=1, pad_token_id=0, bos_token_id=None, torch_dtype=dtype)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(str(out))
    return out


def load_model(path: Path, dtype: str, device: torch.device) -> torch.nn.Module:
    from polyrl.training.model_loading import load_causal_lm

    return load_causal_lm(str(path), dtype).to(device)


def make_batch(n: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    P = [prompt_len - (i % 3) for i in range(n)]
    R = [response_len - (i % 5) for i in range(n)]
    prompts = Ragged.from_rows([torch.randint(2, vocab, (p,), generator=g) for p in P], torch.long)
    responses = Ragged.from_rows([torch.randint(2, vocab, (r,), generator=g) for r in R], torch.long)
    zeros = torch.zeros(n, dtype=torch.long)
    return RolloutBatch(
        prompt_ids=prompts, response_ids=responses,
        loss_mask=Ragged.full_like(responses, 1.0, torch.float32), group=torch.arange(n) // 2,
        stop_reason=zeros, finished_with_eos=torch.ones(n, dtype=torch.bool), weight_version=zeros,
        min_version=zeros, max_version=zeros, continuations=zeros,
        rollout_logprobs=responses.with_values(-torch.rand(len(responses.values), generator=g) * 3),
        advantages=torch.randn(n, generator=g))


def actor_and_engine(model: torch.nn.Module, strategy: str, device: torch.device, **overrides):
    from polyrl.algorithms import AlgorithmConfig
    from polyrl.algorithms.off_policy import OffPolicyConfig
    from polyrl.training import build_engine
    from polyrl.workers.actor import PPOActor
    from polyrl.training.config import ActorConfig

    cfg = ActorConfig(**{"strategy": strategy, "lr": 1e-4, "grad_clip": 1.0, **overrides})
    engine = build_engine(model, cfg, get_platform(None), device, rank=0, world_size=1,
                          group=dist.group.WORLD, horizon=8)
    return engine, PPOActor(engine, cfg, AlgorithmConfig(), OffPolicyConfig().resolve(on_policy=True), device)


# --- checks ---------------------------------------------------------------------------------------

@check
def native_greedy(device: torch.device) -> str:
    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native.engine import NativeEngine

    path = Path(resolve("builtin:tiny-arith"))
    engine = NativeEngine(path, device=device, max_model_len=64, tokenizer=False)
    prompts = [[5, 17, 33, 2, 90, 64, 7], [40, 41], [3, 9, 27, 81, 115, 7, 8, 9, 10]]
    steps = 16
    outs = engine.generate_batch(prompts, SamplingParams(temperature=0, max_tokens=steps,
                                                         ignore_eos=True))
    model = load_model(path, "float32", device).eval()
    for prompt, (out,) in zip(prompts, outs):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(steps):
                ids.append(int(model(torch.tensor([ids], device=device)).logits[0, -1].argmax()))
        if out.token_ids != ids[len(prompt):]:
            raise AssertionError(f"engine greedy {out.token_ids} != trainer argmax {ids[len(prompt):]}")
    # the trainer's log-probs of the engine's own samples (the rollout/trainer mismatch)
    sampled = engine.generate_batch(prompts, SamplingParams(temperature=1.0, max_tokens=steps,
                                                            seed=3, ignore_eos=True))
    samples = [s[0] for s in sampled]
    batch = make_batch(len(prompts), 4, 4, 8)
    batch.prompt_ids = Ragged.from_rows([torch.tensor(p) for p in prompts], torch.long)
    batch.response_ids = Ragged.from_rows([torch.tensor(s.token_ids) for s in samples], torch.long)
    batch.loss_mask = Ragged.full_like(batch.response_ids, 1.0, torch.float32)
    batch.rollout_logprobs = batch.response_ids.with_values(
        torch.tensor([lp for s in samples for lp in s.logprobs], dtype=torch.float32))
    trainer, _ = actor_and_engine(model, "ddp", device, param_dtype="float32", compute_dtype="float32")
    ours = trainer.logprobs(batch).values.float().cpu()
    diff = (ours - batch.rollout_logprobs.values).abs()
    if diff.max().item() > 1e-4:
        raise AssertionError(f"engine vs trainer log-probs max |diff| {diff.max().item():.2e} > 1e-4")
    return (f"{len(prompts)} prompts x {steps} greedy tokens equal the trainer's argmax; fp32 "
            f"log-prob |engine - trainer| max {diff.max().item():.2e}, mean {diff.mean().item():.2e}")


@check
def batch_invariant_logprobs(device: torch.device) -> str:
    """rollout.batch_invariant: the engine's sampled log-probs equal the trainer's bit for bit on
    the device too (fp32 and bf16; tiled matmuls, chunked attention: training/batch_invariant.py)."""
    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native.engine import NativeEngine
    from polyrl.training import batch_invariant

    path = Path(resolve("builtin:tiny-arith"))
    prompts = [[5, 17, 33, 2, 90, 64, 7], [40, 41], [3, 9, 27, 81, 115, 7, 8, 9, 10]]
    details = []
    for dtype in ("float32", "bfloat16"):
        engine = NativeEngine(path, device=device, dtype=dtype, max_model_len=64, tokenizer=False,
                              batch_invariant=True)
        outs = engine.generate_batch(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=16,
                                                             seed=5, ignore_eos=True))
        samples = [(p, s) for p, group in zip(prompts, outs) for s in group]
        batch = make_batch(len(samples), 4, 4, 8)
        batch.prompt_ids = Ragged.from_rows([torch.tensor(p) for p, _ in samples], torch.long)
        batch.response_ids = Ragged.from_rows([torch.tensor(s.token_ids) for _, s in samples], torch.long)
        batch.loss_mask = Ragged.full_like(batch.response_ids, 1.0, torch.float32)
        engine_lp = torch.tensor([lp for _, s in samples for lp in s.logprobs], dtype=torch.float32)
        model = load_model(path, dtype, device)
        batch_invariant.enable(model, dtype)
        trainer, _ = actor_and_engine(model, "ddp", device, param_dtype=dtype, compute_dtype=dtype)
        ours = trainer.logprobs(batch).values.float().cpu()
        gap = (ours - engine_lp).abs().max().item()
        if not torch.equal(ours, engine_lp):
            raise AssertionError(f"{dtype}: engine vs trainer log-probs differ (max |diff| {gap:.2e})")
        details.append(f"{dtype} {len(engine_lp)} tokens equal")
    return "bit-identical engine and trainer log-probs: " + ", ".join(details)


@check
def native_throughput(device: torch.device, model_dir: Path, batch: int, prompt: int, tokens: int) -> str:
    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native.engine import NativeEngine

    engine = NativeEngine(model_dir, dtype="bfloat16", device=device, max_model_len=prompt + tokens,
                          max_num_seqs=batch, tokenizer=False)
    g = torch.Generator().manual_seed(0)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = [torch.randint(2, vocab, (prompt,), generator=g).tolist() for _ in range(batch)]
    sampling = SamplingParams(temperature=1.0, max_tokens=tokens, seed=0, ignore_eos=True)
    engine.generate_batch(prompts[:4], SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True))
    synchronize(device)
    start = time.perf_counter()
    outs = engine.generate_batch(prompts, sampling)
    synchronize(device)
    elapsed = time.perf_counter() - start
    n = sum(len(s[0].token_ids) for s in outs)
    if n != batch * tokens:
        raise AssertionError(f"generated {n} tokens, expected {batch * tokens}")
    return f"{n / elapsed:,.0f} tokens/s ({batch} prompts x {prompt} + {tokens} tokens, bf16, {elapsed:.2f} s)"


def _ppo_update(strategy: str, model_dir: Path, device: torch.device):
    model = load_model(model_dir, "float32", device)
    engine, actor = actor_and_engine(model, strategy, device, param_dtype="float32",
                                     compute_dtype="float32", micro_batch_tokens=512)
    before = {k: v.detach().float().cpu().clone() for k, v in engine.named_weights()}
    metrics = actor.update(make_batch(8, 24, 40, 500, seed=1), num_mini_batches=1,
                           use_rollout_logprobs=False)
    after = {k: v.detach().float().cpu().clone() for k, v in engine.named_weights()}
    return metrics, before, after


STEP_RESULTS: dict[str, tuple] = {}


@check
def ddp_step(device: torch.device, tiny_dir: Path) -> str:
    metrics, before, after = _ppo_update("ddp", tiny_dir, device)
    STEP_RESULTS["ddp"] = (metrics, after)
    moved = sum(not torch.equal(before[k], after[k]) for k in before)
    if not (torch.isfinite(torch.tensor(metrics["actor/loss"])) and moved):
        raise AssertionError(f"loss {metrics['actor/loss']}, {moved} tensors changed")
    return f"loss {metrics['actor/loss']:.4f}, grad norm {metrics['actor/grad_norm']:.4f}, {moved}/{len(before)} tensors updated"


@check
def fsdp2_step(device: torch.device, tiny_dir: Path) -> str:
    metrics, before, after = _ppo_update("fsdp2", tiny_dir, device)
    if "ddp" not in STEP_RESULTS:
        raise SkipCheck("no DDP result to compare with (ddp-step failed)")
    ddp_metrics, ddp_after = STEP_RESULTS["ddp"]
    loss_diff = abs(metrics["actor/loss"] - ddp_metrics["actor/loss"])
    w_diff = max((after[k] - ddp_after[k]).abs().max().item() for k in after)
    if loss_diff > 1e-5 or w_diff > 1e-5:
        raise AssertionError(f"FSDP2 vs DDP: loss |diff| {loss_diff:.2e}, weights max |diff| {w_diff:.2e}")
    return f"loss {metrics['actor/loss']:.4f}; vs DDP: loss |diff| {loss_diff:.1e}, weights max |diff| {w_diff:.1e}"


@check
def packed_logprobs(device: torch.device, tiny_dir: Path) -> str:
    """Sequence packing (actor.packing=on: per-sample attention, training/varlen.py) gives the
    padded plan's log-probs on the device."""
    batch = make_batch(12, 30, 50, 500, seed=4)
    out = {}
    for packing in ("off", "on"):
        model = load_model(tiny_dir, "float32", device)
        engine, _ = actor_and_engine(model, "ddp", device, param_dtype="float32",
                                     compute_dtype="float32", packing=packing, micro_batch_tokens=1024)
        out[packing] = engine.logprobs(batch).values.float().cpu()
    diff = (out["on"] - out["off"]).abs().max().item()
    if diff > 1e-5:
        raise AssertionError(f"packed vs padded log-probs max |diff| {diff:.2e}")
    return f"12 samples, packed vs padded fp32 log-probs max |diff| {diff:.1e}"


@check
def weight_sync(device: torch.device, tiny_dir: Path) -> str:
    from polyrl.distributed.collectives import broadcast_from_leader, gather_to_leader
    from polyrl.weights import WeightSyncConfig, build_transport

    group = dist.new_group([0], backend=get_platform(None).group_backend(device.type))
    obj = broadcast_from_leader({"manifest": list(range(5))}, group, timeout_s=60)
    gathered = gather_to_leader({"rank": 0}, group, timeout_s=60)
    tensor = broadcast_from_leader(torch.arange(8, device=device, dtype=torch.float32), group, timeout_s=60)
    if obj != {"manifest": list(range(5))} or gathered != [{"rank": 0}] or tensor.device.type != device.type:
        raise AssertionError(f"collectives returned {obj!r}, {gathered!r}, {tensor.device}")
    refused = "n/a on CPU"
    if device.type != "cpu":  # what fix 1 of issue #28 removed: a device-only group refuses objects
        only = dist.new_group([0], backend=get_platform(None).dist_backend())
        try:
            broadcast_from_leader({"x": 1}, only, timeout_s=60)
            refused = "accepted"
        except Exception as exc:
            refused = f"refused ({type(exc).__name__})"
    model = load_model(tiny_dir, "bfloat16", device)
    cfg = WeightSyncConfig(transport="broadcast", bucket_mb=0.05, timeout_s=60, shared_memory=False)
    transport = build_transport(cfg, "standalone", group=group, device=device)  # packs on it (issue 39)
    stats = transport.send(list(model.named_parameters()), version=1)
    return (f"object broadcast + gather over {get_platform(None).group_backend(device.type)}; "
            f"{stats.num_buckets} buckets, {stats.bytes / 1e6:.1f} MB sent; a device-only group: {refused}")


@check
def fp8_quantizer(device: torch.device) -> str:
    from polyrl.weights.fp8 import FP8_BLOCK, FP8_DTYPE, FP8_MAX, dequantize_block_fp8, quantize_block_fp8

    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise SkipCheck("needs a CUDA device of capability >= 8.9 for float8 matmuls")
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(1024, 896, generator=g) * 0.05).to(torch.bfloat16)
    q_gpu, s_gpu = quantize_block_fp8(w.to(device))
    q_cpu, s_cpu = quantize_block_fp8(w)
    q_dev = q_gpu.cpu()
    q_off = int((q_dev.view(torch.uint8) != q_cpu.view(torch.uint8)).sum())
    s_off = int((s_gpu.cpu() != s_cpu).sum())
    # a value that differs may differ by one FP8 step (division rounding), never more
    step = (q_dev.float() - q_cpu.float()).abs().max().item() if q_off else 0.0
    if s_off or q_off > q_cpu.numel() // 10_000:
        raise AssertionError(f"device vs CPU: {s_off} of {s_cpu.numel()} scales and {q_off} of "
                             f"{q_cpu.numel()} FP8 values differ (max |diff| {step})")
    # torch's own cast of the block-scaled weight, block by block
    br, bc = FP8_BLOCK
    ref = torch.empty_like(q_cpu)
    for i in range(0, w.shape[0], br):
        for j in range(0, w.shape[1], bc):
            blk = w[i:i + br, j:j + bc].float()
            scale = max(blk.abs().max().item() / FP8_MAX, torch.finfo(torch.float32).tiny)
            ref[i:i + br, j:j + bc] = (blk / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    mismatched = int((ref.view(torch.uint8) != q_cpu.view(torch.uint8)).sum())
    if mismatched > ref.numel() // 10_000:  # division by the scale vs by its float32 rounding
        raise AssertionError(f"{mismatched} of {ref.numel()} FP8 values differ from torch's cast")
    deq = dequantize_block_fp8(q_gpu, s_gpu, dtype=torch.float32)
    rel = ((deq.cpu() - w.float()).norm() / w.float().norm()).item()
    # a per-tensor-scaled float8 matmul on the device runs with these values
    x = torch.randn(64, 896, device=device).to(FP8_DTYPE)
    one = torch.ones((), device=device)
    y = torch._scaled_mm(x, q_gpu.t(), scale_a=one,
                         scale_b=one, out_dtype=torch.bfloat16)
    if not torch.isfinite(y.float()).all():
        raise AssertionError("float8 matmul produced non-finite values")
    return (f"1024x896 bf16: device vs CPU {s_off} scales, {q_off} values differ (max |diff| {step}); {mismatched} values differ from torch's "
            f"float8 cast; dequantized relative error {rel:.3e}; _scaled_mm ok")


@check
def bf16_mfu(device: torch.device, model_dir: Path, n: int, prompt: int, response: int) -> str:
    if device.type != "cuda":
        raise SkipCheck("MFU is measured on a CUDA device")
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    model = load_model(model_dir, "bfloat16", device)
    params = sum(p.numel() for p in model.parameters())
    engine, actor = actor_and_engine(model, "ddp", device, param_dtype="bfloat16",
                                     compute_dtype="bfloat16", micro_batch_tokens=16384)
    batch = make_batch(n, prompt, response, 150000, seed=2)
    tokens = int(batch.prompt_ids.lengths.sum() + batch.response_ids.lengths.sum())
    actor.update(batch, num_mini_batches=1, use_rollout_logprobs=False)  # warm-up
    synchronize(device)
    reps = 3
    start = time.perf_counter()
    for _ in range(reps):
        actor.update(batch, num_mini_batches=1, use_rollout_logprobs=False)
    synchronize(device)
    per_step = (time.perf_counter() - start) / reps
    # 6 N per token (forward + backward) plus attention (12 L d T per token: QK^T and AV,
    # forward and backward) over each sample's own length; the log-prob head is part of N (tied)
    cfg = model.config
    seq = (batch.prompt_ids.lengths + batch.response_ids.lengths).float()
    attn = 12 * cfg.num_hidden_layers * cfg.hidden_size * float((seq * seq / 2).sum())
    flops = 6 * params * tokens + attn
    achieved = flops / per_step / 1e12
    mfu = f", MFU {achieved / peak:.1%} of {peak:.0f}" if peak else ""
    return (f"{params / 1e6:.0f}M params, {tokens} tokens per update: {per_step * 1e3:.0f} ms, "
            f"{achieved:.0f} TFLOP/s{mfu} ({name})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--mfu-model", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("SKIP all: no CUDA device visible to torch")
        return 0
    device = torch.device("cuda:0" if args.device == "cuda" else args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    platform = get_platform(None)
    print(f"polyrl GPU quick check: torch {torch.__version__}, {platform.describe()}", flush=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(platform.group_backend(device.type), store=dist.HashStore(),
                            rank=0, world_size=1)
    big = args.mfu_model == "0.5b"
    with tempfile.TemporaryDirectory() as tmp:
        tiny_dir = random_model_dir(SHAPES["tiny"], Path(tmp) / "tiny", torch.float32)
        model_dir = random_model_dir(SHAPES[args.mfu_model], Path(tmp) / "mfu", torch.bfloat16)
        native_greedy(device)
        batch_invariant_logprobs(device)
        native_throughput(device, model_dir, batch=256 if big else 8, prompt=128 if big else 8,
                          tokens=128 if big else 8)
        ddp_step(device, tiny_dir)
        fsdp2_step(device, tiny_dir)
        packed_logprobs(device, tiny_dir)
        weight_sync(device, tiny_dir)
        fp8_quantizer(device)
        bf16_mfu(device, model_dir, n=32 if big else 2, prompt=256 if big else 8,
                 response=768 if big else 8)
    dist.destroy_process_group()
    failed = [r for r in RESULTS if r["status"] == "FAIL"]
    print(f"done: {len(RESULTS) - len(failed)} of {len(RESULTS)} checks passed or skipped, "
          f"{len(failed)} failed", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(RESULTS, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
