"""The run's plan, decided once before anything starts: `resolve(cfg, data) -> RunPlan`.

    cfg + data --resolve--> RunPlan --start (Trainer.start)--> Ray, actors, process groups
                               |
                               +--> polyrl train --dry-run (prints RunPlan.as_dict())

A `RunPlan` holds the config with everything filled in (rollout.max_model_len from the longest
tokenized prompt), the `TopologySpec` the config selects (polyrl/distributed/topologies.py), the
training mesh (`ParallelDims`, polyrl/training/mesh.py) and the launch plan
(polyrl/topology/launch_plan.py): the Ray job and every actor with its resources, environment,
devices and `RolePlan` (polyrl/distributed/role.py), a policy rank's carrying its mesh
coordinates and process groups. Pure and frozen: no Ray, no file written, no model load, so the
plan `polyrl train --dry-run` prints is the plan `Trainer.start` launches (tests/topology/
test_run_plan.py compares the two).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polyrl.distributed.role import RolePlan
from polyrl.distributed.topologies import TopologySpec
from polyrl.job import JobConfig
from polyrl.platform import Platform
from polyrl.topology.launch_plan import LaunchPlan, plan_launch
from polyrl.training.mesh import ParallelDims


@dataclass(frozen=True)
class RunData:
    """What the plan needs from the loaded data (not the data itself)."""

    longest_prompt: int
    """Tokens of the longest tokenized prompt, training and validation."""
    batches_per_epoch: int
    """Steps of one epoch of the training data."""

    @classmethod
    def of(cls, train_loader: Any, val_loader: Any = None) -> "RunData":
        lengths = [len(p.prompt_ids) for p in train_loader.dataset]
        if val_loader is not None:
            lengths += [len(p.prompt_ids) for p in val_loader.dataset]
        return cls(max(lengths, default=0), len(train_loader))


@dataclass(frozen=True)
class RunPlan:
    cfg: JobConfig
    """The config with everything filled in: what runs, and what config.yaml records."""
    topology: TopologySpec
    mesh: ParallelDims
    """The policy ranks' training mesh (dp_replicate x dp_shard x sp x tp)."""
    launch: LaunchPlan
    """The Ray job and every actor, with its `RolePlan`."""
    total_steps: int | None
    """trainer.total_steps, or total_epochs x batches per epoch (None: no data was given)."""
    engine_version: str | None
    """The rollout engine version the launch arguments are built for (None: built-in engine,
    or not installed here)."""

    @property
    def platform(self) -> Platform:
        return self.launch.platform

    def roles(self, role: str) -> list[RolePlan]:
        """The `RolePlan`s of one role (policy, rollout, teacher), in start order."""
        return [a.plan for a in self.launch.actors if a.role == role and a.plan is not None]

    def summary(self) -> dict[str, Any]:
        """The run's shape as the plan decided it (its topology, not the config keys)."""
        r, t = self.cfg.rollout, self.topology
        replicas = 0 if t.colocated_engine else r.num_replicas
        return {"placement": t.placement, "mode": t.mode, "topology": t.name, "backend": r.backend,
                "engine_version": self.engine_version, "policy_ranks": self.mesh.world_size,
                "training_mesh": self.mesh.describe(), "rollout_replicas": replicas,
                "tensor_parallel_size": r.tensor_parallel_size,
                "rollout_ranks": replicas * r.tensor_parallel_size, "total_steps": self.total_steps}

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: what `polyrl train --dry-run --json` prints (besides "dry_run": true)."""
        return {"placement": self.summary(), **self.launch.as_dict(),
                "config": self.cfg.model_dump(mode="json")}


def filled_in(cfg: JobConfig, data: RunData | None) -> JobConfig:
    """`cfg` with what the data decides: rollout.max_model_len, when unset, is the longest
    tokenized prompt plus the longest response (a multi-turn response holds every turn)."""
    if cfg.rollout.max_model_len is not None or data is None:
        return cfg
    response = cfg.rollout.response_length
    if cfg.agent.enabled:
        response = max(response, cfg.agent.max_response_tokens)
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(
        update={"max_model_len": data.longest_prompt + response})})


def resolve(cfg: JobConfig, data: RunData | None, platform: Platform | None = None,
            engine_version: str | None = None, nodes: int | None = None) -> RunPlan:
    """The plan of `cfg` on `platform` (default: `cfg.platform` on this machine). `data`: the
    loaded data's shape (None: not loaded, e.g. a dry run without the tokenizer here; then an
    unset max_model_len stays unset and the plan's notes say so). `nodes`: the cluster's node
    count (None: as many as the job needs; `Trainer.start` checks the live cluster against it)."""
    from polyrl.platform import get_platform

    cfg = filled_in(cfg, data)
    platform = platform or get_platform(cfg.platform)
    mesh = ParallelDims.from_actor(cfg.actor)
    launch = plan_launch(cfg, platform, engine_version, nodes, mesh=mesh)
    total = cfg.trainer.total_steps or (cfg.trainer.total_epochs * data.batches_per_epoch if data else None)
    return RunPlan(cfg, cfg.topology, mesh, launch, total, engine_version)
