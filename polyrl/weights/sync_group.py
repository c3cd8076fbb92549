"""The weight-sync group as a broadcast data path sees it: who sends, who receives, the
watchdog that names a rank that does not arrive, and the one collective both paths share
(the all-reduce vote)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from polyrl.distributed.layout import group_leader
from polyrl.distributed.watchdog import CollectiveError, CollectiveTimeout, Watchdog, default_watchdog


class SyncGroup:
    def __init__(self, group: Any, watchdog: Watchdog | None = None, device: torch.device | None = None):
        self.group = group
        self.src = group_leader(group)
        """The sender: the group's leader, never a literal rank 0 (R5)."""
        self.members = dist.get_process_group_ranks(group)
        self.receivers = [r for r in self.members if r != self.src]
        self.device = device
        """Where receivers stage buckets (the platform's device for device backends)."""
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

    def control(self, t: torch.Tensor) -> torch.Tensor:
        """Small control tensors live where the backend wants them (the staging device)."""
        return t if self.device is None else t.to(self.device)

    def vote(self, phase: str, deadline: float, ok: bool) -> bool:
        """One all-reduce (MIN) over the group: True when every rank says `ok`."""
        watch = self.watchdog.watch(self.group, phase=phase, what="weight broadcast",
                                    timeout_s=max(deadline - time.monotonic(), 0.001))
        flag = self.control(torch.tensor([int(ok)], dtype=torch.int64))
        watch.wait(dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group, async_op=True))
        return bool(int(flag.cpu()[0]))

    def peer_lost(self, ranks: list[int], timed_out: bool, detail: str, phase: str) -> CollectiveError:
        """The watchdog's error for a side channel (the shared-memory ring) whose peer `ranks`
        stalled or exited, with each one's last heartbeat."""
        dog = self.watchdog
        cls = CollectiveTimeout if timed_out else CollectiveError
        return cls("weight broadcast (shared memory)", phase, dog.step, self.members,
                   {r: dog.last_seen(r) for r in ranks}, detail)
