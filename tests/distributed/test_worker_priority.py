"""polyrl's Ray actors run at the driver's CPU priority, not at Ray's worker nice 15
(polyrl/distributed/ray_launch.py, `with_worker_priority`)."""

from __future__ import annotations

import os
from types import SimpleNamespace

from polyrl.distributed.ray_launch import WORKER_NICENESS_VAR, actor_options, with_worker_priority


def test_the_runtime_env_asks_for_nice_0_and_keeps_a_users_value():
    env = with_worker_priority({"env_vars": {"A": "1"}, "py_modules": []}, environ={})
    assert env == {"env_vars": {"A": "1", WORKER_NICENESS_VAR: "0"}, "py_modules": []}
    assert with_worker_priority({}, environ={WORKER_NICENESS_VAR: "15"})["env_vars"] == {WORKER_NICENESS_VAR: "15"}
    planned = {"env_vars": {WORKER_NICENESS_VAR: "5"}}  # a plan's (config env:) value wins
    assert with_worker_priority(planned, environ={WORKER_NICENESS_VAR: "15"})["env_vars"] == {WORKER_NICENESS_VAR: "5"}


def test_an_actor_started_with_polyrl_options_runs_at_the_drivers_priority(ray_session, monkeypatch):
    """A plain Ray actor of the session runs at a higher nice value than the driver (Ray's +15);
    one started with `actor_options` at the driver's own (the old code started both at +15)."""
    monkeypatch.delenv(WORKER_NICENESS_VAR, raising=False)
    ray = ray_session

    @ray.remote
    class Probe:
        def nice(self) -> int:
            return os.getpriority(os.PRIO_PROCESS, 0)

    plan = SimpleNamespace(runtime_env=lambda: {"env_vars": {"POLYRL_TEST_PLANNED": "1"}})  # an EnvPlan's one method used
    options = actor_options(plan, {"num_cpus": 0})
    assert options["runtime_env"]["env_vars"] == {"POLYRL_TEST_PLANNED": "1", WORKER_NICENESS_VAR: "0"}
    ours = Probe.options(**options).remote()
    plain = Probe.options(num_cpus=0).remote()
    try:
        driver = os.getpriority(os.PRIO_PROCESS, 0)  # the session's raylet was started from here
        assert ray.get(ours.nice.remote(), timeout=120) == driver
        assert ray.get(plain.nice.remote(), timeout=120) == min(driver + 15, 19)
    finally:
        ray.kill(ours)
        ray.kill(plain)
