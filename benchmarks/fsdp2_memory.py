"""Per-rank training state of DDP and FSDP2 at N = 1, 2 ranks, and memory during a weight sync.

    python benchmarks/fsdp2_memory.py [--size 30M] [--ranks 1,2] [--json] [--no-sync]

For each strategy and rank count, N gloo processes on this machine build the engine around the
same random-init Qwen2 (`benchmarks/_tiny.py`), run one forward/backward and one AdamW step
through the engine, and report the bytes each rank holds (training/checkpoint_io.py
`local_state_bytes`: a DTensor counts its local shard):

    params     after building the engine
    grads      after the backward, before the step
    optimizer  after the step (AdamW: exp_avg + exp_avg_sq, plus a scalar step per tensor)

Weight sync: the resident set size (/proc/self/statm) is read after every tensor
`named_weights()` yields, the consumer keeping none; the largest rise over the value before the
sync is reported next to the largest single tensor and the whole model. These are counts of
bytes, not timings: the same on any machine for the same shapes.

Weight sync through the transports (`_sync_rank`, FSDP2 on 2 trainer ranks + 1 rollout rank):
each way a version leaves the trainer (in place into a native engine on every trainer rank,
broadcast to the rollout rank over gloo and over shared memory, and the checkpoint's `policy/`
directory) runs twice on the same engine: *streamed* (`engine.weight_stream()`: specs up front,
each tensor gathered when the transport needs it) and *listed* (the stream listed first, which
is what every transport did before: `named_items` listed its input). Reported for the sending
rank: the peak bytes of gathered tensors alive at once (each gathered tensor is tracked until
it is freed) and the buffers the transport keeps (the gloo path's two scratch buckets; the
shared-memory segment, which is the receivers' staging in /dev/shm, is listed apart). Buckets
are 16 MiB here (`weights.bucket_mb`, default 64), so that a bucket is smaller than the model.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import resource
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MiB = 2**20
SYNC_BUCKET_MB = 16


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rank(rank: int, world: int, strategy: str, model_dir: str, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from polyrl.batch import Ragged, RolloutBatch, collate
    from polyrl.platform import get_platform
    from polyrl.training import build_engine
    from polyrl.training.checkpoint_io import local_state_bytes
    from polyrl.training.config import ActorConfig
    from polyrl.training.model_loading import load_causal_lm

    torch.set_num_threads(1)
    platform = get_platform("cpu")
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    cfg = ActorConfig(strategy=strategy, world_size=world, lr=1e-5)
    device = platform.torch_device(0)
    engine = build_engine(load_causal_lm(model_dir), cfg, platform, device, rank=rank, world_size=world,
                          group=dist.group.WORLD, horizon=10)
    result = {"params": local_state_bytes(engine.model, engine.optimizer)["params"]}
    g = torch.Generator().manual_seed(rank)
    rows = [torch.randint(2, 100, (64,), generator=g) for _ in range(4)]
    ids = Ragged.from_rows(rows, torch.long)
    zero = torch.zeros(4, dtype=torch.long)
    batch = RolloutBatch(prompt_ids=ids, response_ids=ids, loss_mask=Ragged.full_like(ids, 1.0, torch.float32),
                         group=zero, stop_reason=zero, finished_with_eos=zero.bool(), weight_version=zero,
                         min_version=zero, max_version=zero, continuations=zero)
    logprob, _ = engine.forward(collate(batch, [0, 1, 2, 3], device))
    loss = -logprob.mean() / world
    engine.backward(loss)
    result["grads"] = local_state_bytes(engine.model, engine.optimizer)["grads"]
    engine.optimizer_step(float(loss.detach()))
    result["optimizer"] = local_state_bytes(engine.model, engine.optimizer)["optimizer"]
    # weight sync: the consumer keeps nothing, so any rise is what the engine holds
    before, rise, largest, total = _rss(), 0, 0, 0
    for _, t in engine.named_weights():
        largest, total = max(largest, t.nbytes), total + t.nbytes
        rise = max(rise, _rss() - before)
        del t
    result.update(sync_rss_rise=rise, largest_tensor=largest, model_bytes=total,
                  peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _sync_rank(rank: int, world: int, model_dir: str, store: str, out: str) -> None:
    import weakref

    import torch
    import torch.distributed as dist

    from polyrl.distributed.layout import RankLayout, build_groups
    from polyrl.distributed.watchdog import Watchdog, set_default_watchdog
    from polyrl.platform import get_platform
    from polyrl.rollout.native.engine import NativeEngine
    from polyrl.training import build_engine
    from polyrl.training.checkpoint_io import model_tensors, write_hf_dir
    from polyrl.distributed.topologies import COLOCATED, DISAGGREGATED
    from polyrl.weights import WeightSyncConfig, build_transport
    from polyrl.weights.base import WeightStream
    from polyrl.training.config import ActorConfig
    from polyrl.training.model_loading import load_causal_lm

    torch.set_num_threads(1)
    platform = get_platform("cpu")
    file_store = dist.FileStore(store, world)
    dist.init_process_group("gloo", store=file_store, rank=rank, world_size=world)
    set_default_watchdog(Watchdog(file_store, rank))
    trainers = world - 1
    groups = build_groups(RankLayout(num_replicas=1, tensor_parallel_size=1, trainer_world_size=trainers),
                          rank, backend="gloo", timeout_s=600)
    modes = {"broadcast (gloo)": dict(shared_memory=False), "broadcast (shared memory)": {}}
    transports = {m: build_transport(WeightSyncConfig(transport="broadcast", timeout_s=600, bucket_mb=SYNC_BUCKET_MB,
                                                      **extra),
                                     DISAGGREGATED, group=groups.group("weight_sync"))
                  for m, extra in modes.items()} if "weight_sync" in groups.groups else {}
    ways = ("streamed", "listed")
    if groups.info.role != "trainer":
        class Drop:  # a receiver that keeps nothing: only the sender is measured
            weight_version = 0

            def update_weights(self, named, version):
                self.weight_version = version

        for transport in transports.values():
            for _ in ways:
                transport.receive(Drop())
        Path(out).write_text(json.dumps({}))
        dist.destroy_process_group()
        return
    cfg = ActorConfig(strategy="fsdp2", world_size=trainers)
    engine = build_engine(load_causal_lm(model_dir), cfg, platform, platform.torch_device(0), rank=rank,
                          world_size=trainers, group=groups.group("trainer"), horizon=None)
    native = NativeEngine(model_dir, max_model_len=64)
    in_place = build_transport(WeightSyncConfig(), COLOCATED, engine=native)

    def tracked(peaks: dict) -> WeightStream:
        stream, refs = engine.weight_stream(), []

        def gathered():
            for name, tensor in stream:
                refs.append(weakref.ref(tensor))
                peaks["live"] = max(peaks["live"], sum(r().nbytes for r in refs if r() is not None))
                yield name, tensor
                del tensor
        return WeightStream(stream.specs, gathered(), device=stream.device)

    def run(way: str, send, transport=None) -> dict:
        peaks = {"live": 0}
        stream = tracked(peaks)
        send(stream if way == "streamed" else list(stream))
        held = transport.buffer_bytes() if transport is not None else {"scratch": 0, "shared": 0}
        return {**peaks, **held}

    result: dict = {}
    version = 0
    for mode, transport in ((m, transports.get(m)) for m in modes):
        for way in ways:
            version += 1
            if transport is not None:
                result[f"{mode}|{way}"] = run(way, lambda s, v=version, t=transport: t.send(s, v), transport)
            else:  # the other trainer ranks join each gather
                for _ in engine.named_weights():
                    pass
    for way in ways:
        version += 1
        result[f"in place (native engine)|{way}"] = run(way, lambda s, v=version: in_place.send(s, v))
    with tempfile.TemporaryDirectory() as tmp:
        for way in ways:
            result[f"checkpoint policy/|{way}"] = run(way, lambda s, w=way: write_hf_dir(
                Path(tmp) / w, model_tensors(engine.model, s if isinstance(s, WeightStream)
                                             else WeightStream([(n, tuple(t.shape), t.dtype) for n, t in s], s)),
                engine.model.config, write=rank == 0))
    result["shard"] = sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
                          for t in engine.model.parameters())
    Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def run_ranks(label: str, run: Path, world: int, target, *args) -> list[dict]:
    """`target(rank, world, *args, store, out)` in `world` spawned processes; each rank's JSON."""
    ctx = mp.get_context("spawn")
    run.mkdir()
    procs = [ctx.Process(target=target, args=(r, world, *args, str(run / "store"), str(run / f"rank{r}.json")))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"{label}: a rank exited with {p.exitcode}")
    return [json.loads((run / f"rank{r}.json").read_text()) for r in range(world)]


def measure_sync(model_dir: str, tmp: Path, trainers: int = 2) -> dict:
    return run_ranks("sync", tmp / "sync", trainers + 1, _sync_rank, model_dir)[0]


def measure(strategy: str, world: int, model_dir: str, tmp: Path) -> list[dict]:
    return run_ranks(f"{strategy} x{world}", tmp / f"{strategy}-{world}", world, _rank, strategy, model_dir)


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    return f"{model}; " + " ".join(f for f in wanted if f in flags)


def main(argv: list[str] | None = None) -> int:
    from _tiny import MODELS, build_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="30M", choices=sorted(MODELS))
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--strategies", default="ddp,fsdp2")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-sync", action="store_true", help="skip the weight-sync measurement")
    args = parser.parse_args(argv)
    rows, sync = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / args.size
        num_params = build_model(model_dir, MODELS[args.size])
        for strategy in args.strategies.split(","):
            for world in (int(n) for n in args.ranks.split(",")):
                ranks = measure(strategy, world, str(model_dir), Path(tmp))
                worst = {k: max(r[k] for r in ranks) for k in ranks[0]}
                rows.append({"strategy": strategy, "ranks": world, **worst})
        if not args.no_sync:
            sync = measure_sync(str(model_dir), Path(tmp))
    header = {"date": datetime.date.today().isoformat(), "cpu": cpu_flags(), "size": args.size,
              "num_params": num_params}
    if args.json:
        print(json.dumps({**header, "rows": rows, "sync": sync}, indent=2))
        return 0
    print(f"{header['date']}  {args.size} ({num_params / 1e6:.1f}M parameters, fp32)  {header['cpu']}")
    print("per rank, the largest over the ranks, MiB:")
    print(f"{'strategy':8} {'N':>2} {'params':>8} {'grads':>8} {'optim':>8} {'total':>8} "
          f"{'sync rise':>10} {'largest':>8} {'model':>8} {'peak RSS':>9}")
    for r in rows:
        total = r["params"] + r["grads"] + r["optimizer"]
        print(f"{r['strategy']:8} {r['ranks']:>2} {r['params'] / MiB:8.1f} {r['grads'] / MiB:8.1f} "
              f"{r['optimizer'] / MiB:8.1f} {total / MiB:8.1f} {r['sync_rss_rise'] / MiB:10.1f} "
              f"{r['largest_tensor'] / MiB:8.1f} {r['model_bytes'] / MiB:8.1f} {r['peak_rss'] / MiB:9.0f}")
    if sync:
        print(f"\nweight sync from fsdp2 shards (2 trainer ranks + 1 rollout rank), sending rank, MiB; "
              f"its shard {sync['shard'] / MiB:.1f}:")
        print(f"{'path':28} {'way':9} {'gathered alive':>15} {'scratch':>8} {'held':>7} {'shared seg':>10}")
        for key, peaks in sync.items():
            if key == "shard":
                continue
            path, way = key.split("|")
            held = peaks["live"] + peaks["scratch"]
            print(f"{path:28} {way:9} {peaks['live'] / MiB:15.1f} {peaks['scratch'] / MiB:8.1f} "
                  f"{held / MiB:7.1f} {peaks['shared'] / MiB:10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
