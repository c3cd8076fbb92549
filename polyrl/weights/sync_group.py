"""The weight-sync group as a broadcast data path sees it: who sends, who receives, where bucket
bytes live on each end, the watchdog that names a rank that does not arrive, and the one
collective both paths share (the all-reduce vote).

Bucket bytes live on `SyncGroup.device` (the sender packs there, receivers stage there), so the
backend that carries them is the group's backend for that device type (`wire_backend`: nccl for
cuda on a `cpu:gloo,cuda:nccl` group). Both ends must name the same device type, or the sender's
broadcasts go through NCCL while the receivers wait in gloo and nothing arrives until the
watchdog ends the run; the first transfer checks it (`broadcast.py`, "choose data path"). Control
tensors (votes, commits) stay on the CPU, the gloo side of every group (`Platform.group_backend`),
so the ranks meet in them whatever device each stages on and a mismatch fails in one line."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from polyrl.distributed.layout import group_leader
from polyrl.platform.base import device_backend
from polyrl.distributed.watchdog import CollectiveError, CollectiveTimeout, Watchdog, default_watchdog


class SyncGroup:
    def __init__(self, group: Any, watchdog: Watchdog | None = None, device: torch.device | None = None):
        self.group = group
        self.src = group_leader(group)
        """The sender: the group's leader, never a literal rank 0 (R5)."""
        self.members = dist.get_process_group_ranks(group)
        self.receivers = [r for r in self.members if r != self.src]
        self.device = torch.device("cpu") if device is None else torch.device(device)
        """Where this rank packs (the sender) or stages (receivers) bucket bytes: the rank's
        platform device, given alike on both ends (workers pass theirs); None means the CPU."""
        self._watchdog = watchdog

    @property
    def watchdog(self) -> Watchdog:
        return self._watchdog if self._watchdog is not None else default_watchdog()

    @property
    def is_sender(self) -> bool:
        return dist.get_rank() == self.src

    def at_version(self, version: int) -> None:
        """Label this rank's heartbeats and errors with the transfer's version: it is the
        trainer step that produced the weights (one version per update), so a timeout says
        which step it happened in instead of the watchdog's initial step 0."""
        self.watchdog.set_step(version)

    @property
    def wire_backend(self) -> str:
        """The backend that carries this rank's bucket bytes: the group's for `device`."""
        return device_backend(str(dist.get_backend(self.group)), self.device.type)

    def control(self, t: torch.Tensor) -> torch.Tensor:
        """Control tensors stay on the CPU (gloo on every platform): ranks whose staging devices
        differ still meet in them, so the device check can fail instead of hanging."""
        return t.cpu()

    def vote_min(self, phase: str, deadline: float, value: int) -> int:
        """One all-reduce (MIN) over the group of each rank's `value`, on the CPU."""
        watch = self.watchdog.watch(self.group, phase=phase, what="weight broadcast",
                                    timeout_s=max(deadline - time.monotonic(), 0.001))
        flag = self.control(torch.tensor([int(value)], dtype=torch.int64))
        watch.wait(dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group, async_op=True))
        return int(flag[0])

    def peer_lost(self, ranks: list[int], timed_out: bool, detail: str, phase: str) -> CollectiveError:
        """The watchdog's error for a side channel (the shared-memory ring) whose peer `ranks`
        stalled or exited, with each one's last heartbeat."""
        dog = self.watchdog
        cls = CollectiveTimeout if timed_out else CollectiveError
        return cls("weight broadcast (shared memory)", phase, dog.step, self.members,
                   {r: dog.last_seen(r) for r in ranks}, detail)
