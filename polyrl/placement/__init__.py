"""Placement: which node and devices each actor of a job gets, planned purely and enforced by Ray.

    plan = plan_placement(gangs, devices_per_node=8, nodes=2)     # pure: dry run, tests
    live = create_placement(plan, launch_plan.actors)             # Ray placement groups
    options = options_for(live, launch_plan.actors)               # actor name -> .options(...)

`polyrl/topology/launch_plan.py` builds the gangs of a run (`job_gangs`); `polyrl train --dry-run`
prints each actor's `devices`. Ray-dependent code lives in `ray_groups` and `probe` (the live check
`polyrl placement` runs: polyrl/cli/placement_check.py) and is imported lazily, so planning never
needs Ray. This layer takes plans as arguments and imports nothing above it, not even inside a
function (tests/placement/test_probe_layer.py).
"""

from polyrl.placement.planner import (
    Devices,
    Gang,
    Member,
    PlacementError,
    PlacementPlan,
    plan_placement,
)

__all__ = [
    "Devices",
    "Gang",
    "LivePlacement",
    "Member",
    "PlacementError",
    "PlacementPlan",
    "create_placement",
    "options_for",
    "plan_placement",
]


def __getattr__(name: str):
    if name in ("LivePlacement", "create_placement", "options_for"):
        from polyrl.placement import ray_groups

        return getattr(ray_groups, name)
    raise AttributeError(name)
