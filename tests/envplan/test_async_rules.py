"""A rule scoped to async mode (EnvRule.modes) reaches async plans only, for every role,
platform and placement; the mode a run is in flows from the trainer config into the plan."""

from __future__ import annotations

import itertools

import pytest

from polyrl.config.vocabulary import DISAGGREGATED
from polyrl.envplan import BACKENDS, PLACEMENTS, ROLES, EnvRule, PlanContext, build_plan
from polyrl.envplan.rules import RULES
from polyrl.platform import SIMULATED_PROBES, get_platform

ASYNC_ONLY = EnvRule(id="async-only-test", variables={"POLYRL_TEST_ASYNC_ONLY": "1"},
                     reason="test rule", link="https://example.invalid", modes=frozenset({"async"}))


@pytest.mark.parametrize("hw,role,placement", list(itertools.product(["cpu", "h100", "mi300x"], ROLES, PLACEMENTS)))
def test_async_scoped_rule_only_in_async_plans(hw, role, placement):
    platform = get_platform(None if hw == "cpu" else {"h100": "cuda", "mi300x": "rocm"}[hw], SIMULATED_PROBES[hw])
    for backend in BACKENDS:
        plans = {mode: build_plan(PlanContext(platform, role, backend, placement=placement, mode=mode), {}, {},
                                  rules=RULES + (ASYNC_ONLY,)) for mode in ("sync", "async")}
        assert plans["async"]["POLYRL_TEST_ASYNC_ONLY"].source == "rule:async-only-test"
        assert "POLYRL_TEST_ASYNC_ONLY" not in plans["sync"].entries
        # everything else is the same in both modes
        rest = {m: {k: (e.value, e.source) for k, e in p.entries.items() if k != "POLYRL_TEST_ASYNC_ONLY"}
                for m, p in plans.items()}
        assert rest["sync"] == rest["async"]


def test_user_value_wins_over_an_async_rule():
    platform = get_platform(None, SIMULATED_PROBES["cpu"])
    plan = build_plan(PlanContext(platform, "rollout", "native", placement=DISAGGREGATED, mode="async"),
                      {"POLYRL_TEST_ASYNC_ONLY": "0"}, {}, rules=(ASYNC_ONLY,))
    assert plan["POLYRL_TEST_ASYNC_ONLY"].value == "0"
    assert plan["POLYRL_TEST_ASYNC_ONLY"].source == "user-env"


def test_trainer_mode_reaches_the_plan():
    from polyrl.distributed.ray_launch import plan_for_role
    from polyrl.distributed.topologies import select_topology

    platform = get_platform(None, SIMULATED_PROBES["cpu"])
    for mode in ("sync", "async"):
        plan = plan_for_role(platform, "rollout", topology=select_topology(DISAGGREGATED, mode))
        assert plan.context.mode == mode
