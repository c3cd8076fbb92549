"""Make Ray enforce a `PlacementPlan`: one placement group per planned node, one bundle per actor.

Each planned node becomes a STRICT_PACK placement group whose bundles are the reservations of the
actors planned there, in device order. STRICT_PACK keeps a tensor-parallel replica on one node;
a bundle holding exactly one actor's devices makes Ray set that actor's visible-devices variable
to exactly its planned devices (Ray reserves a bundle's device ids when the group is created,
lowest free first, in bundle order). An actor then asks for the same resources inside its bundle
(`placement_group_bundle_index`).

Groups are created in node order and each is waited for with a deadline; a group Ray cannot
place is an error that names the node, what it asks for and what the cluster has.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from polyrl.placement.planner import PlacementError, PlacementPlan


def bundle_of(resources: dict[str, Any]) -> dict[str, float]:
    """An actor's Ray options (num_cpus, num_gpus, resources) as a placement-group bundle."""
    bundle = {"CPU": resources.get("num_cpus", 0), "GPU": resources.get("num_gpus", 0),
              **(resources.get("resources") or {})}
    return {k: float(v) for k, v in bundle.items() if v}


@dataclass
class LivePlacement:
    """The placement groups of a running job and where each planned actor goes."""

    plan: PlacementPlan
    groups: list[PlacementGroup]
    """One per planned node, in node order."""
    node_ids: list[str]
    """The Ray node id each planned node landed on."""
    bundles: dict[str, tuple[int, int]]
    """Actor name -> (planned node, bundle index)."""

    def scheduling(self, actor: str) -> dict[str, Any]:
        """`.options(...)` entries that put `actor` into its bundle (empty for an actor without
        devices: Ray schedules it anywhere)."""
        if actor not in self.bundles:
            return {}
        node, index = self.bundles[actor]
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            self.groups[node], placement_group_bundle_index=index)}

    def remove(self) -> None:
        for group in self.groups:
            remove_placement_group(group)
        self.groups = []


def create_placement(plan: PlacementPlan, actors: Iterable[Any], timeout_s: float = 300) -> LivePlacement:
    """Reserve `plan` on the live Ray cluster. `actors` are the job's actors (anything with
    `.name` and `.resources`, the Ray options they reserve: `ActorPlan`; an engine host's
    `.bundle_resources` keep the device it asks none of reserved in its bundle)."""
    resources = {a.name: getattr(a, "bundle_resources", a.resources) for a in actors}
    missing = sorted(set(plan.assignments) - set(resources))
    if missing:
        raise PlacementError(f"the placement plan has actors the job does not: {', '.join(missing)}")
    groups: list[PlacementGroup] = []
    bundles: dict[str, tuple[int, int]] = {}
    try:
        for node in range(plan.nodes_used):
            names = plan.node_actors(node)
            group = placement_group([bundle_of(resources[n]) for n in names], strategy="STRICT_PACK",
                                    name=f"polyrl-node-{node}")
            groups.append(group)
            _wait_ready(group, node, [bundle_of(resources[n]) for n in names], timeout_s)
            bundles.update({n: (node, i) for i, n in enumerate(names)})
    except BaseException:
        for group in groups:
            remove_placement_group(group)
        raise
    return LivePlacement(plan, groups, [_node_of(g) for g in groups], bundles)


def options_for(placement: LivePlacement, actors: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """Actor name -> the complete `.options(...)` of each actor: its planned options
    (`ray_options()`: resources, runtime env, concurrency) plus its bundle, and for an actor
    that starts an engine the index of that bundle in its environment (`in_live_bundle`)."""
    return {a.name: {**in_live_bundle(placement, a).ray_options(), **placement.scheduling(a.name)}
            for a in actors}


def in_live_bundle(placement: LivePlacement, actor: Any) -> Any:
    """`actor` (an `ActorPlan`) with the bundle Ray reserved for it named in its environment when
    it starts an engine that places Ray workers of its own in that bundle, beside it
    (TensorRT-LLM, whose actors' bundles keep room for them: `ActorPlan.bundle`; Ray tells an
    actor its placement group, not its bundle): `EnvPlan.in_bundle`, which leaves every other
    engine's plan as it is. The live bundle decides; the plan's (launch_plan.in_bundles, shown by
    the dry run) is the same index, since both follow `PlacementPlan.node_actors`."""
    if getattr(actor, "engine", None) is None or getattr(actor, "bundle", None) is None \
            or actor.name not in placement.bundles:  # no engine, or no room in its bundle
        return actor
    env = actor.env.in_bundle(placement.bundles[actor.name][1])
    return actor if env is actor.env else dataclasses.replace(actor, env=env)


def _wait_ready(group: PlacementGroup, node: int, bundles: list[dict], timeout_s: float) -> None:
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if ready:
        return
    total: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            total[k] = total.get(k, 0) + v
    raise PlacementError(f"planned node {node} ({', '.join(f'{k}={v:g}' for k, v in total.items())} "
                         f"on one node) could not be reserved within {timeout_s:g} s; the cluster "
                         f"has {_cluster_summary()}: add nodes or shrink the job")


def _node_of(group: PlacementGroup) -> str:
    table = ray.util.placement_group_table(group)
    return next(iter(table["bundles_to_node_id"].values()))


def _cluster_summary() -> str:
    alive = [n for n in ray.nodes() if n.get("Alive")]
    per_node = [{k: v for k, v in n["Resources"].items() if k in ("CPU", "GPU", "NPU")} for n in alive]
    return f"{len(alive)} node(s): " + "; ".join(
        ", ".join(f"{k}={v:g}" for k, v in sorted(r.items())) for r in per_node)
