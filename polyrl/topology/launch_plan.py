"""The launch plan of a training run, computed without starting anything.

For the Ray job and for every Ray actor a run starts (each policy rank; each disaggregated rollout
rank), the plan holds what the launch uses: the actor's name, its Ray resources, its node and
device ids (`polyrl.placement`), its environment with provenance (`polyrl.envplan`), the exact
engine launch arguments (`polyrl.rollout.launch_args`) and, for policy and rollout actors, the
typed `RolePlan` the actor is started with (polyrl/distributed/role.py: its topology, process
groups, engine, weight transport, staleness bound). Everything here follows the run's
`TopologySpec` (`cfg.topology`, polyrl/distributed/topologies.py), never the placement and mode
keys themselves. `polyrl train --dry-run` prints it; `ActorPlan.ray_options()` is the
`.options(...)` dict an actor is started with, so the plan a user inspects is the plan that
runs. Pure: no Ray start, no model load, no engine import — the platform may be simulated.

    plan = plan_launch(cfg, get_platform(None, simulated_probe("gb200")))  # a GB200 node
    for actor in plan.actors:
        print(actor.name, actor.ray_options())
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from dataclasses import dataclass
from typing import Any

from polyrl.builtin import resolve
from polyrl.distributed.layout import RankLayout
from polyrl.distributed.role import EngineLaunch, RolePlan
from polyrl.config.vocabulary import COLOCATED
from polyrl.distributed.topologies import TopologySpec, teacher_placement_of
from polyrl.distributed.ray_launch import actor_options, plan_for_role
from polyrl.envplan import EnvPlan
from polyrl.envplan.code_paths import plugin_dirs
from polyrl.envplan.rules import BUNDLE_BACKENDS, ENGINE_BACKENDS
from polyrl.placement import Devices, Gang, Member, PlacementError, PlacementPlan, plan_placement
from polyrl.platform import Platform
from polyrl.rollout.factory import EXTRAS
from polyrl.rollout.launch_args import TRTLLM_WORKER_GPU_SHARE, check_replica_layout, engine_launch_args
from polyrl.rewards.reward_model import reward_worker_options
from polyrl.topology.process_groups import WorldPlan, plan_world
from polyrl.topology.resources import cpus_needed
from polyrl.training.mesh import ParallelDims
from polyrl.job import JobConfig

ENV_ROLE = {"policy": "trainer", "rollout": "rollout", "teacher": "trainer"}
"""Environment-plan role of each actor role."""


@dataclass(frozen=True)
class ActorPlan:
    """One Ray actor of the run."""

    name: str
    """As the run names it in errors and timeouts ("policy rank 0", "rollout replica 1 (rank 2)")."""
    role: str
    """policy (trains; in colocated placement also hosts the rollout engine) or rollout."""
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
    max_concurrency: int | None = None
    """Ray calls the actor serves at once (async replicas generate while a weight update runs)."""
    devices: Devices | None = None
    """Planned node and device ids (`plan_launch`; None: no devices, or not planned yet). An
    engine host's are the one device its bundle reserves (the first of its replica)."""
    hands: tuple[int, ...] | None = None
    """An engine host's (a TP-k disaggregated replica's leader): the k device ids of its replica on
    its node, which it sees (and its engine's TP workers use) while asking Ray for none."""
    bundle: dict[str, Any] | None = None
    """Resources of its placement-group bundle when they differ from `resources` (an engine
    host's bundle keeps its device reserved in Ray's accounting)."""
    plan: RolePlan | None = None
    """What a policy, rollout or teacher actor does, handed to it at start (None: the mailbox,
    the reward worker)."""

    @property
    def engine(self) -> EngineLaunch | None:
        """The rollout engine this actor starts, if any: its role plan's."""
        return self.plan.engine if self.plan is not None else None

    @property
    def bundle_resources(self) -> dict[str, Any]:
        return self.bundle if self.bundle is not None else self.resources

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
                "devices": self.devices.as_dict() if self.devices else None,
                "hands": list(self.hands) if self.hands is not None else None,
                "env": self.env.to_json(),
                "engine": self.engine.as_dict() if self.engine else None,
                "plan": self.plan.as_dict() if self.plan else None}


@dataclass(frozen=True)
class JobPlan:
    """How Ray is joined or started: `ray.init` arguments and the job-level runtime env."""

    ray_init: dict[str, Any]
    """Arguments of `ray.init` besides runtime_env (address, or num_cpus of a local instance)."""
    env: EnvPlan

    def as_dict(self) -> dict[str, Any]:
        return {"ray_init": {**self.ray_init, "runtime_env": self.env.runtime_env()},
                "env": self.env.to_json()}


@dataclass(frozen=True)
class LaunchPlan:
    platform: Platform
    job: JobPlan
    actors: tuple[ActorPlan, ...]
    topology: TopologySpec
    notes: tuple[str, ...] = ()
    """Facts worth knowing that do not stop the run (engine not installed here, ...)."""
    placement: PlacementPlan | None = None
    """Nodes and device ids of the actors (None on a platform without devices, or when the
    layout cannot exist: then `placement_error` says why and what fits)."""
    placement_error: str | None = None
    world: WorldPlan | None = None
    """The torch.distributed world and its groups (None: none forms)."""

    @property
    def errors(self) -> list[str]:
        """Parts of the plan that cannot be built; a run with this config would fail."""
        errors = [f"{a.name}: {a.engine.error}" for a in self.actors if a.engine and a.engine.error]
        return errors + ([f"placement: {self.placement_error}"] if self.placement_error else [])

    @property
    def devices_needed(self) -> int:
        return sum(devices_reserved(a.bundle_resources) for a in self.actors)

    @property
    def devices_per_node(self) -> int:
        return self.platform.device_count if self.platform.ray_resource else 0

    @property
    def nodes_needed(self) -> int:
        if self.placement is not None:
            return self.placement.nodes_used
        per_node = self.devices_per_node
        return math.ceil(self.devices_needed / per_node) if per_node else 1

    def as_dict(self) -> dict[str, Any]:
        p = self.platform
        return {
            "platform": {"name": p.name, "description": p.describe(), "device_count": p.device_count,
                         "capability": list(p.capability) if p.capability else None,
                         "device_name": p.device_name, "simulated": p.probe.simulated,
                         "ray_resource": p.ray_resource},
            "devices": {"needed": self.devices_needed, "per_node": self.devices_per_node,
                        "nodes": self.nodes_needed,
                        "nodes_available": self.placement.nodes_available if self.placement else None,
                        "gangs": self.placement.as_dict()["gangs"] if self.placement else []},
            "job": self.job.as_dict(),
            "topology": self.topology.as_dict(),
            "process_groups": self.world.as_dict() if self.world else None,
            "actors": [self._actor_dict(a) for a in self.actors],
            "errors": self.errors,
            "notes": self.notes,
        }


    def _actor_dict(self, actor: ActorPlan) -> dict[str, Any]:
        """The actor plus the process groups its rank joins (kind, ranks, backend)."""
        groups = self.world.of_rank(actor.rank) if self.world and actor.rank is not None else []
        return {**actor.as_dict(), "process_groups": [
            {"kind": g.kind, "ranks": list(g.ranks), "leader": g.leader, "backend": g.backend}
            for g in groups]}


def devices_reserved(resources: dict[str, Any]) -> float:
    """Accelerators a resource dict reserves (num_gpus or a custom resource such as NPU)."""
    return resources.get("num_gpus", 0) + sum((resources.get("resources") or {}).values())


def _env_kwargs(cfg: JobConfig, engine_version: str | None) -> dict[str, Any]:
    # the environment rules are scoped by the planned topology's placement and mode (R2)
    return dict(topology=cfg.topology, backend=cfg.rollout.backend, config_env=cfg.env, backend_version=engine_version, code_dirs=plugin_code_dirs(cfg))


def plugin_code_dirs(cfg: JobConfig) -> tuple[str, ...]:
    """The directories the config's plugins (import paths) are found in, for every actor's
    PYTHONPATH (polyrl/envplan/code_paths.py, docs/plugins.md)."""
    return tuple(plugin_dirs([*cfg.algorithm.plugin_specs, *cfg.agent.plugin_specs,
                              cfg.reward.custom_function, cfg.platform]))


def plan_job(cfg: JobConfig, platform: Platform, engine_version: str | None = None) -> JobPlan:
    """What `Trainer.setup` passes to `init_ray`: the cluster address, or a local instance
    sized to hold every actor's CPU reservation (at least this machine's cores)."""
    # RAY_ADDRESS: set by `ray job submit` for its entrypoint (a local Ray there would lack the
    # job's working_dir), or by the user, as Ray's own ray.init() reads it
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray_init: dict[str, Any] = {"address": address}
    else:
        _, needed = cpus_needed(cfg)
        needed += engine_worker_cpus(cfg, platform)
        ray_init = {"num_cpus": cfg.ray.num_cpus or max(os.cpu_count() or 1, needed)}
    ray_init["namespace"] = cfg.ray.namespace
    return JobPlan(ray_init, plan_for_role(platform, "job", **_env_kwargs(cfg, engine_version)))


def engine_launch(cfg: JobConfig, platform: Platform, engine_version: str | None = None) -> EngineLaunch:
    """The rollout engine's launch arguments, or the builder's error as data."""
    backend = cfg.rollout.backend
    try:
        check_replica_layout(cfg.rollout)  # what `polyrl train` refuses in pre-flight
        args = engine_launch_args(cfg.rollout, resolve(cfg.model.path), platform, engine_version,
                                  colocated=cfg.topology.colocated_engine)
    except (ValueError, FileNotFoundError) as exc:
        return EngineLaunch(backend, error=str(exc))
    return EngineLaunch(backend, args=args)


def replica_concurrency(cfg: JobConfig) -> int:
    """Concurrent calls an async replica serves: its generation requests (in-flight groups /
    groups per request) + a weight receive + health / validation calls."""
    a = cfg.async_
    inflight = a.max_inflight_per_replica or cfg.data.train_batch_size
    return math.ceil(inflight / a.groups_per_request) + 3


def plan_actors(cfg: JobConfig, platform: Platform, engine_version: str | None = None,
                mesh: ParallelDims | None = None) -> list[ActorPlan]:
    """Every Ray actor `worker_group.launch` starts for `cfg`, in start order: the policy ranks,
    then the topology's rollout actors (disaggregated: one per rollout rank, in the policy ranks'
    world; streaming: one per replica, outside any process group), then the weight mailbox when
    weights travel through Ray's object store, then the distillation teacher's own ranks
    (distill.placement=disaggregated: one device each, in a process group of their own, so
    `rank` None). Each policy, rollout and teacher actor carries its `RolePlan` (`role_plans`)."""
    spec = cfg.topology
    per_actor, _ = cpus_needed(cfg)
    devices = 1 if platform.ray_resource else 0
    resources = platform.ray_actor_options(devices, num_cpus=per_actor)
    # an async replica is one actor whose engine spawns its TP workers on the actor's devices
    replica_resources = platform.ray_actor_options(devices * cfg.rollout.tensor_parallel_size,
                                                   num_cpus=per_actor)
    env_kw = _env_kwargs(cfg, engine_version)
    engine = engine_launch(cfg, platform, engine_version)
    roles = role_plans(cfg, per_actor, engine, mesh or ParallelDims.from_actor(cfg.actor))
    colocated = spec.colocated_engine
    # beside a device's TRT-LLM worker an actor asks Ray for the rest of the device while its
    # bundle keeps the whole device (`engine_worker`)
    worker = engine_worker(cfg, platform)
    asks, bundle = beside_engine_worker(resources, worker)
    trainer_env = plan_for_role(platform, ENV_ROLE["policy"], **env_kw)
    actors = [ActorPlan(f"policy rank {r}", "policy", r, None, dict(asks if colocated else resources),
                        per_actor, trainer_env, bundle=bundle if colocated else None, plan=role)
              for r, role in enumerate(roles["policy"])]
    rollout_env = plan_for_role(platform, ENV_ROLE["rollout"], **env_kw)
    if spec.rollout_actors == "replicas":
        # a TP-1 replica beside its engine's worker shares its device as a rank does (TP > 1 is
        # refused: job_gangs)
        beside = worker is not None and cfg.rollout.tensor_parallel_size == 1
        actors += [ActorPlan(f"rollout replica {role.index}", "rollout", None, role.index,
                             dict(asks if beside else replica_resources), per_actor, rollout_env,
                             max_concurrency=replica_concurrency(cfg),
                             bundle=bundle if beside else None, plan=role)
                   for role in roles["rollout"]]
    elif spec.rollout_actors == "ranks":
        hosts = engine_hosts(cfg, platform)
        for role in roles["rollout"]:  # one engine per replica, on its leader (rollout_worker.py)
            name = f"rollout replica {role.index} (rank {role.rank})"
            if hosts and role.hosts_engine:
                # the engine host: its bundle keeps its own device reserved, the actor asks for
                # none and sees every device of its replica (plan_launch fills `hands`)
                actors.append(ActorPlan(name, "rollout", role.rank, role.index, _no_devices(resources),
                                        per_actor, plan_for_role(platform, "rollout", hands_devices=True,
                                                                 **env_kw),
                                        hands=(), bundle=with_worker_room(resources, worker),
                                        plan=role))
            else:  # a tp=1 replica (its engine's worker), or a TP rank (the host's worker)
                actors.append(ActorPlan(name, "rollout", role.rank, role.index, dict(asks), per_actor,
                                        rollout_env, bundle=bundle, plan=role))
    if cfg.weight_transport == "object_store":  # weights/object_store.py:create_mailbox
        actors.append(ActorPlan("weight mailbox", "mailbox", None, None, {"num_cpus": 0}, 0,
                                plan_for_role(platform, "job", **env_kw), max_concurrency=64))
    teacher_env = plan_for_role(platform, ENV_ROLE["teacher"], **env_kw)
    actors += [ActorPlan(f"teacher rank {role.index}", "teacher", None, None, dict(resources), per_actor,
                         teacher_env, plan=role)
               for role in roles["teacher"]]
    reward = reward_actor(cfg, platform, env_kw)
    return actors + ([reward] if reward else [])


def role_plans(cfg: JobConfig, num_threads: int, engine: EngineLaunch | None = None,
               mesh: ParallelDims | None = None) -> dict[str, list[RolePlan]]:
    """The `RolePlan` of every policy rank, rollout actor and disaggregated teacher rank of `cfg`,
    by role, in start order: what the topology (`cfg.topology`) makes each one do. `engine`:
    the engine's launch arguments as the plan shows them; `mesh`: the policy ranks' training
    mesh, which each policy rank's plan carries (default: the config's)."""
    mesh = mesh or ParallelDims.from_actor(cfg.actor)
    spec = cfg.topology
    teacher_here = teacher_placement_of(cfg) == COLOCATED  # on every policy rank
    seed, world = cfg.trainer.seed, cfg.actor.world_size
    common = dict(topology=spec.name, num_threads=num_threads, transport=cfg.weight_transport,
                  background_publish=cfg.resolved_weights.background_publish, on_policy=spec.on_policy,
                  max_staleness=0 if spec.on_policy else cfg.async_.max_staleness,
                  colocated_engine=spec.colocated_engine)
    if spec.shared_world:  # one world: the policy ranks first, then every replica's ranks
        layout = RankLayout(num_replicas=cfg.rollout.num_replicas,
                            tensor_parallel_size=cfg.rollout.tensor_parallel_size, trainer_world_size=world)
        infos = [layout.rank_info(r) for r in range(layout.world_size)]
        policy = [RolePlan(role="policy", index=r, rank=r, world_size=layout.world_size, layout=layout,
                           groups=tuple(infos[r].groups), hosts_engine=False, engine_seed=None, mesh=mesh,
                           holds_teacher=teacher_here,
                           sends_weights=infos[r].leaders.get("weight_sync") == r, **common)
                  for r in range(world)]
        rollout = [RolePlan(role="rollout", index=i.replica, rank=i.rank, world_size=layout.world_size,
                            layout=layout, groups=tuple(i.groups), hosts_engine=i.is_replica_leader,
                            engine_seed=seed + 1000 * i.rank if i.is_replica_leader else None,
                            sends_weights=False, engine=engine if i.is_replica_leader else None, **common)
                   for i in infos[world:]]
        return {"policy": policy, "rollout": rollout, "teacher": teacher_plans(cfg, common)}
    policy = [RolePlan(role="policy", index=r, rank=r, world_size=world, layout=None, mesh=mesh,
                       holds_teacher=teacher_here,
                       groups=("trainer",) if world > 1 else (), hosts_engine=spec.colocated_engine,
                       engine_seed=seed + 1000 * r if spec.colocated_engine else None,
                       # colocated: every rank into its own engine; else rank 0 publishes
                       sends_weights=spec.colocated_engine or r == 0,
                       engine=engine if spec.colocated_engine else None, **common)
              for r in range(world)]
    rollout = []
    if spec.rollout_actors == "replicas":  # in no process group: a replacement can join any time
        rollout = [RolePlan(role="rollout", index=i, rank=None, world_size=1, layout=None, groups=(),
                            hosts_engine=True, engine_seed=seed + 1000 * i, sends_weights=False,
                            engine=engine, **common)
                   for i in range(cfg.rollout.num_replicas)]
    return {"policy": policy, "rollout": rollout, "teacher": teacher_plans(cfg, common)}


def teacher_plans(cfg: JobConfig, common: dict[str, Any]) -> list[RolePlan]:
    """distill.placement=disaggregated: the teacher ranks (polyrl/workers/teacher.py), a world of
    their own (distill.world_size ranks, group "teacher"); they host no engine and send no
    weights (the teacher is frozen). Empty otherwise."""
    n = cfg.distill.own_ranks
    own = {**common, "colocated_engine": False}
    # every teacher rank data parallel: whole (ddp) or sharded (fsdp2), no sp or tp
    mesh = ParallelDims.of(cfg.distill.strategy or cfg.actor.strategy, n) if n else None
    return [RolePlan(role="teacher", index=r, rank=r, world_size=n, layout=None, mesh=mesh, holds_teacher=True,
                     groups=("teacher",) if n > 1 else (), hosts_engine=False, engine_seed=None,
                     sends_weights=False, **own)
            for r in range(n)]


REWARD_ACTOR = "reward model worker"


def reward_actor(cfg: JobConfig, platform: Platform, env_kw: dict[str, Any]) -> ActorPlan | None:
    """The Ray reward worker of `reward.model` (polyrl/rewards/reward_model.py), on its own CPU
    and device share; None when there is none (no reward model, or reward.model.in_process)."""
    model = cfg.reward.model
    options = reward_worker_options(model, platform) if model is not None else None
    if options is None:
        return None
    return ActorPlan(REWARD_ACTOR, "reward", None, None, _whole(options),
                     max(1, math.ceil(model.num_cpus)), plan_for_role(platform, "job", **env_kw))


def _whole(options: dict[str, Any]) -> dict[str, Any]:
    """2.0 CPUs shown (and reserved) as 2."""
    def whole(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: whole(x) for k, x in v.items()}
        return int(v) if isinstance(v, float) and v.is_integer() else v
    return whole(options)


def engine_hosts(cfg: JobConfig, platform: Platform) -> bool:
    """Whether disaggregated sync replicas have an engine host: a GPU engine with
    rollout.tensor_parallel_size > 1 on a device platform. The replica leader then hosts the
    replica's one TP-k engine, whose workers must see all k devices of the replica. Not for an
    engine whose TP workers are Ray actors in the replica's bundles (`engine_worker`:
    TensorRT-LLM): its leader is a rank like the others, asking for its device's share."""
    return (cfg.rollout.tensor_parallel_size > 1 and bool(platform.ray_resource)
            and cfg.rollout.backend in ENGINE_BACKENDS and engine_worker(cfg, platform) is None)


TRTLLM_WORKER_CPUS = 1
"""CPUs a TensorRT-LLM Ray worker reserves in its bundle: its actor class names only `num_gpus`,
and Ray then reserves its default of one CPU for the actor's lifetime
(`ray_constants.DEFAULT_ACTOR_CREATION_CPU_SPECIFIED`)."""


@dataclass(frozen=True)
class EngineWorker:
    """What each of an engine's own Ray workers asks Ray for inside a polyrl actor's bundle."""

    device_share: float
    cpus: float


def engine_worker(cfg: JobConfig, platform: Platform) -> EngineWorker | None:
    """The Ray worker an engine starts per device in polyrl's bundles: TensorRT-LLM's, with
    `per_worker_gpu_share` (polyrl/rollout/launch_args.py), on a device platform. None for
    engines that run in the polyrl actor's own reservation. An async replica is one actor: with
    TP 1 it shares its device as a rank does; TP > 1 is refused (`job_gangs`)."""
    if cfg.rollout.backend == "trtllm" and platform.ray_resource:
        return EngineWorker(TRTLLM_WORKER_GPU_SHARE, TRTLLM_WORKER_CPUS)
    return None


def engine_worker_cpus(cfg: JobConfig, platform: Platform) -> int:
    """CPUs the engine's own Ray workers reserve in polyrl's bundles (one worker per device of a
    colocated policy rank, a disaggregated rollout rank or an async TP-1 replica), which a local Ray
    instance must hold too: else its placement groups cannot be reserved on a machine with few
    cores."""
    worker, spec = engine_worker(cfg, platform), cfg.topology
    if worker is None:
        return 0
    devices = (cfg.actor.world_size if spec.colocated_engine
               else cfg.rollout.num_replicas * cfg.rollout.tensor_parallel_size)
    return math.ceil(worker.cpus * devices)


def with_worker_room(bundle: dict[str, Any], worker: EngineWorker | None) -> dict[str, Any]:
    """A bundle that also holds the CPUs of the engine worker placed in it (the device is
    already whole in it)."""
    if worker is None:
        return dict(bundle)
    return {**bundle, "num_cpus": bundle.get("num_cpus", 0) + worker.cpus}


def beside_engine_worker(resources: dict[str, Any],
                         worker: EngineWorker | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(what the actor asks Ray for, its bundle or None) for an actor reserving `resources` on a
    device where an engine worker asks Ray for `worker.device_share` of it: the actor asks for
    the rest (`1 - device_share`), its bundle keeps the whole device plus the worker's CPUs.
    Asking for the whole device would fill the bundle, and the worker would never be scheduled."""
    if worker is None:
        return dict(resources), None
    rest = 1 - worker.device_share
    asks = {k: v for k, v in resources.items() if k != "resources"}
    if "num_gpus" in asks:
        asks["num_gpus"] = rest
    if resources.get("resources"):
        asks["resources"] = {k: rest for k in resources["resources"]}
    return asks, with_worker_room(resources, worker)


def _no_devices(resources: dict[str, Any]) -> dict[str, Any]:
    """`resources` without accelerators: num_gpus=0 (a custom resource such as NPU is dropped)."""
    out = {k: v for k, v in resources.items() if k != "resources"}
    if "num_gpus" in out:
        out["num_gpus"] = 0
    return out


def job_gangs(cfg: JobConfig, actors: list[ActorPlan]) -> list[Gang]:
    """The actors that must share a node: a rollout replica's ranks (disaggregated) and, in colocated
    placement, each group of tensor_parallel_size policy ranks whose colocated engines form one
    TP engine. Everyone else is a gang of one."""
    tp = cfg.rollout.tensor_parallel_size
    member = {a.name: Member(a.name, int(devices_reserved(a.bundle_resources))) for a in actors}
    policy = [a.name for a in actors if a.role == "policy"]
    gangs: list[Gang] = []
    if cfg.topology.colocated_engine and tp > 1:
        if len(policy) % tp:
            raise PlacementError(f"actor.world_size={len(policy)} is not a multiple of "
                                 f"rollout.tensor_parallel_size={tp}: in colocated placement each "
                                 f"engine spans {tp} policy ranks on one node")
        gangs += [Gang(f"policy ranks {i}-{i + tp - 1} (one TP-{tp} engine)",
                       tuple(member[n] for n in policy[i:i + tp]), "rollout.tensor_parallel_size")
                  for i in range(0, len(policy), tp)]
    else:
        gangs += [Gang(n, (member[n],)) for n in policy]
    rollout = [a for a in actors if a.role == "rollout"]
    if (rollout and tp > 1 and cfg.topology.rollout_actors == "replicas"
            and cfg.rollout.backend in BUNDLE_BACKENDS):
        raise PlacementError(f"rollout.tensor_parallel_size={tp} with trainer.mode=async and "
                             f"rollout.backend={cfg.rollout.backend}: an async replica is one actor "
                             f"holding its {tp} devices in one bundle, and TensorRT-LLM places one "
                             "Ray worker per device in bundles of their own; set "
                             "rollout.tensor_parallel_size=1 (more replicas) or trainer.mode=sync")
    for replica in sorted({a.replica for a in rollout}):
        names = [a.name for a in rollout if a.replica == replica]
        gangs.append(Gang(f"rollout replica {replica}", tuple(member[n] for n in names),
                          "rollout.tensor_parallel_size"))
    for a in actors:
        if a.role == "teacher":  # its own process group: any node, one device each
            gangs.append(Gang(a.name, (member[a.name],), "distill.world_size"))
        if a.role == "reward":
            devices = devices_reserved(a.resources)
            if devices != int(devices):
                raise PlacementError(f"reward.model.num_devices={devices:g}: the placement planner "
                                     "places whole devices; set it to an integer (or 0 for CPU)")
            gangs.append(Gang(a.name, (member[a.name],), "reward.model.num_devices"))
    return gangs


def plan_launch(cfg: JobConfig, platform: Platform, engine_version: str | None = None,
                nodes: int | None = None, mesh: ParallelDims | None = None) -> LaunchPlan:
    """The whole plan: Ray job, actors with their devices, and notes on what the plan could not
    settle here. `nodes`: the cluster's node count (None: as many as the job needs). `mesh`: the
    policy ranks' training mesh (the run's plan passes the one it holds,
    polyrl/topology/run_plan.py; default: the config's)."""
    mesh = mesh or ParallelDims.from_actor(cfg.actor)
    actors = plan_actors(cfg, platform, engine_version, mesh)
    plan = LaunchPlan(platform, plan_job(cfg, platform, engine_version), tuple(actors), cfg.topology)
    placement = placement_error = None
    if platform.ray_resource:
        try:
            placement = plan_placement(job_gangs(cfg, actors), plan.devices_per_node, nodes)
        except PlacementError as exc:
            placement_error = str(exc)
        else:
            where = placement.assignments
            actors = [dataclasses.replace(a, devices=where.get(a.name)) for a in actors]
            actors = [_hand_devices(cfg, platform, a, actors, engine_version)
                      if a.hands is not None else a for a in actors]
            actors = in_bundles(placement, actors)
    plan = dataclasses.replace(plan, actors=tuple(actors), placement=placement, placement_error=placement_error,
                               world=plan_world(cfg, platform, actors, mesh))
    return dataclasses.replace(plan, notes=tuple(_notes(cfg, platform, plan)))


def in_bundles(placement: PlacementPlan, actors: list[ActorPlan]) -> list[ActorPlan]:
    """Each actor that starts an engine in a bundle with room beside it (`bundle`) with its
    planned bundle index in its environment (`EnvPlan.in_bundle`: only for engines that read
    it, TensorRT-LLM). The index is the actor's position in its
    node's `node_actors`, the bundle order `create_placement` reserves; the launch sets the live
    index again (polyrl/placement/ray_groups.py:options_for)."""
    index = {name: i for node in range(placement.nodes_used)
             for i, name in enumerate(placement.node_actors(node))}
    return [dataclasses.replace(a, env=a.env.in_bundle(index[a.name]))
            if a.engine is not None and a.bundle is not None and a.name in index else a
            for a in actors]


def _hand_devices(cfg: JobConfig, platform: Platform, host: ActorPlan, actors: list[ActorPlan],
                  engine_version: str | None) -> ActorPlan:
    """An engine host with the device ids of its whole replica: in `hands` and as its planned
    visible-devices variable (polyrl/envplan/plan.py:handoff_variable)."""
    ids = tuple(i for a in actors if a.role == "rollout" and a.replica == host.replica and a.devices
                for i in a.devices.ids)
    env = plan_for_role(platform, ENV_ROLE["rollout"], hands_devices=True, visible_devices=ids,
                        **_env_kwargs(cfg, engine_version))
    return dataclasses.replace(host, hands=ids, env=env)


def _notes(cfg: JobConfig, platform: Platform, plan: LaunchPlan) -> list[str]:
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
                    and any(k.startswith("RAY_EXPERIMENTAL_NOSET_") and e.source != "placement"
                            for k, e in a.env.entries.items())})
    if noset:
        notes.append(f"{', '.join(noset)} reserve devices through Ray and also get "
                     "RAY_EXPERIMENTAL_NOSET_* (meant for server actors with no Ray devices): Ray "
                     "leaves their visible-devices variable alone, so each sees every device of "
                     "its node")
    if plan.placement and plan.placement.nodes_used > 1 and plan.placement.nodes_available is None:
        notes.append(f"{plan.devices_needed:g} devices needed, {plan.devices_per_node} per node: the "
                     f"Ray cluster needs {plan.nodes_needed} nodes (ray.address=auto)")
    return notes
