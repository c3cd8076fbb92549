"""`polyrl train --dry-run [--json]`: the whole launch plan, with nothing started.

Resolved config, platform, placement, the weight hand-off (both ends' device and backend), and
for the Ray job and every Ray actor its resources, environment (value, source, reason) and the
engine's launch arguments. With ray.enabled=false, the run in this one process instead: its
worker objects, their threads, device and the environment set here, no Ray. `--platform`,
`--capability`, `--gpus-per-node` and `--nodes` plan for hardware this machine does not have:

    polyrl train --dry-run --platform gb200 -c configs/gsm8k_qwen_gpu.yaml rollout.backend=vllm
    polyrl train --dry-run --json --platform mi300x rollout.placement=disaggregated rollout.num_replicas=2

Exit status: 0 for a complete plan, 1 when part of it cannot be built (the run would fail the same
way; the plan says which part), 2 for a config or flag error.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from polyrl.distributed.role import RolePlan
from polyrl.topology.launch_plan import ActorPlan, LaunchPlan
from polyrl.topology.local_plan import InProcessPlan, plan_here
from polyrl.topology.run_plan import RunData, RunPlan, resolve
from polyrl.topology.weights_plan import WeightsPlan, plan_weights
from polyrl.job import JobConfig


def dry_run(cfg: JobConfig, platform: Any, engine_version: str | None, as_json: bool,
            nodes: int | None = None) -> int:
    """Print the run's plan (`resolve`, polyrl/topology/run_plan.py: the plan `polyrl train`
    starts); `nodes`: simulate a cluster of that many nodes (None: as many as needed). A model
    too big for the planned ranks is refused first, as the run's pre-flight refuses it."""
    check_memory_fits(cfg, platform)
    plan = resolve(cfg, dry_run_data(cfg), platform, engine_version, nodes)
    local = None if cfg.ray.enabled else plan_here(plan)  # one process, no Ray: its own plan
    if as_json:
        print(json.dumps(plan_json(local or plan), indent=2, default=str))
    elif local is not None:
        render_in_process(local, Console(soft_wrap=False))
    else:
        render(plan, Console(soft_wrap=False))
    return 1 if plan.launch.errors else 0


def dry_run_data(cfg: JobConfig) -> RunData | None:
    """The data's shape, as the run reads it, where the plan needs it (rollout.max_model_len or
    trainer.total_steps unset) and the tokenizer and data files are on this machine; None
    otherwise (the plan's notes then say what the run fills in at start)."""
    if cfg.rollout.max_model_len is not None and cfg.trainer.total_steps:
        return None
    from polyrl.data import DataFileError
    from polyrl.trainer.run_data import load_run_data
    from polyrl.training.model_loading import ModelLoadError

    try:
        _, train, val = load_run_data(cfg)
    except (DataFileError, ModelLoadError, OSError, ValueError):
        return None
    return RunData.of(train, val)


def check_memory_fits(cfg: JobConfig, platform: Any) -> None:
    """The pre-flight's memory check (polyrl/trainer/preflight.py `check_memory`) on the planned
    platform, from the model's config.json; a model directory not on this machine is not checked."""
    from polyrl.cli.common import CLIError
    from polyrl.config import ConfigError
    from polyrl.trainer.preflight import check_memory
    from polyrl.training.model_loading import ModelLoadError, model_dir

    try:
        config = json.loads((model_dir(cfg.model.path) / "config.json").read_text())
    except (ModelLoadError, OSError, ValueError):
        return
    try:
        check_memory(cfg, config, platform)
    except ConfigError as exc:
        raise CLIError("; ".join(exc.problems)) from None


def plan_json(plan: RunPlan | InProcessPlan) -> dict[str, Any]:
    """The plan as `--json` prints it: a Ray run's with its weight hand-off (the in-process
    plan has its own)."""
    if isinstance(plan, InProcessPlan):
        return {"dry_run": True, **plan.as_dict()}
    weights = plan_weights(plan.launch, plan.cfg.weights.shared_memory)
    return {"dry_run": True, **plan.as_dict(), "weights": weights.as_dict()}


# --- human output ---------------------------------------------------------------------------
# Every user-controlled string goes through Text(...): rich markup would eat `[vllm]`.


def render(run_plan: RunPlan, console: Console) -> None:
    from polyrl.config import to_yaml

    console.rule(Text("resolved config"))
    console.print(Text(to_yaml(run_plan.cfg).rstrip()))
    plan, engine_version = run_plan.launch, run_plan.engine_version
    p, s = plan.platform, run_plan.summary()
    tree = Tree(Text("launch plan (dry run: no Ray, no model load, no engine import)", style="bold"))
    tree.add(Text(f"platform: {p.describe()}" + (" [simulated]" if p.probe.simulated else "")))
    rollout = ("engine colocated on each policy rank" if plan.topology.colocated_engine
               else f"{s['rollout_replicas']} rollout replica(s) x TP {s['tensor_parallel_size']}")
    version = f" {engine_version}" if engine_version else (
        " (version unknown: not installed here; see --engine-version)" if s["backend"] != "native" else "")
    tree.add(Text(f"placement: {s['placement']}, mode {s['mode']}; {s['policy_ranks']} policy "
                  f"rank(s), {rollout}; backend {s['backend']}{version}"))
    tree.add(Text(f"topology: {topology_text(plan)}; training mesh {s['training_mesh']}"))
    add_weights(tree, plan_weights(plan, run_plan.cfg.weights.shared_memory))
    if p.ray_resource:
        have = (f" of {plan.placement.nodes_available} available"
                if plan.placement and plan.placement.nodes_available else "")
        tree.add(Text(f"devices: {plan.devices_needed:g} {p.ray_resource} needed, "
                      f"{p.device_count} per node -> {plan.nodes_needed} node(s){have}"))
    init = ", ".join(f"{k}={v!r}" for k, v in plan.job.ray_init.items())
    job = tree.add(Text(f"Ray job: ray.init({init}, runtime_env=<job env>)"))
    job.add(env_table(plan.job.env.to_json(), "job env"))
    job_vars = plan.job.env.to_json()
    for members, actor in group_identical(plan.actors):
        names = [n for n, _ in members]
        who = ", ".join(names) if len(names) < 3 else f"{names[0]} ... {names[-1]} ({len(names)} actors)"
        branch = tree.add(Text(f"{who}: {resources_text(actor.resources)}; "
                               f"torch threads {actor.num_threads}; env role "
                               f"{actor.env.context.role}"
                               + (f"; max concurrency {actor.max_concurrency}"
                                  if actor.max_concurrency else ""), style="bold"))
        if actor.plan is not None:
            branch.add(Text(f"does: {duty_text(actor.plan)}"))
        if actor.devices is not None:
            branch.add(Text("devices: " + "; ".join(_devices_text(n, a) for n, a in members)))
        extra = {k: v for k, v in actor.env.to_json().items() if job_vars.get(k) != v}
        if extra:
            branch.add(env_table(extra, f"env: the job env plus {len(extra)} variable(s)"))
        else:
            branch.add(Text("env: the job env, nothing added"))
        if actor.engine is not None:
            add_engine(branch, actor.engine, "colocated with training" if actor.role == "policy" else "own actor")
    if plan.world is not None:
        w = plan.world
        groups = tree.add(Text(f"process groups: one torch.distributed world of {w.size} ranks, "
                               f"backend {w.backend} ({w.library})", style="bold"))
        for g in w.groups:
            nodes = f" on node(s) {', '.join(map(str, sorted(set(g.nodes))))}" if g.nodes else ""
            groups.add(Text(f"{g.kind}: ranks {ranks_text(g.ranks)} (leader {g.leader}){nodes}, "
                            f"{g.backend} ({g.library}): {g.purpose}"))
    add_notes(tree, plan.notes, plan.errors)
    console.rule(Text("launch plan"))
    console.print(tree)


def render_in_process(local: InProcessPlan, console: Console) -> None:
    """ray.enabled=false: the run in this process (polyrl/topology/local_plan.py), no Ray."""
    from polyrl.config import to_yaml

    run_plan = local.run
    console.rule(Text("resolved config"))
    console.print(Text(to_yaml(run_plan.cfg).rstrip()))
    plan, p, s = run_plan.launch, run_plan.platform, run_plan.summary()
    tree = Tree(Text("in-process plan (ray.enabled=false; dry run: nothing loaded or started)", style="bold"))
    tree.add(Text(f"platform: {p.describe()}" + (" [simulated]" if p.probe.simulated else "")))
    tree.add(Text(f"placement: {s['placement']}, mode {s['mode']}; one process: the trainer, "
                  f"{s['policy_ranks']} policy rank and its {s['backend']} engine; no Ray job, no "
                  "actor, no process group"))
    tree.add(Text(f"topology: {topology_text(plan)}; training mesh {s['training_mesh']}"))
    add_weights(tree, local.weights)
    for worker in local.workers:
        branch = tree.add(Text(f"{worker.name}: a {worker.cls} object of this process (LocalActor); "
                               f"torch threads {worker.num_threads} (the process's); device "
                               f"{worker.device}", style="bold"))
        branch.add(Text(f"does: {duty_text(worker.plan)}"))
        branch.add(env_table(worker.env.to_json(), "env set in this process for the run"))
        if worker.plan.engine is not None:
            add_engine(branch, worker.plan.engine, "colocated with training")
    add_notes(tree, local.notes, local.errors)
    console.rule(Text("in-process plan"))
    console.print(tree)


def add_engine(branch: Tree, engine, where: str) -> None:
    """An engine's launch arguments, or the error that stops its launch."""
    title = f"{engine.backend} engine ({where}) launch arguments"
    if engine.error:
        branch.add(Text(f"{title}: ERROR {engine.error}", style="bold red"))
    else:
        branch.add(args_table(engine.args or {}, title))


def add_notes(tree: Tree, notes, errors) -> None:
    for note in notes:
        tree.add(Text(f"note: {note}", style="yellow"))
    for error in errors:
        tree.add(Text(f"error: {error}", style="bold red"))


def add_weights(tree: Tree, weights: WeightsPlan) -> None:
    """The weight hand-off: per row, both ends' device and what carries the bytes."""
    lines = weights.lines()
    if len(lines) == 1:
        tree.add(Text(f"weights: {lines[0]}"))
        return
    branch = tree.add(Text(f"weights: {weights.transport}, the first path every receiver can take"))
    for line in lines:
        branch.add(Text(line))


def group_identical(actors: list[ActorPlan]) -> list[tuple[list[tuple[str, ActorPlan]], ActorPlan]]:
    """Actors that differ only in name, rank and devices are shown once (devices listed)."""
    groups: dict[str, list[ActorPlan]] = defaultdict(list)
    for a in actors:
        d = a.as_dict()
        key = json.dumps({**{k: d[k] for k in ("role", "resources", "num_threads", "max_concurrency",
                                               "env", "engine")},
                          "duty": duty_text(a.plan) if a.plan else None},
                         sort_keys=True, default=str)
        groups[key].append(a)
    return [([(a.name, a) for a in group], group[0]) for group in groups.values()]


def topology_text(plan: LaunchPlan) -> str:
    t = plan.topology
    timing = "on-policy (generate, then train)" if t.on_policy else "bounded staleness (generation overlaps training)"
    transport = next((a.plan.transport for a in plan.actors if a.plan is not None), t.transports[0])
    return f"{t.name}, {timing}; weights travel {transport} (allowed: {', '.join(t.transports)})"


def duty_text(role: RolePlan) -> str:
    """What a policy or rollout actor does, from its plan (the same for every actor shown)."""
    parts = ["trains"] if role.role == "policy" else []
    if role.role == "teacher":  # distill.placement=disaggregated (polyrl/workers/teacher.py)
        parts.append("scores each step's samples with the distillation teacher (log-probs per sample "
                     "to the driver); its own process group")
    if role.role == "policy" and role.holds_teacher:  # distill.placement=colocated
        parts.append("holds the distillation teacher (frozen) and scores each step's samples with it")
    if role.hosts_engine:
        parts.append("hosts a colocated rollout engine (asleep while training)" if role.colocated_engine
                     else "hosts its replica's rollout engine")
    elif role.role == "rollout":
        parts.append("hands each version to its replica leader's engine")
    if role.role == "policy" and role.sends_weights:
        parts.append(f"sends each weight version ({role.transport})")
    elif role.role == "rollout":
        parts.append(f"receives each weight version ({role.transport})")
    parts.append(f"in a world of {role.world_size} ranks" if role.world_size > 1 else "in no process group")
    if not role.on_policy:
        parts.append(f"samples at most {role.max_staleness} version(s) stale")
    return "; ".join(parts)


def _devices_text(name: str, actor: ActorPlan) -> str:
    d = actor.devices
    if d and actor.hands is not None:  # an engine host: asks Ray for none, sees its replica's
        return (f"{name} -> node {d.node} [{', '.join(map(str, d.ids))}] held in its bundle; "
                f"engine host, sees [{', '.join(map(str, actor.hands))}]")
    return f"{name} -> node {d.node} [{', '.join(map(str, d.ids))}]" if d else f"{name} -> none"


def ranks_text(ranks: tuple[int, ...]) -> str:
    """0-7, 9, 12-15: consecutive runs as ranges."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)


def resources_text(resources: dict[str, Any]) -> str:
    parts = [f"{k}={v}" for k, v in resources.items() if k != "resources"]
    parts += [f"{k}={v}" for k, v in (resources.get("resources") or {}).items()]
    return ", ".join(parts)


def env_table(env: dict[str, dict[str, str]], title: str) -> Table:
    table = Table(title=Text(title), title_justify="left", expand=False)
    for col in ("variable", "value", "source", "reason"):
        table.add_column(col, overflow="fold")
    for name, e in env.items():
        reason = e["reason"] + (f" ({e['link']})" if e.get("link") else "")
        table.add_row(Text(name), Text(e["value"]), Text(e["source"]), Text(reason))
    return table


def args_table(args: dict[str, Any], title: str) -> Table:
    table = Table(title=Text(title), title_justify="left", expand=False)
    table.add_column("argument")
    table.add_column("value", overflow="fold")
    for name, value in args.items():
        table.add_row(Text(name), Text(json.dumps(value, default=str)))
    return table
