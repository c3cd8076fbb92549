"""Fused, chunked log-prob + entropy head against the plain [rows, vocab] path, same run.

`polyrl/training/logprobs.py` runs the LM head either plainly (float32 logits for every response
row, log-softmax, gather, entropy from the log-softmax) or fused (`fused_logprobs`: rows in
chunks, one pass per chunk, backward recomputing the chunk), choosing by size
(`FUSED_MIN_ELEMENTS`). This benchmark forces each path in turn and measures, per case:

- `head`: synthetic hidden states [rows, H] through a bias-free Linear head [V, H] (no model
  download), forward (log-probs + entropy metric, as the actor asks) + backward of a per-token
  loss; a Qwen2.5-like 151,936-token vocabulary (H 896) and the 30M benchmark model's 8,192;
- `update`: forward + backward of a whole policy through `response_logprobs` on a GRPO-shaped
  micro-batch: the bundled tiny model (`builtin:tiny-arith`, 16 prompts x 8 samples x 6 response
  tokens, the embedded default's batch) and the 30M random-init model of `benchmarks/_tiny.py`
  (8 x 8 samples x 32 tokens, `polyrl bench grpo`'s batch).

Reported: median seconds per forward + backward over interleaved repetitions (plain, fused,
plain, ... so both see the same machine load), `speedup` = plain / fused, the bytes autograd saves
for the backward (exact: summed over saved tensors other than the parameters themselves, each
storage once), and the rise of the
process's peak RSS during one forward + backward (VmHWM reset through /proc/self/clear_refs; an
approximation: freed heap memory may be reused).

    python benchmarks/logprobs.py [--threads 1] [--reps 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from polyrl.training import logprobs as lpmod  # noqa: E402

PLAIN, FUSED = 1 << 62, 0
"""FUSED_MIN_ELEMENTS values forcing each path."""


def cpu_flags() -> list[str]:
    try:
        words = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    return [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in words]


class SavedBytes:
    """Bytes autograd keeps for the backward, each storage counted once."""

    def __init__(self):
        self.seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter):  # the weights themselves: there either way
            return t
        try:
            s = t.untyped_storage()
            self.seen[s.data_ptr()] = s.nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def measure(step, threshold: int, grad: bool, tracked: list) -> tuple[float, int, int]:
    """(seconds, saved bytes, peak tensor bytes above the parameters) of one forward (+ backward
    when `grad`). Timed without the memory tracker (it adds per-op overhead); measured once more
    under it."""
    lpmod.FUSED_MIN_ELEMENTS = lpmod.FUSED_MIN_ELEMENTS_NO_GRAD = threshold
    t0 = time.perf_counter()
    with torch.set_grad_enabled(grad):
        loss = step()
        if grad:
            loss.backward()
    dt = time.perf_counter() - t0
    from torch.distributed._tools.mem_tracker import MemTracker

    saved, mt = SavedBytes(), MemTracker()
    mt.track_external(*tracked)
    with mt, torch.set_grad_enabled(grad), torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        loss = step()
        if grad:
            loss.backward()
    peak = next(iter(mt.get_tracker_snapshot("peak").values()))
    params = sum(p.numel() * p.element_size() for m in tracked if isinstance(m, torch.nn.Module) for p in m.parameters())
    return dt, saved.total, peak["Total"] - params


def head_case(vocab: int, hidden: int, rows: int, dtype: str):
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(1, rows, hidden, requires_grad=True)
    targets = torch.randint(0, vocab, (1, rows))
    weights = torch.randn(1, rows)

    class Trunk(torch.nn.Module):  # response_logprobs reads model.base_model(...).last_hidden_state
        def forward(self, input_ids, attention_mask):
            return type("Out", (), {"last_hidden_state": h})

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base_model, self.head = Trunk(), head

        def get_output_embeddings(self):
            return self.head

    mb = _micro_batch(targets, torch.arange(rows).unsqueeze(0), torch.tensor([rows]))
    model = Model()

    def step():
        head.zero_grad(set_to_none=True)
        h.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            lp, ent = lpmod.response_logprobs(model, mb, with_entropy=True)
        return (lp * weights).sum() + 0 * ent.sum()

    return step, [model, h]


def _micro_batch(targets, gather_index, lengths):
    from polyrl.batch import MicroBatch

    b, R = targets.shape
    mask = (torch.arange(R).unsqueeze(0) < lengths.unsqueeze(1)).float()
    return MicroBatch(input_ids=torch.zeros(b, 1, dtype=torch.long), attention_mask=torch.ones(b, 1, dtype=torch.long),
                      gather_index=gather_index, target_ids=targets, response_mask=mask, old_logprobs=None,
                      rollout_logprobs=None, advantages=None, ref_logprobs=None, values=None, returns=None,
                      indices=torch.arange(b), response_lengths=lengths)


def update_case(model_dir: str, prompts: int, samples: int, response: int, dtype: str):
    from transformers import AutoModelForCausalLM

    from polyrl.batch import Ragged, RolloutBatch, collate

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    n = prompts * samples
    prompt_rows = [torch.randint(2, vocab, (7 + (i // samples) % 3,), generator=g).tolist() for i in range(n)]
    resp = Ragged.from_rows([torch.randint(2, vocab, (response,), generator=g).tolist() for _ in range(n)], torch.long)
    zeros = torch.zeros(n, dtype=torch.long)
    batch = RolloutBatch(prompt_ids=Ragged.from_rows(prompt_rows, torch.long), response_ids=resp,
                         loss_mask=Ragged.full_like(resp, 1.0, torch.float32), group=torch.arange(n) // samples,
                         stop_reason=zeros, finished_with_eos=zeros.bool(), weight_version=zeros,
                         min_version=zeros, max_version=zeros, continuations=zeros)
    mb = collate(batch, list(range(n)), torch.device("cpu"))
    adv = torch.randn(mb.target_ids.shape, generator=g)
    model.train()

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            lp, ent = lpmod.response_logprobs(model, mb, with_entropy=True)
        return (lp * adv * mb.response_mask).sum() / mb.response_mask.sum()

    return (step, [model]), n * response * vocab


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions per path (median)")
    p.add_argument("--rows", type=int, default=1024, help="response rows of the 151,936-vocabulary head case")
    p.add_argument("--only", default="", help="comma-separated case names to run")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from _tiny import MODELS, build_model

    import tempfile

    from polyrl.builtin import resolve

    tmp = tempfile.TemporaryDirectory()
    cases = {}
    for dtype in ("float32", "bfloat16"):
        cases[f"head 151936x896, {args.rows} rows, {dtype}"] = (
            lambda d=dtype: (head_case(151936, 896, args.rows, d), args.rows * 151936))
        cases[f"head 8192x512, 2048 rows, {dtype}"] = (lambda d=dtype: (head_case(8192, 512, 2048, d), 2048 * 8192))

    def tiny(d):
        return update_case(resolve("builtin:tiny-arith"), 16, 8, 6, d)

    def m30(d):
        path = Path(tmp.name) / "30M"
        if not path.exists():
            build_model(path, MODELS["30M"])
        return update_case(str(path), 8, 8, 32, d)

    for dtype in ("float32", "bfloat16"):
        cases[f"update tiny-arith (0.8M), 128x6, {dtype}"] = (lambda d=dtype: tiny(d))
        cases[f"update 30M, 64x32, {dtype}"] = (lambda d=dtype: m30(d))
    wanted = [c.strip() for c in args.only.split(",") if c.strip()]
    results = []
    print(f"CPU flags: {' '.join(cpu_flags())}; torch {torch.__version__}; {args.threads} thread(s); "
          f"default FUSED_MIN_ELEMENTS {lpmod.FUSED_MIN_ELEMENTS}, CHUNK_ELEMENTS {lpmod.CHUNK_ELEMENTS}")
    default, default_no_grad = lpmod.FUSED_MIN_ELEMENTS, lpmod.FUSED_MIN_ELEMENTS_NO_GRAD
    for name, build in cases.items():
        if wanted and not any(w in name for w in wanted):
            continue
        (step, tracked), logits = build()
        for grad in (True, False):
            runs = {"plain": [], "fused": []}
            for which, thr in (("plain", PLAIN), ("fused", FUSED)):  # warm-up, one each
                measure(step, thr, grad, tracked)
            for _ in range(args.reps):
                for which, thr in (("plain", PLAIN), ("fused", FUSED)):
                    runs[which].append(measure(step, thr, grad, tracked))
            mode = "forward+backward" if grad else "forward, no grad"
            row = {"case": name, "mode": mode, "logits": logits,
                   "default_path": "fused" if logits >= (default if grad else default_no_grad) else "plain"}
            for which, rs in runs.items():
                row[f"{which}_s"] = median(r[0] for r in rs)
                row[f"{which}_saved_mb"] = median(r[1] for r in rs) / 2**20
                row[f"{which}_peak_mb"] = median(r[2] for r in rs) / 2**20
            row["speedup"] = row["plain_s"] / row["fused_s"]
            results.append(row)
            print(f"{name:42s} {mode:17s} plain {row['plain_s']:.4f} s, fused {row['fused_s']:.4f} s "
                  f"(speedup {row['speedup']:.2f}); saved for backward {row['plain_saved_mb']:.1f} -> "
                  f"{row['fused_saved_mb']:.1f} MB; peak tensors {row['plain_peak_mb']:.1f} -> "
                  f"{row['fused_peak_mb']:.1f} MB; default: {row['default_path']}", flush=True)
    lpmod.FUSED_MIN_ELEMENTS, lpmod.FUSED_MIN_ELEMENTS_NO_GRAD = default, default_no_grad
    if args.json:
        print(json.dumps({"cpu_flags": cpu_flags(), "threads": args.threads, "reps": args.reps,
                          "torch": torch.__version__, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
