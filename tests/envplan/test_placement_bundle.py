"""POLYRL_PLACEMENT_BUNDLE: the bundle an engine-starting actor runs in, named by the placement
(`EnvPlan.in_bundle`) for engines that put Ray workers of their own in that bundle (TensorRT-LLM,
`polyrl/rollout/engines/trtllm.py:placement`), and for no other engine or process."""

from __future__ import annotations

import pytest

from polyrl.config.vocabulary import COLOCATED, DISAGGREGATED
from polyrl.envplan import PlanContext, build_plan
from polyrl.envplan.rules import PLACEMENT_BUNDLE_VAR
from polyrl.platform import SIMULATED_PROBES, get_platform
from polyrl.rollout.engines import trtllm

H100 = get_platform("cuda", SIMULATED_PROBES["h100"])


def test_the_variable_is_the_one_the_trtllm_adapter_reads():
    assert PLACEMENT_BUNDLE_VAR == trtllm.BUNDLE_ENV


@pytest.mark.parametrize("role,placement", [("rollout", DISAGGREGATED), ("trainer", COLOCATED)])
def test_an_actor_starting_trtllm_is_told_its_bundle_by_the_placement(role, placement):
    plan = build_plan(PlanContext(H100, role, "trtllm", placement=placement, mode="sync"), user_env={}, config_env={})
    assert PLACEMENT_BUNDLE_VAR not in plan  # no bundle yet: nothing to say
    placed = plan.in_bundle(3)
    entry = placed[PLACEMENT_BUNDLE_VAR]
    assert (entry.value, entry.source) == ("3", "placement")
    assert "bundle" in entry.reason and placed.context.placement_bundle == 3
    # and Ray leaves its visibility whole: TRT-LLM's workers inherit this environment and find
    # their device by physical id (ray.get_gpu_ids() maps through an inherited narrowed list)
    noset = {k: "1" for k in H100.ray_noset_envvars()}
    assert noset and placed.values() == {**plan.values(), PLACEMENT_BUNDLE_VAR: "3", **noset}
    assert {placed[k].source for k in noset} == {"placement"}
    assert placed.in_bundle(5)[PLACEMENT_BUNDLE_VAR].value == "5"  # the live bundle decides
    assert placed.runtime_env()["env_vars"][PLACEMENT_BUNDLE_VAR] == "3"
    cpu = build_plan(PlanContext(get_platform("cpu"), role, "trtllm", placement=placement, mode="sync"), {}, {}).in_bundle(3)
    assert not any(k.startswith("RAY_EXPERIMENTAL_NOSET_") for k in cpu.entries)
    # the context carries it too: a plan built with it says the same
    built = build_plan(PlanContext(H100, role, "trtllm", placement=placement, mode="sync", placement_bundle=3), {}, {})
    assert built.to_json() == placed.to_json()


@pytest.mark.parametrize("backend,role,placement", [
    ("vllm", "rollout", DISAGGREGATED), ("sglang", "trainer", COLOCATED), ("native", "rollout", DISAGGREGATED),
    ("trtllm", "trainer", DISAGGREGATED),  # a disaggregated run's policy rank starts no engine
    ("trtllm", "job", COLOCATED)])
def test_no_other_engine_or_process_gets_it(backend, role, placement):
    plan = build_plan(PlanContext(H100, role, backend, placement=placement, mode="sync"), user_env={}, config_env={})
    assert plan.in_bundle(2) is plan and PLACEMENT_BUNDLE_VAR not in plan.in_bundle(2)


def test_the_placement_wins_over_the_shell_and_the_config_and_a_shell_value_is_not_forwarded():
    """POLYRL_* variables of the shell are forwarded to every actor; this one names a bundle of
    one actor, so a stray value must neither reach the others nor override the placement."""
    ctx = PlanContext(H100, "rollout", "trtllm", placement=DISAGGREGATED, mode="sync")
    shell = build_plan(ctx, user_env={PLACEMENT_BUNDLE_VAR: "7", "POLYRL_OTHER": "x"}, config_env={})
    assert PLACEMENT_BUNDLE_VAR not in shell and shell["POLYRL_OTHER"].value == "x"
    assert shell.in_bundle(1)[PLACEMENT_BUNDLE_VAR].value == "1"
    config = build_plan(ctx, user_env={}, config_env={PLACEMENT_BUNDLE_VAR: "7"})
    assert config.in_bundle(1)[PLACEMENT_BUNDLE_VAR].as_dict()["source"] == "placement"
    assert config.in_bundle(1)[PLACEMENT_BUNDLE_VAR].value == "1"
