"""Cost of rollout.batch_invariant: decode tokens/s and a training step, default vs batch-invariant.

The ~4M and ~30M Qwen2-style models of benchmarks/rollout.py (random init, tied embeddings).
Decode: 16 prompts x n=4, 32-token prompts, 64 new tokens (EOS ignored), the engine's own decode
counters (decode_tokens / decode_s). Default and batch-invariant runs are interleaved, the best
of `--repeats` kept for each (the cores are shared). Training step: the DDP engine on one rank, 64 samples of
32 prompt + 64 response tokens, actor.micro_batch_tokens=2048, padded micro-batches: no-grad
log-probs of the batch, then forward + backward of every micro-batch and one optimizer step.

    python benchmarks/batch_invariant.py [--models 4M,30M] [--repeats 3] [--threads N] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polyrl.batch import Ragged, RolloutBatch  # noqa: E402
from polyrl.platform import get_platform  # noqa: E402
from polyrl.rollout.base import SamplingParams  # noqa: E402
from polyrl.rollout.native.engine import NativeEngine  # noqa: E402
from polyrl.training import batch_invariant, build_engine  # noqa: E402
from polyrl.training.config import ActorConfig  # noqa: E402
from rollout import MODELS, build_model  # noqa: E402  (the same two random-init models)


class Decoder:
    def __init__(self, path: str, dtype: str, invariant: bool):
        self.engine = NativeEngine(path, dtype=dtype, tokenizer=False, max_model_len=512, max_num_seqs=64,
                                   batch_invariant=invariant)
        g = torch.Generator().manual_seed(0)
        self.prompts = [torch.randint(1, 4000, (32,), generator=g).tolist() for _ in range(16)]
        self.engine.generate_batch(self.prompts[:2], SamplingParams(n=1, max_tokens=4, ignore_eos=True))

    def tokens_per_s(self) -> float:
        before = self.engine.stats
        self.engine.generate_batch(self.prompts, SamplingParams(n=4, max_tokens=64, ignore_eos=True, seed=0))
        after = self.engine.stats
        return (after["decode_tokens"] - before["decode_tokens"]) / (after["decode_s"] - before["decode_s"])


def make_batch(n: int = 64, prompt: int = 32, response: int = 64, vocab: int = 4000) -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    P = Ragged.from_rows([torch.randint(1, vocab, (prompt,), generator=g) for _ in range(n)], torch.long)
    R = Ragged.from_rows([torch.randint(1, vocab, (response,), generator=g) for _ in range(n)], torch.long)
    zeros = torch.zeros(n, dtype=torch.long)
    return RolloutBatch(prompt_ids=P, response_ids=R, loss_mask=Ragged.full_like(R, 1.0, torch.float32),
                        group=torch.arange(n) // 4, stop_reason=zeros, finished_with_eos=zeros.bool(),
                        weight_version=zeros, min_version=zeros, max_version=zeros, continuations=zeros,
                        advantages=torch.randn(n, generator=g))


class Stepper:
    def __init__(self, path: str, dtype: str, invariant: bool):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if invariant:
            batch_invariant.enable(model, dtype)
        platform = get_platform("cpu")
        cfg = ActorConfig(strategy="ddp", micro_batch_tokens=2048, packing="off", compute_dtype=dtype,
                          compile="off")
        self.engine = build_engine(model, cfg, platform, platform.torch_device(0), horizon=100)
        self.batch = make_batch()
        self.seconds()  # warm-up

    def seconds(self) -> float:
        engine, batch = self.engine, self.batch
        t0 = time.perf_counter()
        old = engine.logprobs(batch)
        for mb in engine.micro_batches(batch.replace(old_logprobs=old)):
            lp, _ = engine.forward(mb, with_entropy=True)
            engine.backward(-(lp * mb.response_mask).sum() / 1000)
        engine.optimizer_step(0.0)
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="4M,30M")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    flags = sorted(k for k in ("avx2", "avx512_f", "avx512_bf16", "amx_bf16") if caps.get(k))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path = Path(tmp) / name
            build_model(MODELS[name], path)
            for dtype in ("float32", "bfloat16"):
                row = {"model": name, "dtype": dtype}
                decoders = {tag: Decoder(str(path), dtype, tag == "invariant") for tag in ("default", "invariant")}
                steppers = {tag: Stepper(str(path), dtype, tag == "invariant") for tag in ("default", "invariant")}
                tps = {tag: [] for tag in decoders}
                secs = {tag: [] for tag in steppers}
                for _ in range(args.repeats):  # interleaved, best of each kept (shared, noisy cores)
                    for tag in decoders:
                        tps[tag].append(decoders[tag].tokens_per_s())
                        secs[tag].append(steppers[tag].seconds())
                for tag in decoders:
                    row[f"decode_tps_{tag}"] = round(max(tps[tag]), 1)
                    row[f"train_step_s_{tag}"] = round(min(secs[tag]), 3)
                row["decode_slowdown"] = round(row["decode_tps_default"] / row["decode_tps_invariant"], 2)
                row["train_slowdown"] = round(row["train_step_s_invariant"] / row["train_step_s_default"], 2)
                rows.append(row)
                print(row, flush=True)
    print(f"threads={torch.get_num_threads()} flags={','.join(flags)} torch={torch.__version__}")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
