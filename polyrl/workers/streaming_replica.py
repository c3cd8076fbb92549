"""A rollout replica of the streaming topology (generation overlaps training, bounded staleness).

A threaded Ray actor: several `generate_groups` calls run at once (their requests share the
engine's continuous batching; multi-turn agent rollouts send every turn through the gate) while
`receive_weights` fetches the next policy version from the Ray object store and applies it
through a `WeightGate` (abort + continue, or wait; see partial_rollout.py). The replica joins
no collective group: the trainer publishes each version to a mailbox actor, so a replica that
dies can be replaced by a new one that fetches the current version at start-up, which a fixed
torch.distributed world cannot offer.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from polyrl.distributed.role import RolePlan
from polyrl.distributed.waits import gather
from polyrl.platform import get_platform
from polyrl.batch import RolloutBatch
from polyrl.rollout.base import SamplingParams
from polyrl.workers.generation import rollout_rows, sampling_params, to_batch
from polyrl.workers.partial_rollout import GatedEngine, WeightGate, generate_resumable
from polyrl.workers.rollout_worker import build_replica_engine, open_transport
from polyrl.job import JobConfig


class StreamingReplica:
    def __init__(self, cfg: JobConfig, role: RolePlan, mailbox: Any):
        self.cfg, self.role, self.index, self.mailbox = cfg, role, role.index, mailbox
        torch.set_num_threads(role.num_threads)
        self.platform = get_platform(cfg.platform)
        self.device = self.platform.claim_device()  # the Ray reservation's, made current
        self.busy_s = 0.0

    def setup(self) -> int:
        """Build the engine and catch up with the newest published policy version."""
        cfg = self.cfg
        self.engine = build_replica_engine(cfg, self.role, self.device, self.platform)
        self.tokenizer = self.engine.tokenizer
        self.gate = WeightGate(self.engine, cfg.async_.partial_rollout)
        self.gated = GatedEngine(self.engine, self.gate)
        self.transport = open_transport(self.role, cfg.weights, mailbox=self.mailbox)
        [latest] = gather([self.mailbox.latest_version.remote()], ["weight mailbox"],
                          phase=f"replica {self.index} start-up", timeout_s=cfg.ray.timeout_s)
        if latest is not None and latest > self.engine.weight_version:
            self.receive_weights()
        return self.engine.weight_version

    def generate_groups(self, group_ids: list[int], rows: list[Any], sampling: SamplingParams,
                        seeds: list[int]) -> dict[int, RolloutBatch]:
        """n samples per data row (`PromptSample`); a group's samples come back together, keyed
        by group id."""
        t0 = time.perf_counter()
        batch = self._generate(rows, sampling, seeds, group_ids)
        self.busy_s += time.perf_counter() - t0
        return {g: batch.select((batch.group == g).nonzero().flatten()) for g in group_ids}

    def generate(self, rows: list[Any], sampling: SamplingParams, seeds: list[int] | None = None,
                 group_offset: int = 0) -> RolloutBatch:
        """The WorkerGroup generate API (validation), through the same gate."""
        return self._generate(rows, sampling, seeds, [group_offset + i for i in range(len(rows))])

    def _generate(self, rows: list[Any], sampling: SamplingParams, seeds: list[int] | None,
                  groups: list[int]) -> RolloutBatch:
        if self.cfg.agent.enabled:  # multi-turn: every turn through the gate (GatedEngine)
            batch = rollout_rows(self.gated, self.tokenizer, rows, sampling, seeds, 0, self.cfg.agent)
            batch.group = torch.as_tensor(groups, dtype=torch.long)[batch.group]
            return batch
        prompts = [r.prompt_ids for r in rows]
        outputs = generate_resumable(self.engine, self.gate, prompts, sampling_params(sampling, seeds, len(rows)))
        return to_batch(self.tokenizer, self.engine.eos_token_ids, prompts, outputs, groups)

    def receive_weights(self) -> int:
        """Fetch the newest published version and apply it (all or nothing); returns it."""
        return self.transport.receive(self.gate)

    def weight_version(self) -> int:
        return self.engine.weight_version

    def health(self) -> dict:
        return {"replica": self.index, "aborted_requests": self.gate.aborted_requests,
                "busy_s": self.busy_s, **self.engine.health()}

    def shutdown(self) -> None:
        pass
