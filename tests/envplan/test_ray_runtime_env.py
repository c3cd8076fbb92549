"""A real Ray actor started with the rendered runtime env sees exactly the planned variables."""

from __future__ import annotations

import os

from polyrl.distributed.ray_launch import actor_options, plan_for_role
from polyrl.distributed.topologies import DISAGGREGATED
from polyrl.platform import get_platform, simulated_probe


def test_actor_sees_planned_and_user_variables(ray_session, monkeypatch):
    ray = ray_session
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")  # a GB300 user's setting
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    platform = get_platform("cuda", simulated_probe("gb300"))
    plan = plan_for_role(platform, "rollout", topology=DISAGGREGATED, backend="vllm",
                         config_env={"POLYRL_TEST_CFG": "x"}, hands_devices=True)  # an engine host with num_gpus=0

    @ray.remote
    class Probe:
        def env(self, names):
            return {n: os.environ.get(n) for n in names}

    names = list(plan.entries)
    actor = Probe.options(**actor_options(plan, {"num_cpus": 0})).remote()
    seen = ray.get(actor.env.remote(names), timeout=120)
    assert seen == plan.values()
    assert seen["NCCL_CUMEM_ENABLE"] == "1"
    assert seen["NCCL_DEBUG"] == "WARN"
    assert seen["POLYRL_TEST_CFG"] == "x"
    assert seen["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "1"
    ray.kill(actor)
