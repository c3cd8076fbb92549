"""Activation memory per rank under sequence parallelism: 1 rank at length L vs k ranks at k x L.

    python benchmarks/sequence_parallel.py [--size 4M] [--length 2048] [--k 2] [--strategy fsdp2] [--json]

Each configuration runs in its own gloo world of spawned processes (one thread each) around the
same random-init Qwen2 (`benchmarks/_tiny.py`): the engine is built through `build_engine`
(`actor.sequence_parallel_size` = the world size), then one training micro-batch, a single
sample of L tokens (half prompt, half response) packed into one row, runs forward + backward.
Reported per rank, for that one step:

    saved     bytes autograd kept for the backward (each storage once, parameters excluded):
              the activation memory, counted exactly, the same on any machine
    tensors   the peak of live tensor bytes during the step over those live before it
              (torch's MemTracker, a second identical step): activations, gradients, the
              attention's and the head's temporaries, the collectives' buffers
    peak      the rise of the resident set's high-water mark (VmHWM, reset through
              /proc/self/clear_refs before the step) over the resident set before it: the
              same seen by the OS, allocator slack included

Configurations: 1 rank at L, 1 rank at k x L (what the longer sequence costs unsplit), and k
ranks at k x L (sequence parallel). The parameters, the gradients they get and the optimizer
are outside `saved`; `peak` includes the gradients (sharded by fsdp2 over the k ranks).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform as host
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MiB = 2**20


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _rank(rank: int, world: int, strategy: str, model_dir: str, length: int, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from logprobs import SavedBytes
    from polyrl.batch import Ragged, RolloutBatch
    from polyrl.platform import get_platform
    from polyrl.training import build_engine
    from polyrl.training.config import ActorConfig
    from polyrl.training.model_loading import load_causal_lm

    torch.set_num_threads(1)
    platform = get_platform("cpu")
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    cfg = ActorConfig(strategy=strategy, world_size=world, sequence_parallel_size=world, packing="on",
                      micro_batch_tokens=max(length, 64), lr=1e-5)
    device = platform.torch_device(0)
    engine = build_engine(load_causal_lm(model_dir), cfg, platform, device, rank=rank, world_size=world,
                          group=dist.group.WORLD, horizon=10)
    g = torch.Generator().manual_seed(0)  # the same sample on every rank of the sp group
    half = length // 2
    prompt = Ragged.from_rows([torch.randint(2, 100, (half,), generator=g)], torch.long)
    response = Ragged.from_rows([torch.randint(2, 100, (length - half + 1,), generator=g)], torch.long)
    zero = torch.zeros(1, dtype=torch.long)
    batch = RolloutBatch(prompt_ids=prompt, response_ids=response,
                         loss_mask=Ragged.full_like(response, 1.0, torch.float32),
                         group=zero, stop_reason=zero, finished_with_eos=zero.bool(), weight_version=zero,
                         min_version=zero, max_version=zero, continuations=zero)
    (mb,) = list(engine.micro_batches(batch))  # fed: prompt + response - 1 = `length` tokens

    def step(saved: SavedBytes | None = None) -> None:
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t) if saved else contextlib.nullcontext():
            logprob, _ = engine.forward(mb)
        engine.backward(-(logprob * mb.response_mask).sum() / mb.response_mask.sum())
        engine.optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: lazily built state (FSDP2's buffers, allocator arenas) is baseline
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    before = _status("VmRSS")
    saved = SavedBytes()
    step(saved)
    peak = _status("VmHWM") - before
    dist.barrier()
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(engine.model)
    with tracker:
        start = next(iter(tracker.get_tracker_snapshot("current").values()))["Total"]
        step()
    tensors = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"] - start
    Path(out).write_text(json.dumps({"saved": saved.total, "peak": peak, "tensors": tensors,
                                     "fed": int(mb.input_ids.shape[1])}))
    dist.destroy_process_group()


def run_world(world: int, strategy: str, model_dir: str, length: int, tmp: Path) -> list[dict]:
    ctx = mp.get_context("spawn")
    run = tmp / f"w{world}-L{length}"
    run.mkdir()
    procs = [ctx.Process(target=_rank, args=(r, world, strategy, model_dir, length, str(run / "store"),
                                             str(run / f"rank{r}.json"))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"a rank of the {world}-rank run at length {length} failed (exit {p.exitcode})")
    return [json.loads((run / f"rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    from _tiny import MODELS, build_model
    from logprobs import cpu_flags

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="4M", choices=sorted(MODELS))
    ap.add_argument("--length", type=int, default=2048, help="L: tokens of the one-rank sequence")
    ap.add_argument("--k", type=int, default=2, help="sequence-parallel ranks")
    ap.add_argument("--strategy", default="fsdp2", choices=("ddp", "fsdp2"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    L, k = args.length, args.k
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        params = build_model(model_dir, MODELS[args.size], max_positions=k * L + 64)
        for world, length in ((1, L), (1, k * L), (k, k * L)):
            ranks = run_world(world, args.strategy, str(model_dir), length, Path(tmp))
            rows.append({"ranks": world, "length": length, "fed_per_rank": ranks[0]["fed"],
                         "saved_mib": max(r["saved"] for r in ranks) / MiB,
                         "tensors_mib": max(r["tensors"] for r in ranks) / MiB,
                         "peak_mib": max(r["peak"] for r in ranks) / MiB})
    meta = {"model": args.size, "params": params, "strategy": args.strategy, "k": k,
            "cpu": host.processor() or host.machine(), "cpu_flags": cpu_flags(), "cores": os.cpu_count()}
    if args.json:
        print(json.dumps({"meta": meta, "rows": rows}, indent=1))
        return
    print(f"# {args.size} Qwen2 ({params / 1e6:.1f}M params), actor.strategy={args.strategy}, fp32, "
          f"CPU flags: {' '.join(meta['cpu_flags']) or 'none'}, {meta['cores']} cores")
    print("| ranks | sequence | tokens per rank | saved activations (MiB) | peak tensors (MiB) | peak RSS rise (MiB) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['ranks']} | {r['length']} | {r['fed_per_rank']} | {r['saved_mib']:.1f} | "
              f"{r['tensors_mib']:.1f} | {r['peak_mib']:.1f} |")


if __name__ == "__main__":
    main()
