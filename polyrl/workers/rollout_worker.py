"""A rollout rank of the disaggregated topology: an engine on its own resources that receives
each new policy version over the weight transport. Also the pieces every actor outside the
policy ranks shares: the replica engine (`build_replica_engine`, which the streaming replica
builds the same way) and the transport of a plan (`open_transport`).

All processes of a disaggregated run share one torch.distributed world, its `RolePlan.layout`:
the trainer ranks first, then every replica's ranks (`RankLayout`). Weights travel inside the
"weight_sync" group from its leader — the group's local rank 0 mapped to a global rank, never a
hard-coded rank 0 (R5).

A replica of k > 1 ranks (rollout.tensor_parallel_size) has one engine, on its replica leader
(local rank 0 of the "replica" group). Every rank receives each version over the transport as a
one-rank replica does, then hands it to that engine through the leader
(`ReplicaPush.update_weights`): TensorRT-LLM takes each rank's device IPC handles
(`trtllm.push_rank_weights`); the other engines get every tensor once, from the rank that owns
it (`weight_flush.push_shares`). Vision-language models first ask the leader's engine whether it
loads in parts (`negotiate_partial_loading`). On a device platform the leader is the replica's
engine host: it reserves no device through Ray and sees all k devices of its replica (its
planned visible-devices variable), so its engine's TP workers run on exactly those.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from polyrl.builtin import resolve
from polyrl.distributed.layout import build_groups
from polyrl.distributed.role import RolePlan
from polyrl.rollout.engines.weight_flush import PushResult, push_shares, read_hf_config
from polyrl.platform import get_platform
from polyrl.rollout.factory import build_disaggregated_engine
from polyrl.weights import WEIGHT_TRANSPORTS, WeightTransport
from polyrl.batch import RolloutBatch
from polyrl.rollout.base import SamplingParams
from polyrl.workers.generation import rollout_rows
from polyrl.job import JobConfig


CONTEXT = {"in_place": ("engine",), "broadcast": ("group", "device"), "object_store": ("mailbox",)}
"""What each built-in transport is built with (the rest of what a caller holds is left out)."""


def open_transport(role: RolePlan, weights: Any, **context: Any) -> WeightTransport:
    """The transport the plan names, built from the weights section (`WeightSyncConfig`) with
    the plan's transport and publish mode, and the part of `context` it takes: the colocated
    engine, the weight-sync group and the rank's device (where the broadcast packs or stages
    buckets: both ends pass theirs, docs/weight_sync.md), or the mailbox actor."""
    keys = CONTEXT.get(role.transport)
    taken = context if keys is None else {k: v for k, v in context.items() if k in keys}
    return WEIGHT_TRANSPORTS.get(role.transport)(role.weights_config(weights), **taken)


def build_replica_engine(cfg: JobConfig, role: RolePlan, device: torch.device, platform: Any) -> Any:
    """The engine of a rollout actor (a replica leader, a streaming replica): loaded from
    model.path, later versions arrive over the transport; seeded by the plan."""
    return build_disaggregated_engine(cfg.rollout, cfg.model.path, device, seed=role.engine_seed,
                                   platform=platform, trust_remote_code=cfg.model.trust_remote_code,
                                   tokenizer_path=cfg.model.tokenizer_path)


class ReplicaPush:
    """What a rank of a k-rank replica gives its transport as "the engine": `update_weights`
    pushes the received version into the replica's engine through the replica leader
    (collective over the replica group; every rank of the replica receives at once)."""

    def __init__(self, cfg: JobConfig, engine: Any, group: Any, share: tuple[int, int]):
        self.cfg, self.engine, self.group, self.share = cfg, engine, group, share
        self.hf_config = read_hf_config(resolve(cfg.model.path))
        self.weight_version = engine.weight_version if engine is not None else 0
        self.last: PushResult | None = None

    def update_weights(self, named_tensors: Any, version: int) -> None:
        items = named_tensors.items() if hasattr(named_tensors, "items") else named_tensors
        rollout = self.cfg.rollout
        budget = rollout.update_bucket_mb * 2**20
        if rollout.backend == "trtllm":  # IPC handles of each rank's device (weight_flush docs)
            from polyrl.rollout.engines.trtllm import push_rank_weights

            self.last = push_rank_weights(items, version, engine=self.engine, group=self.group,
                                          fp8=rollout.quantization == "fp8", budget_bytes=budget,
                                          hf_config=self.hf_config, timeout_s=self.cfg.ray.timeout_s)
        else:
            self.last = push_shares(items, version, engine=self.engine, group=self.group,
                                    share=self.share, hf_config=self.hf_config, budget_bytes=budget,
                                    timeout_s=self.cfg.ray.timeout_s)
        self.weight_version = version


class RolloutWorker:
    def __init__(self, cfg: JobConfig, role: RolePlan):
        self.cfg, self.role, self.rank = cfg, role, role.rank
        torch.set_num_threads(role.num_threads)
        self.platform = get_platform(cfg.platform)
        self.device = self.platform.claim_device()  # the Ray reservation's, made current

    def setup(self, dist_init: str, mailbox: Any = None) -> int:
        cfg, role = self.cfg, self.role
        layout = role.layout
        backend = self.platform.group_backend(self.device.type)
        dist.init_process_group(backend, init_method=dist_init, rank=self.rank,
                                world_size=role.world_size, timeout=timedelta(seconds=cfg.ray.timeout_s))
        groups = build_groups(layout, self.rank, backend=backend, timeout_s=cfg.ray.timeout_s)
        info = groups.info
        self.replica, self.leader = info.replica, role.hosts_engine
        self.engine = None
        if role.hosts_engine:  # one engine per replica, on its leader
            self.engine = build_replica_engine(cfg, role, self.device, self.platform)
            self.tokenizer = self.engine.tokenizer
        self.sink: Any = self.engine
        if layout.ranks_per_replica > 1:
            self.sink = ReplicaPush(cfg, self.engine, groups.group("replica"),
                                    (info.local_rank, layout.ranks_per_replica))
        self.transport = open_transport(role, cfg.weights, group=groups.group("weight_sync"), mailbox=mailbox,
                                        device=self.device)
        return self.sink.weight_version

    def generate(self, rows: list[Any], sampling: SamplingParams, seeds: list[int] | None = None,
                 group_offset: int = 0) -> RolloutBatch:
        """Samples for data rows (`PromptSample`), single- or multi-turn (generation.py)."""
        self._require_engine("generate")
        return rollout_rows(self.engine, self.tokenizer, rows, sampling, seeds, group_offset, self.cfg.agent)

    def receive_weights(self) -> int:
        """Apply the next version the trainer sends (all or nothing); returns the version."""
        return self.transport.receive(self.sink)

    def push_stats(self) -> dict | None:
        """How the last version went through the replica leader (None: a one-rank replica)."""
        last = getattr(self.sink, "last", None)
        return None if last is None else {"rounds": last.rounds, "tensors": last.tensors,
                                          "bytes": last.bytes, "partial": last.partial}

    def health(self) -> dict:
        if self.engine is None:
            return {"rank": self.rank, "replica": self.replica, "engine": "on the replica leader",
                    "weight_version": self.sink.weight_version}
        return {"rank": self.rank, **self.engine.health()}

    def _require_engine(self, call: str) -> None:
        if self.engine is None:
            raise RuntimeError(f"rollout rank {self.rank} is not its replica's leader and hosts no "
                               f"engine; send {call} to the replica leaders")

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
