"""Weight sync bandwidth: each transport vs a plain in-memory copy of the same bytes, same run.

A ~30M-parameter Qwen2-shaped state dict (fp32, tied embeddings, ~118 MB) is moved
    memcpy        copy_ into preallocated tensors of the same shapes (the baseline)
    in_place      InPlaceTransport -> an engine that copies into its own tensors (colocated)
    broadcast     BroadcastTransport, trainer rank -> 1 rollout rank: direct shared-memory
                  staging (same host; default), the chunked ring with --no-direct, or every
                  byte over gloo/loopback with --no-shm
    object_store  ObjectStoreTransport, driver -> a Ray actor (skipped with --no-ray)
Broadcast is timed end to end (barrier, send + receive + apply, barrier) and its memcpy baseline
is measured in the sender process, interleaved rep by rep with the transfers, so both see the
same machine load. Each rep transfers twice: into an engine that keeps the tensors it is given
(`bucketed_bytes_per_s`, `ratio`: the transport alone, what the issue's goal is about) and into
one that copies them into its own tensors like a real engine (`bucketed_copy_engine_bytes_per_s`,
`copy_engine_ratio`: transport + the engine's load). `ratios` lists every rep's ratio.

    python benchmarks/weights.py                    # ~1 minute on 2 cores
    python benchmarks/weights.py --quick --json     # fewer reps, no Ray; last line is JSON
    polyrl bench weights --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polyrl.distributed.topologies import COLOCATED, DISAGGREGATED  # noqa: E402
from polyrl.weights import WeightSyncConfig, build_transport  # noqa: E402

# Qwen2-style shapes near 30M parameters (as benchmarks/rollout.py's "30M").
HIDDEN, LAYERS, KV, FFN, VOCAB = 512, 9, 128, 1408, 8192


def model_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN), p + "self_attn.q_proj.bias": (HIDDEN,),
            p + "self_attn.k_proj.weight": (KV, HIDDEN), p + "self_attn.k_proj.bias": (KV,),
            p + "self_attn.v_proj.weight": (KV, HIDDEN), p + "self_attn.v_proj.bias": (KV,),
            p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": (FFN, HIDDEN), p + "mlp.up_proj.weight": (FFN, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, FFN),
            p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
        }
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class CopyEngine:
    """update_weights copies into preallocated tensors (what a real engine does)."""

    def __init__(self, like: dict[str, torch.Tensor]):
        self.weights = {k: torch.zeros_like(v) for k, v in like.items()}
        self.weight_version = 0

    def update_weights(self, named, version):
        for k, v in dict(named).items():
            self.weights[k].copy_(v)
        self.weight_version = version


class KeepEngine:
    """update_weights keeps the staged tensors (measures the transport alone)."""

    weight_version = 0

    def update_weights(self, named, version):
        self.weights, self.weight_version = dict(named), version


def memcpy_once(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for k, v in src.items():
        dst[k].copy_(v)
    return time.perf_counter() - t0


# --- broadcast: one process per rank (this file re-run with --rank) ---------------------------

def broadcast_rank(rank: int, world: int, store_path: str, out: str, reps: int, bucket_mb: float,
                   shared_memory: bool, slot_mb: float, slots: int, direct: bool) -> None:
    import datetime

    import torch.distributed as dist

    from polyrl.distributed.layout import RankLayout, build_groups
    from polyrl.distributed.watchdog import Watchdog
    from polyrl.platform import get_platform

    backend = get_platform("cpu").dist_backend()
    store = dist.FileStore(store_path, world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    layout = RankLayout(num_replicas=world - 1, trainer_world_size=1)
    groups = build_groups(layout, rank, backend=backend, timeout_s=120)
    sync = groups.group("weight_sync")
    config = WeightSyncConfig(transport="broadcast", bucket_mb=bucket_mb, timeout_s=120,
                              shared_memory=shared_memory, shm_slot_mb=slot_mb, shm_slots=slots,
                              shm_direct=direct)
    transport = build_transport(config, DISAGGREGATED, group=sync, watchdog=Watchdog(store, rank))
    tensors = model_tensors()
    dst = {k: torch.empty_like(v) for k, v in tensors.items()}
    engines = {"keep": KeepEngine(), "copy": CopyEngine(tensors) if rank else None}
    rows = []
    version = 0

    def transfer() -> tuple[float, Any]:
        nonlocal version
        version += 1
        dist.barrier(group=sync)
        t0 = time.perf_counter()
        if rank == 0:
            stats = transport.send(tensors, version=version)
        else:
            transport.receive(engines[kind])
            stats = transport.last_stats
        dist.barrier(group=sync)
        return time.perf_counter() - t0, stats

    for rep in range(reps + 1):  # rep 0 warms buffers, sockets and page tables
        row: dict = {"memcpy_s": memcpy_once(tensors, dst) if rank == 0 else 0.0}
        for kind in engines:  # the transport alone, then into an engine that copies what it loads
            seconds, stats = transfer()
            row[f"{kind}_end_to_end_s"] = seconds
            row[f"{kind}_transport_s"] = stats.seconds
        row["buckets"] = stats.num_buckets
        rows.append(row)
    if rank != 0:  # the last version arrived bit for bit, in both engines
        ok = all(torch.equal(e.weights[k], v) for e in engines.values() for k, v in tensors.items())
        rows[-1]["exact"] = ok
    Path(out).write_text(json.dumps(rows[1:]))
    os._exit(0)


def run_broadcast(reps: int, bucket_mb: float, receivers: int, shared_memory: bool, slot_mb: float,
                  slots: int, direct: bool) -> list[list[dict]]:
    world = receivers + 1
    with tempfile.TemporaryDirectory() as tmp:
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(world),
                                   "--store", f"{tmp}/store", "--out", f"{tmp}/rank{r}.json",
                                   "--reps", str(reps), "--bucket-mb", str(bucket_mb),
                                   "--shm-slot-mb", str(slot_mb), "--shm-slots", str(slots)]
                                  + ([] if shared_memory else ["--no-shm"])
                                  + ([] if direct else ["--no-direct"]))
                 for r in range(world)]
        for p in procs:
            if p.wait(timeout=600) != 0:
                raise RuntimeError(f"broadcast rank exited with {p.returncode}")
        return [json.loads(Path(f"{tmp}/rank{r}.json").read_text()) for r in range(world)]


# --- object store -------------------------------------------------------------------------------

def run_object_store(tensors, reps: int, bucket_mb: float) -> list[float]:
    import ray

    from polyrl.weights.object_store import create_mailbox

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        @ray.remote(num_cpus=0)
        class Receiver:
            def __init__(self, mailbox, config):
                from polyrl.distributed.topologies import DISAGGREGATED
                from polyrl.weights import build_transport

                self.transport = build_transport(config, DISAGGREGATED, mailbox=mailbox)
                self.version = 0

            def receive(self):
                class Keep:
                    weight_version = self.version

                    def update_weights(self, named, version):
                        self.named = named

                applied = self.transport.receive(Keep())
                self.version = applied
                return time.perf_counter()

        config = WeightSyncConfig(transport="object_store", bucket_mb=bucket_mb, timeout_s=120)
        mailbox = create_mailbox()
        receiver = Receiver.remote(mailbox, config)
        sender = build_transport(config, DISAGGREGATED, mailbox=mailbox)
        times = []
        for rep in range(reps + 1):
            t0 = time.perf_counter()
            done = receiver.receive.remote()
            sender.send(tensors, version=rep + 1)
            t1 = ray.get(done, timeout=120)  # perf_counter is one clock for the whole host
            times.append(t1 - t0)
        ray.kill(receiver)
        ray.kill(mailbox)
        return times[1:]
    finally:
        if started:
            ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    ap.add_argument("--quick", action="store_true", help="3 reps, no Ray")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--bucket-mb", type=float, default=WeightSyncConfig().bucket_mb)
    ap.add_argument("--receivers", type=int, default=1, help="rollout ranks receiving the broadcast")
    ap.add_argument("--no-ray", action="store_true", help="skip the object-store transport")
    ap.add_argument("--no-shm", action="store_true",
                    help="broadcast every byte through the backend (weights.shared_memory=false)")
    ap.add_argument("--no-direct", action="store_true",
                    help="stream through the ring even if the weights fit in /dev/shm (weights.shm_direct=false)")
    ap.add_argument("--shm-slot-mb", type=float, default=WeightSyncConfig().shm_slot_mb,
                    help="shared-memory ring slot size (weights.shm_slot_mb)")
    ap.add_argument("--shm-slots", type=int, default=WeightSyncConfig().shm_slots,
                    help="shared-memory ring slots (weights.shm_slots)")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    reps = args.reps or (3 if args.quick else 7)
    torch.set_num_threads(1)  # like the broadcast ranks: one copy thread per process everywhere
    if args.rank is not None:
        broadcast_rank(args.rank, args.world, args.store, args.out, reps, args.bucket_mb, not args.no_shm,
                       args.shm_slot_mb, args.shm_slots, not args.no_direct)
        return 0

    tensors = model_tensors()
    total = nbytes(tensors)
    params = sum(t.numel() for t in tensors.values())
    print(f"model: {params / 1e6:.1f}M parameters, {len(tensors)} tensors, {total / 2**20:.0f} MiB fp32; "
          f"bucket {args.bucket_mb:g} MB; {reps} reps; torch threads {torch.get_num_threads()}")

    dst = {k: torch.empty_like(v) for k, v in tensors.items()}
    memcpy_once(tensors, dst)
    memcpy_s = statistics.median(memcpy_once(tensors, dst) for _ in range(reps))

    engine = CopyEngine(tensors)
    in_place = build_transport(WeightSyncConfig(), COLOCATED, engine=engine)
    in_place.send(tensors, 0)
    in_place_s = statistics.median(in_place.send(tensors, v + 1).seconds for v in range(reps))

    ranks = run_broadcast(reps, args.bucket_mb, args.receivers, not args.no_shm, args.shm_slot_mb,
                          args.shm_slots, not args.no_direct)
    sender = ranks[0]
    bcast_s = statistics.median(r["keep_end_to_end_s"] for r in sender)
    bcast_copy_s = statistics.median(r["copy_end_to_end_s"] for r in sender)
    bcast_memcpy_s = statistics.median(r["memcpy_s"] for r in sender)
    exact = all(r[-1].get("exact", True) for r in ranks[1:])

    results = {
        "params": params, "bytes": total, "bucket_mb": args.bucket_mb, "receivers": args.receivers,
        "shared_memory": not args.no_shm, "shm_direct": not (args.no_shm or args.no_direct),
        "reps": reps, "memcpy_bytes_per_s": total / bcast_memcpy_s,
        "memcpy_main_bytes_per_s": total / memcpy_s,
        "in_place_bytes_per_s": total / in_place_s,
        "bucketed_bytes_per_s": total / bcast_s,
        "bucketed_sender_bytes_per_s": total / statistics.median(r["keep_transport_s"] for r in sender),
        "bucketed_copy_engine_bytes_per_s": total / bcast_copy_s,
        "ratios": [r["memcpy_s"] / r["keep_end_to_end_s"] for r in sender],
        "buckets": sender[0]["buckets"], "bucketed_exact": exact,
    }
    results["ratio"] = results["bucketed_bytes_per_s"] / results["memcpy_bytes_per_s"]
    results["copy_engine_ratio"] = results["bucketed_copy_engine_bytes_per_s"] / results["memcpy_bytes_per_s"]
    if not (args.quick or args.no_ray):
        obj_s = statistics.median(run_object_store(tensors, reps, args.bucket_mb))
        results["object_store_bytes_per_s"] = total / obj_s
        results["object_store_ratio"] = results["object_store_bytes_per_s"] / results["memcpy_bytes_per_s"]

    gb = 1e9
    print(f"{'transport':<14}{'GB/s':>8}{'x memcpy':>10}")
    for name, key in (("memcpy", "memcpy_bytes_per_s"), ("in_place", "in_place_bytes_per_s"),
                      ("broadcast", "bucketed_bytes_per_s"),
                      ("  +engine copy", "bucketed_copy_engine_bytes_per_s"),
                      ("object_store", "object_store_bytes_per_s")):
        if key in results:
            print(f"{name:<14}{results[key] / gb:>8.2f}{results[key] / results['memcpy_bytes_per_s']:>10.2f}")
    print(f"broadcast: {results['buckets']} buckets, delivered exactly: {exact}; "
          f"ratio {results['ratio']:.2f} (goal >= 0.5)")
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
