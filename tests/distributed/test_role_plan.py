"""The typed plan each actor is handed (polyrl/distributed/role.py), as the launch plan builds it
for each topology: what the workers act on instead of rollout.placement / trainer.mode."""

from __future__ import annotations

import pickle

from polyrl.config import load_config
from polyrl.distributed.role import RolePlan
from polyrl.job import JobConfig
from polyrl.platform import SIMULATED_PROBES, get_platform
from polyrl.topology.launch_plan import plan_launch, role_plans


def job(*overrides: str) -> JobConfig:
    return load_config(JobConfig, overrides=["actor.num_cpus_per_worker=1", "rollout.max_model_len=64",
                                             *overrides])


def test_colocated_ranks_host_their_engine_and_sync_in_place():
    roles = role_plans(job("actor.world_size=2", "data.train_batch_size=4", "trainer.seed=7"), 1)
    assert roles["rollout"] == []
    for r, role in enumerate(roles["policy"]):
        assert (role.topology, role.role, role.index, role.rank, role.world_size) == ("colocated", "policy", r, r, 2)
        assert role.hosts_engine and role.colocated_engine and role.engine_seed == 7 + 1000 * r
        assert role.transport == "in_place" and role.sends_weights and role.layout is None
        assert role.groups == ("trainer",) and role.on_policy and role.max_staleness == 0


def test_disaggregated_ranks_share_one_world_and_the_leader_sends():
    roles = role_plans(job("actor.world_size=2", "rollout.placement=standalone", "rollout.num_replicas=2",
                           "rollout.tensor_parallel_size=2", "rollout.backend=vllm"), 1)
    policy, rollout = roles["policy"], roles["rollout"]
    assert [p.sends_weights for p in policy] == [True, False]  # the weight-sync group's leader (R5)
    assert all(p.layout is not None and p.world_size == 6 and not p.hosts_engine for p in policy)
    assert "weight_sync" in policy[0].groups and "weight_sync" not in policy[1].groups
    assert [(r.rank, r.index, r.hosts_engine, r.engine_seed) for r in rollout] == [
        (2, 0, True, 2000), (3, 0, False, None), (4, 1, True, 4000), (5, 1, False, None)]
    assert {r.transport for r in policy + rollout} == {"broadcast"}
    assert all(not r.colocated_engine and r.on_policy and "replica" in r.groups for r in rollout)


def test_streaming_replicas_join_no_world_and_carry_the_staleness_bound():
    roles = role_plans(job("rollout.placement=standalone", "trainer.mode=async", "rollout.num_replicas=3",
                           "async.max_staleness=2"), 1)
    [policy] = roles["policy"]
    assert policy.sends_weights and policy.transport == "object_store" and policy.background_publish
    assert [(r.index, r.rank, r.world_size, r.engine_seed) for r in roles["rollout"]] == [
        (0, None, 1, 0), (1, None, 1, 1000), (2, None, 1, 2000)]
    assert all(r.max_staleness == 2 and not r.on_policy for r in roles["rollout"])


def test_the_launch_plan_hands_each_actor_its_plan_with_its_engine_arguments():
    """The engine arguments follow the plan's colocation: a colocated vLLM engine sleeps
    between rollouts and starts on dummy weights; a replica's does not."""
    h100 = get_platform("cuda", SIMULATED_PROBES["h100"])
    hybrid = plan_launch(job("rollout.backend=vllm"), h100, engine_version="0.11.0")
    [rank] = hybrid.actors
    assert rank.plan.colocated_engine and rank.plan.engine is rank.engine
    assert rank.engine.args["enable_sleep_mode"] is True and rank.engine.args["load_format"] == "dummy"
    standalone = plan_launch(job("rollout.backend=vllm", "rollout.placement=standalone"), h100,
                             engine_version="0.11.0")
    policy, replica = standalone.actors
    assert policy.plan.engine is None and replica.plan.hosts_engine
    assert "enable_sleep_mode" not in replica.engine.args and replica.engine.args["load_format"] == "auto"
    assert standalone.as_dict()["topology"]["name"] == "disaggregated"
    assert standalone.as_dict()["actors"][1]["plan"]["rank"] == 1


def test_a_plan_travels_to_a_ray_actor_unchanged():
    [role] = role_plans(job("rollout.placement=standalone"), 1)["rollout"]
    assert isinstance(role, RolePlan) and pickle.loads(pickle.dumps(role)) == role
