"""An engine host's devices come from the placement: its visible-devices variable lists exactly its
replica's ids, whatever the launching shell says, next to the NOSET variables that keep Ray from
rewriting it (polyrl/envplan/plan.py:handoff_variable)."""

from __future__ import annotations

import pytest

from polyrl.config.vocabulary import DISAGGREGATED
from polyrl.envplan import PlanContext, build_plan
from polyrl.platform import SIMULATED_PROBES, get_platform


@pytest.mark.parametrize("name,hw,var", [("cuda", "h100", "CUDA_VISIBLE_DEVICES"),
                                         ("rocm", "mi300x", "HIP_VISIBLE_DEVICES"),
                                         ("npu", "ascend910", "ASCEND_RT_VISIBLE_DEVICES")])
def test_the_placement_decides_what_an_engine_host_sees(name, hw, var):
    platform = get_platform(name, SIMULATED_PROBES[hw])
    ctx = PlanContext(platform, "rollout", "vllm", placement=DISAGGREGATED, mode="sync", hands_devices=True,
                      visible_devices=(4, 5, 6, 7))
    plan = build_plan(ctx, user_env={var: "0"}, config_env={})
    assert (plan[var].value, plan[var].source) == ("4,5,6,7", "placement")
    assert all(plan[f"RAY_EXPERIMENTAL_NOSET_{v}"].value == "1" for v in platform.visible_devices_vars)
    # an actor that reserves its devices through Ray gets neither
    reserving = build_plan(PlanContext(platform, "rollout", "vllm", placement=DISAGGREGATED, mode="sync"), user_env={}, config_env={})
    assert var not in reserving and not any(k.startswith("RAY_EXPERIMENTAL_NOSET_") for k in reserving.entries)
