"""Run a function on N real processes joined in a gloo world (FileStore rendezvous in a tmp dir).

    results = run_world(fn, 4, tmp_path, args=(...,))   # fn(rank, world_size, *args) -> picklable
    values = run_world_ok(fn, 4, tmp_path)                # every rank must succeed

Each rank gets a Watchdog on the shared FileStore (installed as the process default). A rank's
result is ("ok", value) or ("error", exception type name, message); a rank that never reported
is ("missing",). Processes are forked from a forkserver and killed at the deadline, so a
hang fails the test instead of hanging it.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch


def run_world(fn: Callable, world_size: int, tmp_path: Path, *, args: tuple = (),
              timeout_s: float = 40.0, backend_timeout_s: float = 30.0) -> dict[int, tuple]:
    ctx = mp.get_context("forkserver")
    # One fresh server process imports torch once; every rank is forked from it (clean: no
    # threads, no Ray state from the test process), which keeps a 5-rank world under seconds.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "polyrl.distributed.watchdog",
                                "polyrl.platform", "gloo_world"])
    store_path = tmp_path / "store"
    procs = [ctx.Process(target=_child, args=(fn, rank, world_size, str(store_path), str(tmp_path),
                                              backend_timeout_s, args), daemon=True)
             for rank in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.1))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    results = {}
    for rank in range(world_size):
        path = tmp_path / f"result-{rank}.pkl"
        results[rank] = pickle.loads(path.read_bytes()) if path.exists() else ("missing",)
    return results


def run_world_ok(fn: Callable, world_size: int, tmp_path: Path, **kwargs: Any) -> dict[int, Any]:
    """`run_world`, asserting that every rank finished without error; rank -> its value."""
    res = run_world(fn, world_size, tmp_path, **kwargs)
    for rank, r in res.items():
        assert r[0] == "ok", f"rank {rank}: {r}"
    return {rank: r[1] for rank, r in res.items()}


def _child(fn, rank, world_size, store_path, out_dir, backend_timeout_s, args):
    torch.set_num_threads(1)
    try:
        import torch.distributed as dist

        from polyrl.distributed.watchdog import Watchdog, set_default_watchdog
        from polyrl.platform import get_platform

        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(get_platform("cpu").dist_backend(), store=store, rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=backend_timeout_s))
        set_default_watchdog(Watchdog(store, rank))
        result: tuple[Any, ...] = ("ok", fn(rank, world_size, *args))
    except BaseException as exc:  # noqa: BLE001 - report everything to the parent
        result = ("error", type(exc).__name__, str(exc), traceback.format_exc())
    tmp = Path(out_dir) / f"result-{rank}.tmp"
    tmp.write_bytes(pickle.dumps(result))
    tmp.rename(Path(out_dir) / f"result-{rank}.pkl")
    # Skip interpreter teardown: a rank whose collective was abandoned (the point of several
    # tests) would otherwise wait for the backend's own timeout while destroying its groups.
    os._exit(0)


class DictEngine:
    """A stand-in rollout engine: all-or-nothing `update_weights` over a dict of tensors."""

    def __init__(self, weights: dict[str, torch.Tensor], version: int = 0):
        self.weights = {k: v.clone() for k, v in weights.items()}
        self.weight_version = version
        self.calls = 0

    def update_weights(self, named_tensors, version: int) -> None:
        named = dict(named_tensors)
        if set(named) != set(self.weights):
            raise ValueError(f"names differ: {sorted(set(named) ^ set(self.weights))}")
        for k, v in named.items():
            if v.shape != self.weights[k].shape or v.dtype != self.weights[k].dtype:
                raise ValueError(f"{k}: {tuple(v.shape)} {v.dtype} != "
                                 f"{tuple(self.weights[k].shape)} {self.weights[k].dtype}")
        for k, v in named.items():
            self.weights[k].copy_(v)
        self.weight_version = version
        self.calls += 1


def model_weights(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """A small mixed-dtype state dict: fp32 matrices and vectors, a bf16 table, an int buffer."""
    g = torch.Generator().manual_seed(seed)
    out = {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(48, 16, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(16, 48, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(16, generator=g),
        "model.norm.weight": torch.randn(16, generator=g),
        "model.positions": torch.arange(8, dtype=torch.int64) + seed,
    }
    return {k: (v * scale if v.is_floating_point() else v) for k, v in out.items()}


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
