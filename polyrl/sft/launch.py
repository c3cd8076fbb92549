"""Run an SFT job: in this process for one rank, else one process per rank on this machine.

Ranks join a torch.distributed world through a FileStore in a private temporary directory (no
port to pick, nothing left behind) with the platform's backend: gloo on CPU, the accelerator's
collective library on devices, where rank r computes on local device r: its visible-devices
variable is narrowed to that device and the rank claims it as every worker does
(`Platform.claim_device`). The training engine
(`build_engine`) does the rest. SFT needs no Ray: there is no rollout to place.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import signal
import tempfile
import threading
import traceback
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from polyrl.sft.config import SFTConfig

logger = logging.getLogger(__name__)

class RankFailed(RuntimeError):
    """A rank of a multi-process run failed; the message is its error."""


NOT_A_FAILURE = (0, 128 + signal.SIGINT, 128 + signal.SIGTERM)
"""Rank exit codes that are not failures: finished, or stopped by Ctrl-C / SIGTERM."""

JOIN_TIMEOUT_S = 600.0
"""Longest a collective may wait for a slow rank before the run fails naming the problem."""


def run_sft(cfg: SFTConfig) -> dict[str, Any]:
    """Train per `cfg`; returns rank 0's summary (also written to OUTPUT_DIR/summary.json)."""
    from polyrl.sft.trainer import SFTTrainer

    world = cfg.actor.world_size
    if world == 1:
        return SFTTrainer(cfg).fit()
    from polyrl.platform import get_platform

    platform = get_platform(cfg.platform)
    envs = [rank_visibility(platform, rank, os.environ) for rank in range(world)]
    ctx = mp.get_context("spawn")  # fork after torch threads / a CUDA context is unsafe
    with tempfile.TemporaryDirectory(prefix="polyrl-sft-") as tmp:
        errors = ctx.Queue()
        procs = [ctx.Process(target=_rank_main, args=(cfg, rank, world, tmp, errors,
                                                      logging.getLogger().level, envs[rank]), daemon=False)
                 for rank in range(world)]
        with _forwarding_signals(procs) as received:
            for p in procs:
                p.start()
            _wait(procs)
        failures = []
        while not errors.empty():
            failures.append(errors.get())
        failures.sort()
        _raise_interrupt(received, failures, procs)
        if failures:
            rank, message, _code = failures[0]
            raise RankFailed(f"sft rank {rank} failed: {message}")
        bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise RankFailed(f"sft rank(s) {bad} exited with codes {[procs[r].exitcode for r in bad]}")
        import json

        return json.loads((cfg.output_path / "summary.json").read_text())


def rank_visibility(platform: Any, rank: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The visible-devices variable that leaves rank `rank` only its own device, local device
    `rank` of those this run sees (empty on a platform without devices). It is the rank's
    reservation, as Ray's is a worker's: the rank then takes its device with the platform's
    `claim_device()` (the first device it sees, made current), as every worker does. The
    variable narrowed is the one already set (its entries are the run's devices), else the
    platform's first one; a rank with no device left is one line, before any rank starts."""
    if not platform.visible_devices_vars:
        return {}
    var, visible = next(((v, environ[v]) for v in platform.visible_devices_vars if environ.get(v)),
                        (platform.visible_devices_vars[0], None))
    if visible is None:
        return {var: str(rank)}
    order = [x.strip() for x in visible.split(",") if x.strip()]
    if rank >= len(order):
        raise ValueError(f"actor.world_size: sft rank {rank} has no device of its own ({var}={visible} shows "
                         f"{len(order)}); lower actor.world_size to {len(order)} or make more devices visible")
    return {var: order[rank]}


def claim_rank_device(platform: Any) -> torch.device:
    """This rank's device, made current (`Platform.claim_device`): the only device its visible-
    devices variable left it (`rank_visibility`); the CPU on a platform without devices."""
    if platform.torch_device(0).type == "cpu":
        return torch.device("cpu")
    return platform.claim_device()


@contextmanager
def _forwarding_signals(procs: list) -> Iterator[list[int]]:
    """While the ranks run: a SIGINT / SIGTERM to this process is passed on to every rank, whose
    own handlers (trainer/interrupts.py) stop them after the same step with a checkpoint. Yields
    the signals received. The ranks are in their own process group (`_rank_main`), so a Ctrl-C
    at the terminal reaches them once, through here, not twice."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def forward(signum, frame):
        received.append(signum)
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                with suppress(ProcessLookupError):
                    os.kill(p.pid, signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _raise_interrupt(received: list[int], failures: list[tuple[int, str, int]], procs: list) -> None:
    """After a forwarded signal, the outcome as one process reports it: rank 0's "stopped after
    step N" (`TrainingInterrupted`), a second Ctrl-C (`KeyboardInterrupt`), or a stop during
    start-up; a real failure is left to the caller (`RankFailed`)."""
    from polyrl.trainer.interrupts import TrainingInterrupted

    if not received:
        return
    if len(received) > 1 and received[-1] == signal.SIGINT:
        raise KeyboardInterrupt  # a second Ctrl-C: the ranks abandoned their step
    stopped = [(rank, message, code) for rank, message, code in failures if code > 128]
    if stopped:
        _rank, message, code = stopped[0]
        raise TrainingInterrupted(message, code)
    if failures or all(p.exitcode == 0 for p in procs):
        return  # a rank failed (reported as such), or the run had finished its last step
    name = signal.Signals(received[0]).name  # killed before its handlers were installed
    raise TrainingInterrupted(f"{name} received while the ranks were starting: stopped at once, no "
                              "step was interrupted", 128 + received[0])


def _wait(procs: list) -> None:
    """Wait for every rank; once one fails, stop the others (they would wait in a collective
    for the failed rank until the backend's timeout). Ranks stopped by a forwarded signal all
    stop after the same step, so the others are left to finish their checkpoint and exit."""
    from multiprocessing.connection import wait

    running = list(procs)
    while running:
        wait([p.sentinel for p in running])
        done = [p for p in running if not p.is_alive()]
        running = [p for p in running if p.is_alive()]
        if any(p.exitcode not in NOT_A_FAILURE for p in done):
            for p in running:  # SIGKILL: a SIGTERM would ask them to finish a step they cannot
                p.kill()
            for p in running:
                p.join()
            return


def _rank_main(cfg: SFTConfig, rank: int, world: int, tmp: str, errors: Any, level: int,
               env: dict[str, str]) -> None:
    from polyrl.envplan.this_process import apply_here

    apply_here(env)  # the rank's device (`rank_visibility`), before anything asks the driver
    import torch.distributed as dist

    from polyrl.platform import get_platform
    from polyrl.sft.trainer import SFTTrainer
    from polyrl.trainer.interrupts import StartupInterrupted, TrainingInterrupted, abort_on_signals

    os.setpgrp()  # signals come from the parent (`_forwarding_signals`), not the terminal's group
    logging.basicConfig(level=level if rank == 0 else logging.WARNING, format="%(message)s")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        with abort_on_signals():
            platform = get_platform(cfg.platform)
            device = claim_rank_device(platform)
            on_cpu = device.type == "cpu"
            backend = platform.cpu_dist_backend() if on_cpu else platform.dist_backend()
            store = dist.FileStore(str(Path(tmp) / "store"), world)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
            if rank != 0:  # one progress bar and one set of console lines
                cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"progress_bar": False})})
            SFTTrainer(cfg, rank, world, group=None, local_device=device.index or 0).fit()
            dist.destroy_process_group()
    except (TrainingInterrupted, StartupInterrupted) as exc:  # the parent reports rank 0's message
        errors.put((rank, str(exc), exc.exit_code))
        raise SystemExit(exc.exit_code) from None
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        errors.put((rank, f"{type(exc).__name__}: {exc}" if str(exc) else traceback.format_exc(), 1))
        raise SystemExit(1) from None
