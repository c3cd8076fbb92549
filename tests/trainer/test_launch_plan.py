"""The launch plan: every Ray actor's resources, environment and engine arguments, computed
without starting anything, across simulated platforms and placements — and equal to what a real
launch gives real Ray actors."""

from __future__ import annotations

import os

import pytest

from polyrl.config import load_config
from polyrl.envplan.rules import FORWARDED_PREFIXES, WORKER_NICENESS_VAR
from polyrl.platform import SIMULATED_PROBES, get_platform
from polyrl.rollout import launch_args
from polyrl.job import JobConfig
from polyrl.topology.launch_plan import plan_actors, plan_launch

TOK = ("false", "polyrl-default")  # TOKENIZERS_PARALLELISM, in every process
# and every Ray worker at the driver's priority, not Ray's nice 15 (polyrl/envplan/rules.py)
EVERY = {"TOKENIZERS_PARALLELISM": TOK, WORKER_NICENESS_VAR: ("0", "rule:ray-worker-priority")}
NOSET = "RAY_EXPERIMENTAL_NOSET_"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No NCCL_*, HF_*, ... from the machine running the tests: plans are compared exactly."""
    for name in list(os.environ):
        if name.startswith(FORWARDED_PREFIXES) or name.startswith(("RAY_ACCEL", NOSET)) \
                or name == WORKER_NICENESS_VAR:
            monkeypatch.delenv(name)


def job(*overrides: str) -> JobConfig:
    return load_config(JobConfig, overrides=["actor.num_cpus_per_worker=1",
                                             "rollout.max_model_len=64", *overrides])


def machine(name: str):
    probe = SIMULATED_PROBES[name]
    return get_platform({"h100": "cuda", "gb200": "cuda", "gb300": "cuda", "mi300x": "rocm",
                         "ascend910": "npu", "cpu": "cpu"}[name], probe)


def env_of(plan) -> dict[str, tuple[str, str]]:
    return {name: (e.value, e.source) for name, e in plan.entries.items()}


def test_hybrid_h100_two_policy_ranks():
    cfg = job("actor.world_size=2", "data.train_batch_size=16")
    actors = plan_actors(cfg, machine("h100"))
    assert [(a.name, a.role, a.rank) for a in actors] == [("policy rank 0", "policy", 0),
                                                          ("policy rank 1", "policy", 1)]
    for a in actors:
        assert a.resources == {"num_cpus": 1, "num_gpus": 1}
        assert a.num_threads == 1
        assert env_of(a.env) == EVERY
        # hybrid: the engine is colocated on every policy rank, built by the native builder
        assert a.engine.args == {"model_path": launch_args_model(), "dtype": "float32",
                                 "max_model_len": 64, "max_num_seqs": 256}
        # Ray starts workers at nice 15 unless told: every actor runs at the driver's priority
        # (the env plan's rule ray-worker-priority), and its runtime env is exactly its plan
        assert a.ray_options() == {"num_cpus": 1, "num_gpus": 1,
                                   "runtime_env": {"env_vars": {"TOKENIZERS_PARALLELISM": "false",
                                                                "RAY_worker_niceness": "0"}}}


def launch_args_model():
    from polyrl.builtin import resolve

    return resolve("builtin:tiny-arith")


def test_standalone_h100_vllm_two_replicas_user_cumem_survives(monkeypatch):
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")  # R1: a GB300-class user's setting
    cfg = job("rollout.placement=standalone", "rollout.num_replicas=2", "rollout.backend=vllm",
              "env={POLYRL_RUN: a}")
    plan = plan_launch(cfg, machine("h100"), engine_version="0.11.0")
    names = [(a.name, a.role, a.rank, a.replica) for a in plan.actors]
    assert names == [("policy rank 0", "policy", 0, None),
                     ("rollout replica 0 (rank 1)", "rollout", 1, 0),
                     ("rollout replica 1 (rank 2)", "rollout", 2, 1)]
    user_cumem = ("1", "user-env")
    assert env_of(plan.job.env) == {"POLYRL_RUN": ("a", "config"), **EVERY,
                                    "NCCL_CUMEM_ENABLE": user_cumem}
    policy, *rollout = plan.actors
    assert env_of(policy.env) == env_of(plan.job.env) and policy.engine is None
    for a in rollout:
        assert a.resources == {"num_cpus": 1, "num_gpus": 1}
        # issue 15: an actor reserving a GPU keeps Ray's visibility (no RAY_EXPERIMENTAL_NOSET_*)
        assert env_of(a.env) == {"POLYRL_RUN": ("a", "config"), "NCCL_CUMEM_ENABLE": user_cumem,
                                 **EVERY}
        assert a.engine.args == launch_args.engine_launch_args(
            cfg.rollout, launch_args_model(), plan.platform, "0.11.0", colocated=False)
        assert a.engine.args["load_format"] == "auto"  # R4: standalone reads the checkpoint
        assert a.engine.args["tensor_parallel_size"] == 1
    assert plan.devices_needed == 3 and plan.nodes_needed == 1 and plan.errors == []
    # every replica on its own GPU (issue 15: all of them used to run on GPU 0)
    assert [a.devices.as_dict() for a in plan.actors] == [
        {"node": 0, "ids": [0]}, {"node": 0, "ids": [1]}, {"node": 0, "ids": [2]}]


def test_standalone_h100_cumem_default_without_user_value():
    cfg = job("rollout.placement=standalone", "rollout.num_replicas=2", "rollout.backend=vllm")
    plan = plan_launch(cfg, machine("h100"))
    assert env_of(plan.actors[1].env)["NCCL_CUMEM_ENABLE"] == ("0", "rule:nccl-cumem-off")
    assert not any("NOSET" in n for n in plan.notes)


@pytest.mark.parametrize("opt_in", [False, True])
def test_gb200_nvls_mnnvl_only_with_opt_in(monkeypatch, opt_in):
    if opt_in:
        monkeypatch.setenv("TLLM_DISABLE_NVLS_MNNVL", "1")
    cfg = job("rollout.placement=standalone", "rollout.num_replicas=2", "rollout.backend=trtllm",
              "rollout.tensor_parallel_size=2")
    plan = plan_launch(cfg, machine("gb200"))
    rule = {"NCCL_NVLS_ENABLE": ("0", "rule:blackwell-nvls-mnnvl-off"),
            "NCCL_MNNVL_ENABLE": ("0", "rule:blackwell-nvls-mnnvl-off"),
            "TLLM_DISABLE_NVLS_MNNVL": ("1", "user-env")} if opt_in else {}
    cumem = {"NCCL_CUMEM_ENABLE": ("1", "rule:nccl-cumem-mnnvl")}  # NVL72: every process (issue 39)
    assert env_of(plan.job.env) == {**rule, **cumem, **EVERY}
    assert [a.name for a in plan.actors] == ["policy rank 0", "rollout replica 0 (rank 1)",
                                             "rollout replica 0 (rank 2)", "rollout replica 1 (rank 3)",
                                             "rollout replica 1 (rank 4)"]
    # each TP-2 replica's leader starts its engine, whose Ray workers take half of each of the
    # replica's bundles: every rank asks for the other half; the leader is told its bundle and
    # keeps whole visibility (docs/gpu_engines.md, TensorRT-LLM placement)
    bundles = {"rollout replica 0 (rank 1)": "1", "rollout replica 1 (rank 3)": "0"}
    for a in plan.actors[1:]:
        host = {"POLYRL_PLACEMENT_BUNDLE": (bundles[a.name], "placement"),
                "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": ("1", "placement")
                } if a.name in bundles else {}
        assert env_of(a.env) == {**{k: v for k, v in rule.items() if k != "TLLM_DISABLE_NVLS_MNNVL"},
                                 **cumem,
                                 **EVERY, **host,
                                 **({"TLLM_DISABLE_NVLS_MNNVL": ("1", "user-env")} if opt_in else {})}
        assert a.resources["num_gpus"] == 0.5 and a.bundle_resources["num_gpus"] == 1
        assert (a.engine is not None) == bool(host) and a.hands is None
    # 5 devices on 4-GPU GB200 nodes: two nodes, and the plan says so; each TP-2 replica on one
    # node (replica 1 does not fit beside policy + replica 0, so it opens node 1)
    assert plan.devices_needed == 5 and plan.nodes_needed == 2
    assert any("needs 2 nodes" in n for n in plan.notes)
    assert [(a.devices.node, a.devices.ids) for a in plan.actors] == [
        (0, (0,)), (0, (1,)), (0, (2,)), (1, (0,)), (1, (1,))]


def test_gb200_trtllm_kv_cache_config_merged_key_by_key():
    cfg = job("rollout.placement=standalone", "rollout.backend=trtllm",
              "rollout.gpu_memory_utilization=0.7",
              "rollout.engine_kwargs={trtllm: {kv_cache_config: {enable_block_reuse: false}}}")
    args = plan_actors(cfg, machine("gb200"))[1].engine.args
    assert args["kv_cache_config"] == {"enable_block_reuse": False, "free_gpu_memory_fraction": 0.7}


def test_mi300x_rocm_standalone_sglang(monkeypatch):
    monkeypatch.setenv("SGLANG_USE_AITER", "0")  # the user's value is kept
    cfg = job("rollout.placement=standalone", "rollout.num_replicas=2", "rollout.backend=sglang")
    plan = plan_launch(cfg, machine("mi300x"), engine_version="0.5.12")
    zero = ("0", "platform-default")  # R3: job-level, ROCm only
    assert env_of(plan.job.env) == {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": zero,
                                    "NCCL_CUMEM_ENABLE": ("0", "rule:nccl-cumem-off"),  # every process (issue 39)
                                    **EVERY, "SGLANG_USE_AITER": ("0", "user-env")}
    original = {"SGLANG_RETURN_ORIGINAL_LOGPROB": ("1", "rule:sglang-original-logprobs")}
    assert env_of(plan.actors[0].env) == {**env_of(plan.job.env), **original}
    for a in plan.actors[1:]:
        assert a.resources == {"num_cpus": 1, "num_gpus": 1}
        assert env_of(a.env) == {
            "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": zero,
            "NCCL_CUMEM_ENABLE": ("0", "rule:nccl-cumem-off"),  # RCCL too (issue 15)
            "SGLANG_USE_AITER": ("0", "user-env"), **EVERY, **original}
        assert a.ray_options()["runtime_env"]["env_vars"]["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] == "0"
    if "sglang" in launch_args.BUILDERS:
        assert plan.actors[1].engine.args["attention_backend"] == "aiter"


def test_sglang_attention_backend_default_and_user_value():
    cfg = job("rollout.placement=standalone", "rollout.backend=sglang")
    new = plan_actors(cfg, machine("h100"), engine_version="0.5.12")[1]
    assert new.engine.args["attention_backend"] == "flashinfer"
    assert plan_actors(cfg, machine("h100"), engine_version="0.5.9")[1].engine.args[
        "attention_backend"] == "fa3"
    user = job("rollout.placement=standalone", "rollout.backend=sglang",
               "rollout.engine_kwargs={sglang: {attention_backend: triton}}")
    assert plan_actors(user, machine("mi300x"))[1].engine.args["attention_backend"] == "triton"


def test_ascend_npu_resource_and_visibility():
    hybrid = plan_actors(job(), machine("ascend910"))
    assert hybrid[0].resources == {"num_cpus": 1, "resources": {"NPU": 1}}
    assert env_of(hybrid[0].env) == EVERY
    cfg = job("rollout.placement=standalone", "rollout.num_replicas=2", "rollout.backend=vllm")
    plan = plan_launch(cfg, machine("ascend910"))
    for a in plan.actors[1:]:
        assert a.resources == {"num_cpus": 1, "resources": {"NPU": 1}}
        assert env_of(a.env) == EVERY
    assert plan.devices_needed == 3
    assert [a.devices.ids for a in plan.actors] == [(0,), (1,), (2,)]


def test_cpu_native_standalone_and_ray_init():
    cfg = job("rollout.placement=standalone", "rollout.num_replicas=2")
    plan = plan_launch(cfg, machine("cpu"))
    assert [a.resources for a in plan.actors] == [{"num_cpus": 1}] * 3
    malloc = {"MALLOC_MMAP_MAX_": ("0", "rule:cpu-malloc-keep-heap"),  # the CPU allocator rule
              "MALLOC_TRIM_THRESHOLD_": (str(16 * 2**30), "rule:cpu-malloc-keep-heap")}
    assert all(env_of(a.env) == {**EVERY, **malloc} for a in plan.actors)
    assert plan.actors[0].engine is None
    assert plan.actors[1].engine.args["max_model_len"] == 64
    assert plan.job.ray_init == {"num_cpus": max(os.cpu_count() or 1, 3), "namespace": "polyrl"}
    assert plan.devices_needed == 0 and plan.errors == []
    assert plan.placement is None and all(a.devices is None for a in plan.actors)
    remote = plan_launch(job("ray.address=auto", "ray.namespace=exp"), machine("cpu"))
    assert remote.job.ray_init == {"address": "auto", "namespace": "exp"}


def test_missing_builder_is_an_error_in_the_plan_not_a_crash(monkeypatch):
    monkeypatch.delitem(launch_args.BUILDERS, "trtllm", raising=False)
    cfg = job("rollout.placement=standalone", "rollout.num_replicas=2", "rollout.backend=trtllm")
    plan = plan_launch(cfg, machine("h100"))
    assert [a.engine.error for a in plan.actors[1:]] == [
        "rollout.backend=trtllm: no launch-argument builder; available: "
        + ", ".join(sorted(launch_args.BUILDERS))] * 2
    assert plan.errors[0].startswith("rollout replica 0 (rank 1): rollout.backend=trtllm: no "
                                     "launch-argument builder")
    assert plan.as_dict()["actors"][1]["engine"] == {"backend": "trtllm",
                                                     "error": plan.actors[1].engine.error}


# --- the plan is what a real launch uses ------------------------------------------------------


def test_plan_equals_a_real_standalone_launch(ray_session, tiny_model, monkeypatch, tmp_path):
    from polyrl.topology import TopologyContext, build_topology
    from polyrl.topology.run_plan import resolve

    ray = ray_session

    def what_the_actor_sees(worker, names):  # nested: cloudpickle ships it by value
        import ray
        import torch

        ctx = ray.get_runtime_context()
        engine = getattr(worker, "engine", None)
        engine = getattr(engine, "max_model_len", None) and engine
        return {"env": {n: os.environ.get(n) for n in names},
                "runtime_env_vars": dict((ctx.runtime_env or {}).get("env_vars") or {}),
                "resources": ctx.get_assigned_resources(), "threads": torch.get_num_threads(),
                "rank": worker.rank,
                "max_model_len": engine.max_model_len if engine is not None else None}

    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")  # forwarded user value (R1)
    cfg = job(f"model.path={tiny_model}", "rollout.placement=standalone", "rollout.num_replicas=2",
              "env={POLYRL_PLAN_CHECK: checked}", f"trainer.output_dir={tmp_path}", "ray.timeout_s=120")
    platform = get_platform("cpu")
    plan = plan_actors(cfg, platform)
    topology = build_topology(TopologyContext(resolve(cfg, None, platform), loader=None, score=None, timer=None))
    topology.start()
    policy, rollout = topology.policy, topology.rollout
    try:
        workers = policy.workers + rollout.workers
        assert policy.names + rollout.names == [a.name for a in plan]
        for actor, worker in zip(plan, workers):
            seen = ray.get(worker.__ray_call__.remote(what_the_actor_sees, list(actor.env.entries)),
                           timeout=120)
            planned = actor.env.values()
            assert planned["NCCL_CUMEM_ENABLE"] == "1" and planned["POLYRL_PLAN_CHECK"] == "checked"
            assert seen["env"] == planned, actor.name
            assert seen["runtime_env_vars"] == actor.ray_options()["runtime_env"]["env_vars"]
            assert seen["resources"] == {"CPU": float(actor.resources["num_cpus"])}
            assert seen["threads"] == actor.num_threads and seen["rank"] == actor.rank
            if actor.role == "rollout":
                assert seen["max_model_len"] == actor.engine.args["max_model_len"] == 64
    finally:
        topology.shutdown()


def test_async_replicas_stream_outside_the_group_and_weights_go_through_a_mailbox():
    cfg = job("trainer.mode=async", "rollout.placement=standalone", "rollout.num_replicas=2",
              "data.train_batch_size=16", "async.groups_per_request=4")
    actors = plan_actors(cfg, machine("h100"))
    assert [(a.name, a.role, a.rank, a.replica) for a in actors] == [
        ("policy rank 0", "policy", 0, None), ("rollout replica 0", "rollout", None, 0),
        ("rollout replica 1", "rollout", None, 1), ("weight mailbox", "mailbox", None, None)]
    replica = actors[1]
    assert replica.ray_options()["max_concurrency"] == 16 // 4 + 3  # requests + receive + health
    assert replica.resources == {"num_cpus": 1, "num_gpus": 1}
    assert env_of(replica.env)["NCCL_CUMEM_ENABLE"] == ("0", "rule:nccl-cumem-off")
    assert actors[3].resources == {"num_cpus": 0} and actors[3].max_concurrency == 64
    # synchronous standalone over the default collective broadcast: no mailbox, no concurrency
    sync = plan_actors(job("rollout.placement=standalone"), machine("h100"))
    assert [a.role for a in sync] == ["policy", "rollout"]
    assert "max_concurrency" not in sync[1].ray_options()


# --- devices: node and ids of every actor (issue 15) ------------------------------------------


def devices_of(plan) -> dict[str, tuple[int, tuple[int, ...]]]:
    return {a.name: (a.devices.node, a.devices.ids) for a in plan.actors if a.devices}


def test_async_tp_replica_is_one_actor_holding_its_tp_devices_on_one_node():
    cfg = job("trainer.mode=async", "rollout.placement=standalone", "rollout.num_replicas=3",
              "rollout.backend=vllm", "rollout.tensor_parallel_size=4", "actor.world_size=2")
    plan = plan_launch(cfg, machine("h100"), nodes=2)
    assert plan.actors[2].resources == {"num_cpus": 1, "num_gpus": 4}
    assert devices_of(plan) == {"policy rank 0": (0, (0,)), "policy rank 1": (0, (1,)),
                                "rollout replica 0": (0, (2, 3, 4, 5)),
                                "rollout replica 1": (1, (0, 1, 2, 3)),
                                "rollout replica 2": (1, (4, 5, 6, 7))}
    assert plan.errors == [] and plan.nodes_needed == 2
    assert plan.as_dict()["actors"][2]["devices"] == {"node": 0, "ids": [2, 3, 4, 5]}


def test_hybrid_tp_is_refused_by_the_plan_as_by_the_launch():
    """A hybrid engine runs on its trainer rank's one device: the dry run refuses tensor
    parallelism there with the launch's own words (rollout/launch_args.py's shared check)."""
    plan = plan_launch(job("actor.world_size=8", "rollout.backend=vllm", "rollout.tensor_parallel_size=4"),
                       machine("gb200"))
    assert plan.errors[0] == ("policy rank 0: rollout.tensor_parallel_size=4 with rollout.placement=colocated: "
                              "a colocated engine runs on its trainer rank's one device; use "
                              "rollout.placement=disaggregated for tensor parallelism")


def test_impossible_layouts_say_what_fits():
    tp8 = job("rollout.placement=standalone", "rollout.backend=vllm", "rollout.tensor_parallel_size=8")
    plan = plan_launch(tp8, machine("gb200"))
    assert plan.errors == ["placement: rollout replica 0 needs 8 devices on one node "
                           "(rollout.tensor_parallel_size=8), but a node has 4: set "
                           "rollout.tensor_parallel_size to at most 4 (a divisor of 4 packs nodes "
                           "fully)"]
    assert all(a.devices is None for a in plan.actors)
    big = job("rollout.placement=standalone", "rollout.num_replicas=4", "rollout.tensor_parallel_size=4",
              "rollout.backend=vllm", "actor.world_size=8")
    error = plan_launch(big, machine("h100"), nodes=2).errors[0]
    assert error.startswith("placement: the job needs 24 devices on 3 node(s) of 8 (8 policy rank x 1, "
                            "4 rollout replica x 4), but the cluster has 2 node(s), 16 devices: "
                            "use 3 nodes (--nodes 3")
    assert plan_launch(big, machine("h100"), nodes=3).errors == []
