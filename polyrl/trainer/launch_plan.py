"""The launch plan of a training run, computed without starting anything.

For the Ray job and for every Ray actor a run starts (each policy rank; each standalone rollout
rank), the plan holds what the launch uses: the actor's name, its Ray resources, its environment
with provenance (`polyrl.envplan`) and the exact engine launch arguments
(`polyrl.rollout.launch_args`). `polyrl train --dry-run` prints it; `ActorPlan.ray_options()` is
the `.options(...)` dict an actor is started with, so the plan a user inspects is the plan that
runs. Pure: no Ray start, no model load, no engine import — the platform may be simulated.

    plan = plan_launch(cfg, get_platform(None, simulated_probe("gb200")))  # a GB200 node
    for actor in plan.actors:
        print(actor.name, actor.ray_options())
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field
from typing import Any

from polyrl.builtin import resolve
from polyrl.distributed.layout import RankLayout
from polyrl.distributed.ray_launch import actor_options, plan_for_role
from polyrl.envplan import EnvPlan
from polyrl.platform import Platform
from polyrl.rollout.factory import EXTRAS
from polyrl.rollout.launch_args import engine_launch_args
from polyrl.topology.resources import cpus_needed

ENV_ROLE = {"policy": "trainer", "rollout": "rollout"}
"""Environment-plan role of each actor role."""


@dataclass(frozen=True)
class EngineLaunch:
    """The engine an actor starts: its arguments, or why they cannot be built."""

    backend: str
    args: dict[str, Any] | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": self.backend}
        out.update({"error": self.error} if self.error else {"args": self.args})
        return out


@dataclass(frozen=True)
class ActorPlan:
    """One Ray actor of the run."""

    name: str
    """As the run names it in errors and timeouts ("policy rank 0", "rollout replica 1 (rank 2)")."""
    role: str
    """policy (trains; in hybrid placement also hosts the rollout engine) or rollout."""
    rank: int | None
    """Global torch.distributed rank (None: the actor does not join the run's process group, as
    async replicas and the weight mailbox)."""
    replica: int | None
    """Rollout replica index (rollout actors only)."""
    resources: dict[str, Any]
    """Ray resources: num_cpus plus num_gpus or the platform's custom resource."""
    num_threads: int
    """torch threads the actor is constructed with (equal to its CPU reservation)."""
    env: EnvPlan
    engine: EngineLaunch | None = None
    """The rollout engine this actor starts, if any."""
    max_concurrency: int | None = None
    """Ray calls the actor serves at once (async replicas generate while a weight update runs)."""

    def ray_options(self) -> dict[str, Any]:
        """The `.options(...)` the actor is started with: resources plus its runtime env."""
        options = actor_options(self.env, self.resources)
        if self.max_concurrency is not None:
            options["max_concurrency"] = self.max_concurrency
        return options

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "role": self.role, "env_role": self.env.context.role,
                "rank": self.rank, "replica": self.replica, "resources": self.resources,
                "num_threads": self.num_threads, "max_concurrency": self.max_concurrency,
                "env": self.env.to_json(),
                "engine": self.engine.as_dict() if self.engine else None}


@dataclass(frozen=True)
class JobPlan:
    """How Ray is joined or started: `ray.init` arguments and the job-level runtime env."""

    ray_init: dict[str, Any]
    """Arguments of `ray.init` besides runtime_env (address, or num_cpus of a local instance)."""
    env: EnvPlan

    def as_dict(self) -> dict[str, Any]:
        return {"ray_init": {**self.ray_init, "runtime_env": self.env.runtime_env()},
                "env": self.env.to_json()}


@dataclass
class LaunchPlan:
    platform: Platform
    job: JobPlan
    actors: list[ActorPlan]
    notes: list[str] = field(default_factory=list)
    """Facts worth knowing that do not stop the run (engine not installed here, ...)."""

    @property
    def errors(self) -> list[str]:
        """Parts of the plan that cannot be built; a run with this config would fail."""
        return [f"{a.name}: {a.engine.error}" for a in self.actors if a.engine and a.engine.error]

    @property
    def devices_needed(self) -> int:
        return sum(devices_reserved(a.resources) for a in self.actors)

    @property
    def nodes_needed(self) -> int:
        per_node = self.platform.device_count if self.platform.ray_resource else 0
        return math.ceil(self.devices_needed / per_node) if per_node else 1

    def as_dict(self) -> dict[str, Any]:
        p = self.platform
        return {
            "platform": {"name": p.name, "description": p.describe(), "device_count": p.device_count,
                         "capability": list(p.capability) if p.capability else None,
                         "device_name": p.device_name, "simulated": p.probe.simulated,
                         "ray_resource": p.ray_resource},
            "devices": {"needed": self.devices_needed,
                        "per_node": p.device_count if p.ray_resource else 0,
                        "nodes": self.nodes_needed},
            "job": self.job.as_dict(),
            "actors": [a.as_dict() for a in self.actors],
            "errors": self.errors,
            "notes": self.notes,
        }


def devices_reserved(resources: dict[str, Any]) -> float:
    """Accelerators a resource dict reserves (num_gpus or a custom resource such as NPU)."""
    return resources.get("num_gpus", 0) + sum((resources.get("resources") or {}).values())


def _env_kwargs(cfg: Any, engine_version: str | None) -> dict[str, Any]:
    return dict(backend=cfg.rollout.backend, placement=cfg.rollout.placement, mode=cfg.trainer.mode,
                config_env=cfg.env, backend_version=engine_version)


def plan_job(cfg: Any, platform: Platform, engine_version: str | None = None) -> JobPlan:
    """What `Trainer.setup` passes to `init_ray`: the cluster address, or a local instance
    sized to hold every actor's CPU reservation (at least this machine's cores)."""
    if cfg.ray.address:
        ray_init: dict[str, Any] = {"address": cfg.ray.address}
    else:
        _, needed = cpus_needed(cfg)
        ray_init = {"num_cpus": cfg.ray.num_cpus or max(os.cpu_count() or 1, needed)}
    ray_init["namespace"] = cfg.ray.namespace
    return JobPlan(ray_init, plan_for_role(platform, "job", **_env_kwargs(cfg, engine_version)))


def engine_launch(cfg: Any, platform: Platform, engine_version: str | None = None) -> EngineLaunch:
    """The rollout engine's launch arguments, or the builder's error as data."""
    backend = cfg.rollout.backend
    try:
        args = engine_launch_args(cfg.rollout, resolve(cfg.model.path), platform, engine_version)
    except (ValueError, FileNotFoundError) as exc:
        return EngineLaunch(backend, error=str(exc))
    return EngineLaunch(backend, args=args)


def replica_concurrency(cfg: Any) -> int:
    """Concurrent calls an async replica serves: its generation requests (in-flight groups /
    groups per request) + a weight receive + health / validation calls."""
    a = cfg.async_
    inflight = a.max_inflight_per_replica or cfg.data.train_batch_size
    return math.ceil(inflight / a.groups_per_request) + 3


def plan_actors(cfg: Any, platform: Platform, engine_version: str | None = None) -> list[ActorPlan]:
    """Every Ray actor `worker_group.launch` starts for `cfg`, in start order: the policy ranks,
    then (standalone placement) one actor per rollout rank — in async mode one streaming actor per
    replica, outside the process group — then the weight mailbox when weights travel through
    Ray's object store."""
    per_actor, _ = cpus_needed(cfg)
    devices = 1 if platform.ray_resource else 0
    resources = platform.ray_actor_options(devices, num_cpus=per_actor)
    env_kw = _env_kwargs(cfg, engine_version)
    engine = engine_launch(cfg, platform, engine_version)
    hybrid = cfg.rollout.placement == "hybrid"
    trainer_env = plan_for_role(platform, ENV_ROLE["policy"], **env_kw)
    actors = [ActorPlan(f"policy rank {r}", "policy", r, None, dict(resources), per_actor,
                        trainer_env, engine if hybrid else None)
              for r in range(cfg.actor.world_size)]
    rollout_env = plan_for_role(platform, ENV_ROLE["rollout"], **env_kw)
    if cfg.trainer.mode == "async":
        actors += [ActorPlan(f"rollout replica {i}", "rollout", None, i, dict(resources), per_actor,
                             rollout_env, engine, max_concurrency=replica_concurrency(cfg))
                   for i in range(cfg.rollout.num_replicas)]
    elif not hybrid:
        layout = RankLayout(num_replicas=cfg.rollout.num_replicas,
                            tensor_parallel_size=cfg.rollout.tensor_parallel_size,
                            trainer_world_size=cfg.actor.world_size)
        for r in layout.rollout_ranks():
            replica = layout.rank_info(r).replica
            actors.append(ActorPlan(f"rollout replica {replica} (rank {r})", "rollout", r, replica,
                                    dict(resources), per_actor, rollout_env, engine))
    if cfg.weight_transport == "object_store":  # weights/object_store.py:create_mailbox
        actors.append(ActorPlan("weight mailbox", "mailbox", None, None, {"num_cpus": 0}, 0,
                                plan_for_role(platform, "job", **env_kw), max_concurrency=64))
    return actors


def plan_launch(cfg: Any, platform: Platform, engine_version: str | None = None) -> LaunchPlan:
    """The whole plan: Ray job, actors, and notes on what the plan could not settle here."""
    plan = LaunchPlan(platform, plan_job(cfg, platform, engine_version),
                      plan_actors(cfg, platform, engine_version))
    plan.notes.extend(_notes(cfg, platform, plan))
    return plan


def _notes(cfg: Any, platform: Platform, plan: LaunchPlan) -> list[str]:
    notes = []
    backend = cfg.rollout.backend
    if backend in EXTRAS and importlib.util.find_spec(EXTRAS[backend][0]) is None:
        notes.append(f"{EXTRAS[backend][0]} is not installed on this machine; the machines that "
                     f"run the job need it: pip install \"polyrl[{EXTRAS[backend][1]}]\"")
    if cfg.rollout.max_model_len is None:
        notes.append("rollout.max_model_len is unset: the run sets it at start to the longest "
                     f"tokenized prompt + rollout.response_length ({cfg.rollout.response_length}); "
                     "set it to see it in the engine arguments")
    if cfg.actor.num_cpus_per_worker is None:
        notes.append(f"CPUs per actor ({plan.actors[0].resources['num_cpus']}) follow this "
                     f"machine's {os.cpu_count()} cores; the run computes them on the machine that "
                     "starts it (set actor.num_cpus_per_worker to fix them)")
    noset = sorted({a.name for a in plan.actors if devices_reserved(a.resources)
                    and any(v.startswith("RAY_EXPERIMENTAL_NOSET_") for v in a.env.entries)})
    if noset:
        notes.append(f"{', '.join(noset)} reserve devices through Ray and also get "
                     "RAY_EXPERIMENTAL_NOSET_* (meant for server actors with no Ray devices): Ray "
                     "leaves their visible-devices variable alone, so each sees every device of "
                     "its node")
    if platform.ray_resource and plan.devices_needed > platform.device_count:
        notes.append(f"{plan.devices_needed:g} devices needed, {platform.device_count} per node: the "
                     f"Ray cluster needs {plan.nodes_needed} nodes (ray.address=auto)")
    return notes
