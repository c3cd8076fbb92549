"""The plan of a run in this one process (ray.enabled=false): what `Trainer.start` does instead
of the Ray launch, and what `polyrl train --dry-run ray.enabled=false` prints.

`JobConfig` allows such a run one policy rank, colocated and sync, and nothing that needs a
second process (its `_check_in_process`: the dry run and the run load the config through the
same check, so they refuse the same settings with the same line). The run starts no Ray job and
no actor: its policy worker is a `LocalActor` (polyrl/topology/in_process.py) built in the
driver's process from the rank's `RolePlan`. So the plan has no Ray resources, runtime env,
placement groups or process groups; it has, per worker, the torch threads its constructor sets
(for the whole process), the device it claims (`Platform.reserved_device`: outside a Ray actor,
index 0), and the environment its plan sets in this process for the run (`apply_here`, the
caller's values back at the end), plus the weight hand-off (in place, into its own engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polyrl.distributed.role import RolePlan
from polyrl.envplan import EnvPlan
from polyrl.topology.run_plan import RunPlan
from polyrl.topology.weights_plan import WeightsPlan, plan_weights

START_ONLY_NOTE = ("the variables above are set in this process when the run starts and restored at its "
                   "end; one a library reads only when the process starts (the allocator's) acts only "
                   "when exported before polyrl starts: `polyrl env --role trainer` prints them")


@dataclass(frozen=True)
class LocalWorker:
    """A worker object of this process, called through a `LocalActor`."""

    name: str
    """As the run names it in errors and timeouts ("policy rank 0")."""
    cls: str
    """The worker class (the one a Ray run starts as an actor)."""
    num_threads: int
    """torch threads its constructor sets (`torch.set_num_threads`: this whole process's)."""
    device: str
    """The device it computes on (`Platform.claim_device` with no Ray reservation)."""
    env: EnvPlan
    """The variables set in this process for the run (a Ray actor's runtime env)."""
    plan: RolePlan

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "class": self.cls, "num_threads": self.num_threads,
                "device": self.device, "env": self.env.to_json(),
                "engine": self.plan.engine.as_dict() if self.plan.engine else None,
                "plan": self.plan.as_dict()}


@dataclass(frozen=True)
class InProcessPlan:
    run: RunPlan
    workers: tuple[LocalWorker, ...]
    weights: WeightsPlan

    @property
    def errors(self) -> list[str]:
        """What the start refuses (the launch plan's: the engine's arguments, the placement)."""
        return self.run.launch.errors

    @property
    def notes(self) -> list[str]:
        return [*self.run.launch.notes, START_ONLY_NOTE]

    def env_values(self) -> dict[str, str]:
        """What `Trainer.start` sets in this process (the policy worker's planned variables)."""
        (policy,) = [w for w in self.workers if w.plan.role == "policy"]
        return policy.env.values()

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: what `polyrl train --dry-run --json ray.enabled=false` prints (besides
        "dry_run": true). No Ray job, actors, devices or process groups: the run has none."""
        launch = self.run.launch.as_dict()
        return {"in_process": True, "placement": self.run.summary(), "platform": launch["platform"],
                "topology": launch["topology"], "workers": [w.as_dict() for w in self.workers],
                "weights": self.weights.as_dict(), "errors": self.errors, "notes": self.notes,
                "config": self.run.cfg.model_dump(mode="json")}


def plan_here(run: RunPlan) -> InProcessPlan:
    """The in-process run of `run` (its config has ray.enabled=false): its planned policy rank
    as a worker of this process."""
    device = str(run.platform.reserved_device())  # what the worker's claim_device gives here
    workers = tuple(LocalWorker(a.name, "PolicyWorker", a.plan.num_threads, device, a.env, a.plan)
                    for a in run.launch.actors if a.role == "policy")
    return InProcessPlan(run, workers, plan_weights(run.launch, run.cfg.weights.shared_memory))
