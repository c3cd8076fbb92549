"""polyrl's Ray actors run at the driver's CPU priority, not at Ray's worker nice 15 (the env
plan's rule `ray-worker-priority`, polyrl/envplan/rules.py; its plan-level cases, a user's value
kept included, are in tests/envplan/test_plan_matrix.py)."""

from __future__ import annotations

import os

from polyrl.config.vocabulary import COLOCATED
from polyrl.distributed.ray_launch import actor_options
from polyrl.envplan import PlanContext, build_plan
from polyrl.envplan.rules import WORKER_NICENESS_VAR
from polyrl.platform import get_platform


def test_an_actor_started_with_polyrl_options_runs_at_the_drivers_priority(ray_session):
    """An actor started with its plan's `actor_options` runs at the driver's own nice value; one
    whose plan keeps a user's RAY_worker_niceness=15 (Ray's default) at the driver's +15, so the
    variable is what decides (the code before issue 42 started every actor at +15)."""
    ray = ray_session
    context = PlanContext(get_platform("cpu"), "trainer", placement=COLOCATED, mode="sync")

    @ray.remote
    class Probe:
        def nice(self) -> int:
            return os.getpriority(os.PRIO_PROCESS, 0)

    ours, users = build_plan(context, {}, {}), build_plan(context, {WORKER_NICENESS_VAR: "15"}, {})
    options = actor_options(ours, {"num_cpus": 0})
    assert options["runtime_env"] == ours.runtime_env()
    assert options["runtime_env"]["env_vars"][WORKER_NICENESS_VAR] == "0"
    assert actor_options(users, {"num_cpus": 0})["runtime_env"]["env_vars"][WORKER_NICENESS_VAR] == "15"
    started = Probe.options(**options).remote()
    niced = Probe.options(**actor_options(users, {"num_cpus": 0})).remote()
    try:
        driver = os.getpriority(os.PRIO_PROCESS, 0)  # the session's raylet was started from here
        assert ray.get(started.nice.remote(), timeout=120) == driver
        assert ray.get(niced.nice.remote(), timeout=120) == min(driver + 15, 19)
    finally:
        ray.kill(started)
        ray.kill(niced)
