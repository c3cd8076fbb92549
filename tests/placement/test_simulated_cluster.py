"""The actor -> device map on a simulated multi-node GPU cluster, as Ray really enforces it.

Ray's own multi-node test cluster (`ray.cluster_utils.Cluster`) runs two raylets on this machine,
each declaring 8 logical GPUs, 8 NPUs and an accelerator type. For a job (hybrid / standalone /
async x TP 1/2/4, on two nodes) the real launch plan (`plan_launch`) and the real placement code
(`create_placement`, `options_for`) start one probe actor per planned device-holding actor with
exactly the options a run uses; each probe records what Ray gave it: its node, the accelerator
ids Ray assigned, the visible-devices variable Ray set, the in-process device index the platform
derives from its reservation, and its environment. The probes stand in for the workers: this
checks placement only (real training tests keep the real engine).

Ray picks the accelerator manager of the "GPU" resource by probing the node: with no real GPU it
is NVIDIA's, so simulated ROCm actors see CUDA_VISIBLE_DEVICES, which ROCm honours too (on a real
AMD node Ray sets HIP_VISIBLE_DEVICES; `Platform.local_device_indices` reads whichever is set).
"""

from __future__ import annotations

import os

import pytest

from polyrl.config import load_config
from polyrl.envplan.plan import handoff_variable
from polyrl.envplan.rules import FORWARDED_PREFIXES
from polyrl.placement import create_placement, options_for
from polyrl.platform import SIMULATED_PROBES, get_platform
from polyrl.job import JobConfig
from polyrl.topology.launch_plan import plan_launch

HARDWARE = {"cuda": "h100", "rocm": "mi300x", "npu": "ascend910"}
VISIBLE = {"cuda": "CUDA_VISIBLE_DEVICES", "rocm": "CUDA_VISIBLE_DEVICES",
           "npu": "ASCEND_RT_VISIBLE_DEVICES"}
"""The variable Ray sets on this simulated cluster (see the module docstring for ROCm)."""
RAY_RESOURCE = {"cuda": "GPU", "rocm": "GPU", "npu": "NPU"}


@pytest.fixture(scope="module")
def cluster():
    """Two raylets of 8 logical GPUs and 8 NPUs each, on this machine. A session-wide local
    Ray instance (tests/conftest.py) is shut down for this module and restarted after it."""
    import ray
    from ray.cluster_utils import Cluster

    was_up = ray.is_initialized()
    if was_up:
        ray.shutdown()
    # logical CPUs: every probe reserves the CPU its plan gives it (1). The raylets use Ray's
    # default address on this machine: with node_ip_address=127.0.0.1 the driver could not reach
    # the GCS here ("Timed out while waiting for GCS to become available").
    node = {"num_cpus": 16, "num_gpus": 8, "resources": {"NPU": 8, "accelerator_type:H100": 1}}
    c = Cluster(initialize_head=True, head_node_args=node)
    c.add_node(**node)
    c.wait_for_nodes()
    ray.init(address=c.address, namespace="polyrl-placement", log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()
    if was_up:  # the same arguments as tests/conftest.py:ray_session
        ray.init(num_cpus=4, include_dashboard=False, namespace="polyrl-tests",
                 configure_logging=False, log_to_driver=False)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith(FORWARDED_PREFIXES):
            monkeypatch.delenv(name)


def job(layout: str, tp: int, nodes: int, *extra: str) -> JobConfig:
    """A job that fills `nodes` nodes: hybrid = TP-grouped policy ranks; standalone / async = 1
    policy rank + replicas, with one replica more than fits on the first node when nodes=2."""
    overrides = ["actor.num_cpus_per_worker=1", "rollout.max_model_len=64", "rollout.backend=vllm",
                 f"rollout.tensor_parallel_size={tp}", *extra]
    if layout == "hybrid":  # two nodes: one TP group more than the first node holds
        world = 8 + tp if nodes == 2 else 2 * tp
        overrides += [f"actor.world_size={world}", f"data.train_batch_size={world * 2}"]
    else:
        fits = (8 - 1) // tp  # replicas beside the policy rank on one node
        replicas = min(2, fits) if nodes == 1 else fits + 1
        overrides += ["rollout.placement=standalone", f"rollout.num_replicas={replicas}"]
        if layout == "async":
            overrides += ["trainer.mode=async"]
    return load_config(JobConfig, overrides=overrides)


def probe_actor():
    import ray

    @ray.remote(num_cpus=0)
    class Probe:
        def __init__(self, platform_name: str, hw: str):
            from polyrl.platform import SIMULATED_PROBES, get_platform

            self.platform = get_platform(platform_name, SIMULATED_PROBES[hw])

        def record(self, env_names: list[str]) -> dict:
            ctx = ray.get_runtime_context()
            return {"node": ctx.get_node_id(),
                    "assigned": ctx.get_accelerator_ids()[self.platform.ray_resource],
                    "visible": {v: os.environ.get(v) for v in self.platform.visible_devices_vars},
                    "index": self.platform.reserved_devices(),
                    "env": {n: os.environ.get(n) for n in env_names},
                    "noset": sorted(k for k in os.environ if k.startswith("RAY_EXPERIMENTAL_NOSET_"))}

    return Probe


def run_probes(platform_name: str, cfg: JobConfig, nodes: int) -> tuple[object, object, dict]:
    import ray

    platform = get_platform(platform_name, SIMULATED_PROBES[HARDWARE[platform_name]])
    plan = plan_launch(cfg, platform, "0.11.0", nodes=nodes)
    assert plan.errors == [], plan.errors
    actors = [a for a in plan.actors if a.devices is not None]
    live = create_placement(plan.placement, actors, timeout_s=60)
    try:
        options = options_for(live, actors)
        Probe = probe_actor()
        handles = {a.name: Probe.options(**options[a.name]).remote(platform_name, HARDWARE[platform_name])
                   for a in actors}
        seen = dict(zip(handles, ray.get([h.record.remote(list(a.env.entries))
                                          for h, a in zip(handles.values(), actors)], timeout=300)))
        for h in handles.values():
            ray.kill(h)
    finally:
        live.remove()
    return plan, live, seen


def check_map(platform_name: str, plan, live, seen: dict) -> None:
    """Every probe sits on its planned node, holds exactly its planned ids, sees exactly them, and
    computes on its own device. A TP-k standalone replica's engine host (its leader) asks Ray for
    no device, keeps Ray off its visibility (NOSET) and sees exactly its replica's k ids; no
    device is seen by two replicas, or by a replica and a policy rank."""
    assert len(set(live.node_ids)) == len(live.node_ids), "two planned nodes on one Ray node"
    var = VISIBLE[platform_name]
    handoff = handoff_variable(get_platform(platform_name, SIMULATED_PROBES[HARDWARE[platform_name]]))
    owners: dict[tuple[str, str], str] = {}
    for actor in (a for a in plan.actors if a.devices is not None):
        got, ids = seen[actor.name], [str(i) for i in actor.devices.ids]
        assert got["node"] == live.node_ids[actor.devices.node], actor.name
        assert got["env"] == actor.env.values(), actor.name
        if actor.hands is not None:  # the engine host
            replica = [a for a in plan.actors if a.replica == actor.replica and a.devices]
            assert list(actor.hands) == [i for a in replica for i in a.devices.ids], actor.name
            assert got["assigned"] == [] and got["index"] == [], actor.name
            assert got["visible"][handoff] == ",".join(map(str, actor.hands)), actor.name
            assert got["noset"], actor.name
            sees = got["visible"][handoff].split(",")
        else:
            assert got["assigned"] == ids, actor.name
            assert got["visible"][var] == ",".join(ids), actor.name
            assert got["index"] == list(range(len(ids))), actor.name
            assert got["noset"] == [], actor.name  # Ray's visibility, never NOSET (issue 15)
            sees = got["assigned"]
        owner = f"replica {actor.replica}" if actor.role == "rollout" else actor.name
        for i in sees:
            assert owners.setdefault((got["node"], i), owner) == owner, (actor.name, i, owners)


LAYOUTS = [("hybrid", 1), ("standalone", 1), ("standalone", 4), ("async", 4)]
"""Each on two nodes: the first node of a two-node job starts with every device-holding actor of
the one-node job (same names, devices, Ray options, environment, in bundle order; `job`), so the
two-node case checks all the one-node case would, plus a second placement group on the other
raylet. One case per placement shape: hybrid (a policy rank holds its engine), a TP-1 replica
(holds its own device), a TP-k replica (its leader hosts the engine, NOSET), async (replicas
outside the training placement group); standalone TP 2 is written out in
test_standalone_tp2_two_nodes_exact_map. Async TP 1 / 2 replicas are planned as TP 4's are
(tests/trainer/test_launch_plan.py, the async plans), so they are not started here again: each
started case costs ~15-30 s of CI."""
FAST = {("async", 4)}
"""Unmarked: each case starts its probes (~15 s on 2 cores); the rest are @slow."""


@pytest.mark.parametrize("layout,tp", [
    pytest.param(*case, marks=() if case in FAST else pytest.mark.slow) for case in LAYOUTS])
def test_cuda_actor_device_map(cluster, layout, tp):
    plan, live, seen = run_probes("cuda", job(layout, tp, 2), 2)
    check_map("cuda", plan, live, seen)
    assert plan.nodes_needed == 2


def test_standalone_tp2_two_nodes_exact_map(cluster):
    """Written out once: 1 policy rank + 4 TP-2 replicas on two 8-GPU nodes. Each replica's
    leader hosts its TP-2 engine and sees both devices of its replica; its other rank holds the
    second device (where it receives each weight version)."""
    plan, live, seen = run_probes("cuda", job("standalone", 2, 2), 2)
    check_map("cuda", plan, live, seen)
    assert plan.nodes_needed == 2
    where = {name: (live.node_ids.index(s["node"]), s["visible"]["CUDA_VISIBLE_DEVICES"],
                    s["assigned"]) for name, s in seen.items()}
    assert where == {"policy rank 0": (0, "0", ["0"]),
                     "rollout replica 0 (rank 1)": (0, "1,2", []), "rollout replica 0 (rank 2)": (0, "2", ["2"]),
                     "rollout replica 1 (rank 3)": (0, "3,4", []), "rollout replica 1 (rank 4)": (0, "4", ["4"]),
                     "rollout replica 2 (rank 5)": (0, "5,6", []), "rollout replica 2 (rank 6)": (0, "6", ["6"]),
                     "rollout replica 3 (rank 7)": (1, "0,1", []), "rollout replica 3 (rank 8)": (1, "1", ["1"])}


@pytest.mark.parametrize("platform_name,layout,tp", [
    # ROCm and NPU differ from CUDA in the visibility variable and (NPU) a custom Ray resource,
    # not in the layout logic the CUDA cases above cover: one started case each, a TP-2 replica
    # leader on ROCm and an async NPU job whose custom resource also holds a reward worker
    ("npu", "async", 4), pytest.param("rocm", "standalone", 2, marks=pytest.mark.slow)])
def test_rocm_and_npu_actor_device_map(cluster, platform_name, layout, tp):
    # the NPU async case also runs a reward-model worker on a device of its own (issue 21)
    reward = (["reward.model.path=/models/rm", "reward.model.num_devices=1"]
              if (platform_name, layout) == ("npu", "async") else [])
    plan, live, seen = run_probes(platform_name, job(layout, tp, 2, *reward), 2)
    check_map(platform_name, plan, live, seen)
    if reward:
        assert plan.actors[-1].name == "reward model worker" and plan.actors[-1].devices.ids == (5,)
    if platform_name == "npu":
        assert all(a.bundle_resources.get("resources", {}).get("NPU") for a in plan.actors if a.devices)


def test_gpu_check_probe_module_agrees_and_names_a_misplaced_actor(cluster):
    """The check of `polyrl placement` (polyrl/placement/probe.py; scripts/gpu_check.sh runs it on
    a GPU machine) on the simulated cluster: every actor PASSes; a plan whose ids are shifted is
    reported per actor."""
    import dataclasses

    from polyrl.placement import Devices
    from polyrl.placement.probe import probe_plan, problems

    platform = get_platform("cuda", SIMULATED_PROBES["h100"])
    plan = plan_launch(job("standalone", 2, 1), platform, "0.11.0", nodes=1)
    node_ids, seen = probe_plan(plan, timeout_s=120)
    assert all(bad == [] for bad in problems(plan, node_ids, seen).values())
    # the launch plan is frozen (a tuple of actors): the misplaced plans are new plans
    def with_actor(index, actor):
        actors = plan.actors[:index] + (actor,) + plan.actors[index + 1:]
        return dataclasses.replace(plan, actors=actors)

    wrong = dataclasses.replace(plan.actors[2], devices=Devices(0, (5,)))
    assert problems(with_actor(2, wrong), node_ids, seen)[wrong.name] == [
        "Ray assigned ids ['2'], planned ['5']", "sees devices '2', planned '5'"]
    host = dataclasses.replace(plan.actors[1], hands=(5, 6))  # replica 0's engine host
    assert problems(with_actor(1, host), node_ids, seen)[host.name] == ["sees devices '1,2', planned '5,6'"]
