"""What every rollout topology offers the trainer, and the launch steps they share.

A topology is one way of placing and timing rollout relative to training:

    colocated      (rollout.placement=colocated)                         colocated.py
    disaggregated  (rollout.placement=disaggregated, trainer.mode=sync)  disaggregated.py
    streaming      (rollout.placement=disaggregated, trainer.mode=async) streaming.py

What each one is (engine, actors, transports, staleness) is its `spec`
(polyrl/distributed/topologies.py); its actors are started with their `RolePlan`s from the launch
plan (polyrl/topology/launch_plan.py).

It owns the actors' launch, producing the next batch of scored samples, publishing a new weight
version to its engines, generating for validation, its share of the checkpoint, and shutdown.
`Trainer.train_step` talks to this interface only (docs/architecture.md, "Topologies").
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from polyrl.algorithms import select_informative
from polyrl.batch import RolloutBatch, split_evenly
from polyrl.distributed.topologies import TopologySpec
from polyrl.distributed.waits import gather
from polyrl.envplan.this_process import apply_here, restore
from polyrl.platform import Platform
from polyrl.rollout.base import SamplingParams
from polyrl.rewards.reward_model import use_planned_options
from polyrl.topology.in_process import LocalActor, is_local, local_gather
from polyrl.placement import PlacementError, plan_placement
from polyrl.topology.launch_plan import REWARD_ACTOR, ActorPlan, LaunchPlan
from polyrl.topology.local_plan import InProcessPlan, plan_here
from polyrl.topology.run_plan import RunPlan
from polyrl.topology.worker_group import PolicyGroup, Waiter
from polyrl.workers.policy import PolicyWorker
from polyrl.workers.teacher import TeacherWorker

if TYPE_CHECKING:
    from polyrl.data import PromptSample
    from polyrl.job import JobConfig

logger = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """A run that cannot go on; the message says why and what to change."""


Scorer = Callable[[RolloutBatch], dict]
"""Scores a batch in place (sets `rewards`, `acc` from `texts` and `prompts`); returns metrics."""


@dataclass
class TopologyContext:
    """What a topology is built from (explicit: nothing is patched in later)."""

    plan: RunPlan
    """The run's plan (polyrl/topology/run_plan.py): the topology launches exactly its actors."""
    loader: Any
    """The training data (`ResumableLoader`): draws the prompts of each step."""
    score: Scorer
    timer: Any
    """`PhaseTimer`: `with timer("generate")` records timing/generate."""

    @property
    def cfg(self) -> JobConfig:
        return self.plan.cfg

    @property
    def platform(self) -> Platform:
        return self.plan.platform

    @property
    def total_steps(self) -> int:
        return self.plan.total_steps or 0


class Topology(abc.ABC):
    spec: TopologySpec
    """What this topology is (its engine, actors, transports, staleness), as data."""

    @property
    def name(self) -> str:
        return self.spec.name

    def __init__(self, ctx: TopologyContext):
        self.ctx, self.cfg = ctx, ctx.cfg
        self.policy: PolicyGroup | None = None
        self.teacher: PolicyGroup | None = None
        """The distillation teacher's own ranks (distill.placement=disaggregated; `start_teacher`)."""

    @abc.abstractmethod
    def start(self) -> None:
        """Start and set up every actor (the policy ranks and whatever generates)."""

    @abc.abstractmethod
    def next_batch(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """The next step's scored samples (with `prompts` attached) and their metrics."""

    @abc.abstractmethod
    def publish(self, bump: bool = True) -> dict[str, float]:
        """The policy's current weights (a new version if `bump`) reach the rollout engines."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[PromptSample], sampling: SamplingParams,
                 seeds: list[int], phase: str) -> RolloutBatch:
        """Samples of the current policy outside the training stream (validation)."""

    def state_dict(self) -> dict[str, Any]:
        """This topology's entries of the driver checkpoint."""
        return {}

    def load_state_dict(self, driver_state: dict[str, Any], source: str) -> None:
        """Restore from a driver checkpoint (`source` names it in messages)."""

    def after_checkpoint_load(self) -> None:
        """The policy ranks loaded a checkpoint: engines that do not share their process get it."""
        self.publish(bump=False)

    def start_teacher(self) -> PolicyGroup:
        """Start the disaggregated teacher ranks planned with this topology's actors (after
        `start`); waits on them go through the policy's waiter (streaming: replicas stay fed)."""
        self.teacher = start_teacher(self.ctx, self.launch, self.policy.waiter)
        return self.teacher

    def shutdown(self) -> None:
        try:
            teacher, self.teacher = self.teacher, None
            try:
                if teacher is not None:
                    teacher.shutdown()
            finally:
                if self.policy is not None:
                    self.policy.shutdown()
                    self.policy = None
        finally:
            launch = getattr(self, "launch", None)
            if launch is not None:
                launch.release()


# --- launch steps shared by the topologies -------------------------------------------------------
@dataclass
class Launch:
    """Every actor's plan and the `.options(...)` it starts with, computed once per launch: the
    plan `polyrl train --dry-run` shows, and on device platforms Ray placement groups that pin
    each actor to its planned node and devices (polyrl/placement/)."""

    actors: list[ActorPlan]
    options: dict[str, dict[str, Any]]
    placement: Any = None
    """The live placement groups (None without devices)."""
    in_process: bool = False
    """ray.enabled=false: the actors are objects of this process (polyrl/topology/in_process.py)."""
    saved_env: dict[str, str | None] = field(default_factory=dict)
    """In process: the caller's values of the variables the policy's plan set (None: unset)."""
    local: InProcessPlan | None = None
    """In process: the `InProcessPlan` started (polyrl/topology/local_plan.py)."""

    def of(self, role: str) -> list[ActorPlan]:
        return [a for a in self.actors if a.role == role]

    def release(self) -> None:
        use_planned_options(None)
        restore(self.saved_env)  # the caller's environment back (in process)
        self.saved_env = {}
        if self.placement is not None:
            self.placement.remove()
            self.placement = None


def plan(ctx: TopologyContext) -> Launch:
    """The run plan's actors with the `.options(...)` they start with (and, on device
    platforms, the live placement groups that pin them): nothing is planned again here."""
    run_plan = ctx.plan
    if not run_plan.cfg.ray.enabled:
        return plan_in_process(run_plan)
    launch_plan = run_plan.launch
    if launch_plan.placement_error:
        raise TrainingError(launch_plan.placement_error)
    check_cluster(launch_plan, _device_nodes(launch_plan.platform))
    options = {a.name: a.ray_options() for a in launch_plan.actors}
    placed = [a for a in launch_plan.actors if a.devices]
    live = None
    if placed:
        from polyrl.placement import create_placement, options_for

        live = create_placement(launch_plan.placement, placed)
        options.update(options_for(live, placed))
    # the reward worker (reward.model) starts on first use, with its planned share
    use_planned_options(options.get(REWARD_ACTOR))
    return Launch(list(launch_plan.actors), options, live)


def check_cluster(launch_plan: LaunchPlan, nodes: int | None) -> None:
    """The planned placement fits the live cluster's `nodes` device nodes (None: not known):
    the planner's own check, with its message (what fits)."""
    if launch_plan.placement is None or nodes is None or launch_plan.placement.nodes_used <= nodes:
        return
    try:
        plan_placement(launch_plan.placement.gangs, launch_plan.devices_per_node, nodes)
    except PlacementError as exc:
        raise TrainingError(str(exc)) from None


def plan_in_process(run_plan: RunPlan) -> Launch:
    """ray.enabled=false: the same plan (JobConfig allows one policy rank and nothing else), no
    Ray options or placement groups; the policy's planned variables go into this process's
    environment, as a Ray actor would have been started with them (the caller's values come back
    at `release`). Variables read only at process start (the allocator's) act only when exported
    before it: `polyrl env --role trainer` prints them."""
    launch_plan = run_plan.launch
    if launch_plan.placement_error:
        raise TrainingError(launch_plan.placement_error)
    local = plan_here(run_plan)  # what `polyrl train --dry-run ray.enabled=false` prints
    return Launch(list(launch_plan.actors), {}, in_process=True, saved_env=apply_here(local.env_values()),
                  local=local)


def _device_nodes(platform: Platform) -> int | None:
    """Alive Ray nodes that offer the platform's devices (None without devices)."""
    if not platform.ray_resource:
        return None
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(platform.ray_resource)]
    return len(nodes) or None


def start_policy(ctx: TopologyContext, launch: Launch, waiter: Waiter = gather) -> PolicyGroup:
    """Start the policy ranks with their planned options and role plans (not set up yet)."""
    cfg = ctx.cfg
    planned = launch.of("policy")
    if launch.in_process:  # the same worker class, an object of this process
        workers = [LocalActor(PolicyWorker(cfg, a.plan, ctx.total_steps), ctx.platform) for a in planned]
        waiter = local_gather
    else:
        import ray

        cls = ray.remote(PolicyWorker)
        workers = [cls.options(**launch.options[a.name]).remote(cfg, a.plan, ctx.total_steps)
                   for a in planned]
    # the same shard to every rank of a sequence-parallel group: the plan's mesh (polyrl/training/mesh.py)
    return PolicyGroup(workers, [a.name for a in planned], cfg.ray.timeout_s, waiter, mesh=ctx.plan.mesh)


def start_teacher(ctx: TopologyContext, launch: Launch, waiter: Waiter = gather) -> PolicyGroup:
    """The distillation teacher's ranks (polyrl/workers/teacher.py) with their planned options,
    set up: in a process group of their own, the teacher loaded. Each step's batch is sharded
    over them as over data-parallel policy ranks, and their log-probs come back per sample."""
    import ray

    cfg = ctx.cfg
    planned = launch.of("teacher")
    cls = ray.remote(TeacherWorker)
    workers = [cls.options(**launch.options[a.name]).remote(cfg, a.plan) for a in planned]
    teacher = PolicyGroup(workers, [a.name for a in planned], cfg.ray.timeout_s, waiter,
                          mesh=planned[0].plan.mesh)  # the teacher ranks' own, planned
    setup_all(teacher, teacher.refs("setup", rendezvous(teacher, len(workers) > 1)), [])
    return teacher


def teacher_generate(group: PolicyGroup, prompts: Sequence[PromptSample], sampling: SamplingParams,
                     seeds: list[int], phase: str) -> RolloutBatch:
    """The distillation teacher's samples for `prompts`, split evenly over the ranks that hold
    it (the policy ranks, or its own), each sampling with an engine loaded from distill.teacher
    (`teacher_generate` of polyrl/workers/policy.py and teacher.py)."""
    shards = []
    for chunk in split_evenly(list(range(len(prompts))), group.world_size):
        shards.append(([prompts[i] for i in chunk], sampling, [seeds[i] for i in chunk], chunk[0] if chunk else 0))
    parts = group.call_sharded("teacher_generate", shards, phase=f"teacher {phase}")
    return attach_prompts(RolloutBatch.cat([b for b in parts if len(b)]), prompts)


def rendezvous(policy: PolicyGroup, needed: bool) -> str | None:
    """The torch.distributed init address (on policy rank 0's node) when a process group forms."""
    if not needed:
        return None
    return gather([policy.workers[0].address.remote()], policy.names[:1], phase="rendezvous",
                  timeout_s=policy.timeout_s)[0]


def setup_all(policy: PolicyGroup, refs: list, names: list[str]) -> list:
    """Wait for the policy ranks' and the other actors' set-up (`refs` after the policy's)."""
    wait = local_gather if is_local(policy.workers[0]) else gather  # in process: answered already
    results = wait(refs, list(policy.names) + names, phase="start-up", timeout_s=policy.timeout_s)
    policy.num_params = results[0]
    return results[policy.world_size:]


def prompt_seeds(seed: int, step: int | tuple[int, int], prompts: Sequence[PromptSample], validation: bool) -> list[int]:
    """One seed per (run, step, prompt): the same run draws the same samples, however batched."""
    return [hash((seed, step, p.index, validation)) % (2**31) for p in prompts]


def train_sampling(cfg: JobConfig) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, n=r.n,
                          max_tokens=r.response_length)


def attach_prompts(batch: RolloutBatch, prompts: Sequence[PromptSample]) -> RolloutBatch:
    """Each sample's data row, by its group index into `prompts`."""
    batch.prompts = [prompts[g] for g in batch.group.tolist()]
    return batch


class SyncTopology(Topology):
    """Generate, then train: the batch of step t comes from the weights of step t - 1."""

    @property
    @abc.abstractmethod
    def engines(self) -> Any:
        """The group whose actors host the rollout engines (`WorkerGroup.generate`)."""

    def next_batch(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """One round of generation; with algorithm.dynamic_sampling, more rounds until the
        batch holds data.train_batch_size groups whose rewards differ (DAPO), at most
        algorithm.max_sampling_rounds."""
        algo, timer = self.cfg.algorithm, self.ctx.timer
        batch, metrics = self._round(step, 0)
        if algo.dynamic_sampling:
            batch, metrics = self._refill(step, batch, metrics)
        metrics["perf/generate_tokens_per_s"] = (metrics.pop("perf/generated_all_rounds")
                                                 / max(timer.times["timing/generate"], 1e-9))
        return batch, metrics

    def _round(self, step: int, round_: int) -> tuple[RolloutBatch, dict[str, float]]:
        prompts = self.ctx.loader.next_batch()
        timer = self.ctx.timer
        with timer("generate"):
            # round 0 keeps the seeds a run without dynamic sampling draws
            seeds = prompt_seeds(self.cfg.trainer.seed, step if round_ == 0 else (step, round_), prompts, False)
            batch = self.generate(prompts, train_sampling(self.cfg), seeds, "generate")
        with timer("reward"):
            metrics = self.ctx.score(batch)
        metrics["perf/generated_all_rounds"] = float(batch.response_lengths.sum())
        return batch, metrics

    def _refill(self, step: int, batch: RolloutBatch,
                metrics: dict[str, float]) -> tuple[RolloutBatch, dict[str, float]]:
        algo, want = self.cfg.algorithm, self.cfg.data.train_batch_size
        kept: list[RolloutBatch] = []
        have, rounds = 0, 0
        while True:
            rounds += 1
            keep, taken = select_informative(batch.rewards, batch.group, want - have)
            part = batch.select(keep.nonzero().flatten())
            part.group = part.group + (rounds - 1) * want  # group ids stay unique across rounds
            kept.append(part)
            have += taken
            if have >= want or rounds >= algo.max_sampling_rounds:
                break
            batch, round_metrics = self._round(step, rounds)
            metrics["perf/generated_all_rounds"] += round_metrics["perf/generated_all_rounds"]
        out = {**metrics, "dynamic_sampling/rounds": float(rounds), "adv/informative_groups": float(have),
               "dynamic_sampling/shortfall_groups": float(want - have)}
        if have < want:
            logger.warning("step %d: %d of %d groups had differing rewards after %d rounds "
                           "(algorithm.max_sampling_rounds); training on those", step, have, want, rounds)
        if have == 0:  # nothing informative: the last round, whose advantages are all zero
            return batch, out
        return RolloutBatch.cat(kept), out
    def generate(self, prompts: Sequence[PromptSample], sampling: SamplingParams,
                 seeds: list[int], phase: str) -> RolloutBatch:
        batch = self.engines.generate(list(prompts), sampling, seeds, phase=phase)
        return attach_prompts(batch, prompts)

    def load_state_dict(self, driver_state: dict[str, Any], source: str) -> None:
        if "async" in driver_state:
            owed = driver_state["async"]
            logger.warning(
                "resuming an async checkpoint synchronously: %d drawn but untrained prompts are "
                "skipped", len(owed["pending"]) + len(owed["ready"]))
