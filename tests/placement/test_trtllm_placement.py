"""TensorRT-LLM inside polyrl's placement groups (issue 28, fix 4).

TRT-LLM's Ray orchestrator starts one Ray worker per TP rank itself, asking Ray for
`per_worker_gpu_share` of a device in the bundles it is given (`placement_groups`,
`placement_bundle_indices`; polyrl/rollout/engines/trtllm.py:placement builds them from the
bundle polyrl names in POLYRL_PLACEMENT_BUNDLE). Its worker class names only `num_gpus`, so Ray
also reserves one CPU for it. Each of those bundles also holds the polyrl actor of that device,
so the two must share it: the actor asks Ray for `1 - share` while its bundle keeps the whole
device and one CPU more than the actor's (polyrl/topology/launch_plan.py:beside_engine_worker),
and an engine host (TP > 1) asks for no device.

Before the fix each such actor asked for its bundle's whole device and all its CPUs: a worker
asking for 0.5 device and 1 CPU more never fits the bundle, and Ray leaves it pending forever
(TRT-LLM's start hangs). The plan tests pin the split that makes it fit (asks + worker <= bundle,
and the whole bundle for every other engine); the live test starts, on Ray's simulated two-node cluster, the
planned actors with the options a run uses and, inside each engine-starting actor, the workers
exactly as TRT-LLM does from the real `trtllm.placement()`: they are scheduled, in the actor's
own placement group, on the device of the polyrl actor of their bundle.
"""

from __future__ import annotations

import os

import pytest

from polyrl.envplan.rules import PLACEMENT_BUNDLE_VAR
from polyrl.placement import create_placement, options_for
from polyrl.platform import SIMULATED_PROBES, get_platform
from polyrl.rollout.launch_args import TRTLLM_WORKER_GPU_SHARE
from polyrl.topology.launch_plan import TRTLLM_WORKER_CPUS, plan_launch

from test_simulated_cluster import clean_env, cluster, job  # noqa: F401 - fixtures, job()

H100 = get_platform("cuda", SIMULATED_PROBES["h100"])
TRT_VERSION = "1.2.0"


def trtllm_job(layout: str, tp: int, nodes: int, backend: str = "trtllm"):
    return job(layout, tp, nodes, f"rollout.backend={backend}")


def planned(layout: str, tp: int, nodes: int, backend: str = "trtllm"):
    plan = plan_launch(trtllm_job(layout, tp, nodes, backend), H100, TRT_VERSION, nodes=nodes)
    assert plan.errors == [], plan.errors
    return plan


def starts_beside_worker(actor, tp: int) -> bool:
    """Whether a TRT-LLM worker shares this actor's device: it starts the engine (hybrid policy
    rank, standalone tp=1 replica) or is a TP rank whose device the engine host's engine uses."""
    return actor.engine is not None or (actor.role == "rollout" and tp > 1)


@pytest.mark.parametrize("layout,tp,nodes", [("hybrid", 1, 1), ("standalone", 1, 1),
                                             ("standalone", 2, 2), ("standalone", 4, 2)])
def test_actors_sharing_a_device_with_a_trtllm_worker_leave_it_its_share(layout, tp, nodes):
    plan = planned(layout, tp, nodes)
    other = planned(layout, tp, nodes, backend="vllm")  # the same layout, an engine in-process
    share, cpus = TRTLLM_WORKER_GPU_SHARE, TRTLLM_WORKER_CPUS
    for actor, same in zip(plan.actors, other.actors):
        assert actor.name == same.name and actor.devices == same.devices
        bundle, whole = actor.bundle_resources, same.bundle_resources
        assert bundle["num_gpus"] == whole["num_gpus"] == 1  # the same whole devices reserved
        if not starts_beside_worker(actor, tp):  # a standalone policy rank: as before
            assert actor.role == "policy" and actor.resources == same.resources == bundle == whole
            continue
        # no engine host: TRT-LLM's TP workers take their devices from the replica's bundles
        assert actor.hands is None and actor.resources == {"num_cpus": 1, "num_gpus": 1 - share}
        assert bundle == {"num_cpus": 1 + cpus, "num_gpus": 1}, actor.name
        # the worker fits its bundle beside the actor; the whole bundle (as every other
        # engine's actor asks, and as these did before the fix) leaves it no room
        for key, need in (("num_gpus", share), ("num_cpus", cpus)):
            assert actor.resources[key] + need <= bundle[key], (actor.name, key)
        if same.hands is None:
            assert same.resources["num_gpus"] + share > whole["num_gpus"]
        assert same.resources["num_cpus"] + cpus > whole["num_cpus"]
    # the devices reserved are unchanged: the split is inside each bundle
    assert plan.devices_needed == other.devices_needed


def test_the_worker_cpu_is_rays_default_for_an_actor_naming_only_gpus():
    """TRT-LLM's RayWorkerWrapper is `@ray.remote` with `.options(num_gpus=share)` only."""
    from ray._private import ray_constants

    assert TRTLLM_WORKER_CPUS == ray_constants.DEFAULT_ACTOR_CREATION_CPU_SPECIFIED


def test_engine_starting_actors_are_told_their_planned_bundle():
    """1 policy rank + 4 TP-2 replicas on two 8-GPU nodes: a node's bundles follow its device
    order, so replica 0's engine starter has bundle 1 (after policy rank 0) and replica 3's, the
    first actor of node 1, bundle 0. Only the engine starters get the variable; vLLM gets none."""
    plan = planned("standalone", 2, 2)
    bundles = {a.name: a.env.values().get(PLACEMENT_BUNDLE_VAR) for a in plan.actors}
    assert {n: b for n, b in bundles.items() if b is not None} == {
        "rollout replica 0 (rank 1)": "1", "rollout replica 1 (rank 3)": "3",
        "rollout replica 2 (rank 5)": "5", "rollout replica 3 (rank 7)": "0"}
    leader = plan.actors[1]
    assert leader.env[PLACEMENT_BUNDLE_VAR].source == "placement"
    assert leader.as_dict()["env"][PLACEMENT_BUNDLE_VAR]["value"] == "1"  # what --dry-run --json shows
    # the engine-starting actors keep whole visibility (their workers inherit it); the rest
    # keep Ray's narrowing (issue 15)
    noset = {a.name for a in plan.actors if any(k.startswith("RAY_EXPERIMENTAL_NOSET_") for k in a.env.entries)}
    assert noset == {n for n, b in bundles.items() if b is not None}
    assert "CUDA_VISIBLE_DEVICES" not in leader.env  # no devices handed: Ray's bundles decide
    hybrid = planned("hybrid", 1, 1)
    assert [a.env.values().get(PLACEMENT_BUNDLE_VAR) for a in hybrid.actors if a.role == "policy"] \
        == ["0", "1"]
    assert not any(PLACEMENT_BUNDLE_VAR in a.env for a in planned("standalone", 2, 2, "vllm").actors)


def placement_entries(actor) -> dict[str, str]:
    """The variables the placement decides (bundle, NOSET), as the dry run shows them."""
    return {k: e.value for k, e in actor.env.entries.items() if e.source == "placement"}


def test_async_replicas_get_the_trtllm_placement_of_sync_ones():
    """An async TP-1 replica starts TRT-LLM in its actor like a sync standalone TP-1 replica, so it
    needs the same placement: it asks Ray for 1 - share of its device, its bundle keeps the whole
    device plus the worker's CPU, and it is told its bundle (with whole visibility). Before the
    fix it asked for the whole device and all its bundle's CPUs with no bundle variable: TRT-LLM's
    worker could never be scheduled (the hang of fix 4, in async mode)."""
    from polyrl.topology.launch_plan import engine_worker_cpus, plan_job

    sync, asynchronous = planned("standalone", 1, 1), planned("async", 1, 1)
    by_replica = {a.replica: a for a in sync.actors if a.role == "rollout"}
    replicas = [a for a in asynchronous.actors if a.role == "rollout"]
    assert len(replicas) == len(by_replica) == 2
    for a in replicas:
        s = by_replica[a.replica]
        assert a.devices == s.devices, a.name
        assert a.resources == s.resources == {"num_cpus": 1, "num_gpus": 1 - TRTLLM_WORKER_GPU_SHARE}
        assert a.bundle_resources == s.bundle_resources == {"num_cpus": 1 + TRTLLM_WORKER_CPUS, "num_gpus": 1}
        assert placement_entries(a) == placement_entries(s) == {
            PLACEMENT_BUNDLE_VAR: str(a.devices.ids[0]), "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
    # a local Ray instance holds the workers' CPUs in async mode too
    cfg = trtllm_job("async", 1, 1)
    assert engine_worker_cpus(cfg, H100) == cfg.rollout.num_replicas * TRTLLM_WORKER_CPUS
    assert plan_job(cfg, H100).ray_init.get("num_cpus", 0) >= engine_worker_cpus(cfg, H100)


def test_the_async_dry_run_shows_the_trtllm_shares_and_bundles(capsys):
    """`polyrl train --dry-run --json --platform h100 rollout.backend=trtllm
    rollout.placement=standalone trainer.mode=async` (in-process: polyrl.cli.main.main, the function
    `python -m polyrl` exits with): the async replicas show what the sync ones do."""
    import json

    from polyrl.cli.main import main

    args = ["train", "--dry-run", "--json", "--platform", "h100", "--engine-version", TRT_VERSION,
            "rollout.backend=trtllm", "rollout.placement=standalone", "rollout.num_replicas=2",
            "rollout.max_model_len=64", "actor.num_cpus_per_worker=1"]
    shown = {}
    for mode in ("sync", "async"):
        assert main([*args, f"trainer.mode={mode}"]) == 0
        actors = json.loads(capsys.readouterr().out)["actors"]
        shown[mode] = [(a["replica"], a["resources"], a["env"].get(PLACEMENT_BUNDLE_VAR, {}).get("value"))
                       for a in actors if a["role"] == "rollout"]
    assert shown["async"] == shown["sync"] == [(0, {"num_cpus": 1, "num_gpus": 0.5}, "1"),
                                               (1, {"num_cpus": 1, "num_gpus": 0.5}, "2")]


def test_async_trtllm_tensor_parallel_replicas_are_refused_with_the_fix():
    """An async replica is one actor holding its k devices in one bundle; TensorRT-LLM puts one
    worker per device into k bundles starting at the replica's own, i.e. into the next replicas'
    bundles. The dry run (and pre-flight / the launch, which read the same placement error) must
    refuse it with the settings that work, not plan it."""
    plan = plan_launch(trtllm_job("async", 2, 1), H100, TRT_VERSION, nodes=1)
    assert plan.errors == ["placement: rollout.tensor_parallel_size=2 with trainer.mode=async and "
                           "rollout.backend=trtllm: an async replica is one actor holding its 2 "
                           "devices in one bundle, and TensorRT-LLM places one Ray worker per device "
                           "in bundles of their own; set rollout.tensor_parallel_size=1 (more "
                           "replicas) or trainer.mode=sync"]


def engine_probe():
    """A stand-in for a polyrl actor (policy rank or rollout rank) that, when it starts the
    engine, starts TRT-LLM's workers as TRT-LLM's Ray executor does (tensorrt_llm/executor/
    ray_executor.py `create_workers`, ray_gpu_worker.py `RayWorkerWrapper`): one `@ray.remote`
    actor per TP rank with `.options(num_gpus=per_worker_gpu_share, runtime_env={"env_vars":
    <a copy of this process's environment>}, scheduling_strategy=<placement_groups[0], bundle
    placement_bundle_indices[0][rank]>)`, from the real `trtllm.placement()` called in this
    actor. Each worker reports the physical device TRT-LLM's wrapper would compute on:
    `ray.get_gpu_ids()[0]`, mapped to a local index through CUDA_VISIBLE_DEVICES
    (`physical_to_local_id`), which is the physical id listed there."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0)
    class Probe:
        def record(self, env_names: list[str], tp: int | None, share: float) -> dict:
            from polyrl.rollout.engines import trtllm

            from polyrl.platform import SIMULATED_PROBES, get_platform

            ctx = ray.get_runtime_context()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            index = get_platform("cuda", SIMULATED_PROBES["h100"]).reserved_devices()
            seen = {"node": ctx.get_node_id(), "assigned": ctx.get_accelerator_ids()["GPU"],
                    "env": {n: os.environ.get(n) for n in env_names},
                    # the physical device the actor computes on (policy.py / rollout_worker.py:
                    # Platform.reserved_device), through whatever visibility it has
                    "device": [visible.split(",")[i] if visible else str(i) for i in index]}
            if tp is None:
                return seen
            args = trtllm.placement(tp)
            group = args["placement_groups"][0]
            seen["group"] = group.id.hex()
            seen["bundle_indices"] = args["placement_bundle_indices"]

            @ray.remote
            class Worker:
                def where(self) -> dict:
                    gpu = str(ray.get_gpu_ids()[0])
                    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
                    ids = visible.split(",") if visible else None
                    # physical_to_local_id, then the physical device that local index is
                    device = ids[ids.index(gpu)] if ids and gpu in ids else gpu
                    return {"node": ray.get_runtime_context().get_node_id(), "device": device}

            env = {"env_vars": {**os.environ, "TLLM_DISABLE_MPI": "1"}}
            workers = [Worker.options(num_gpus=share, runtime_env=env,
                                      scheduling_strategy=PlacementGroupSchedulingStrategy(
                                          group, placement_group_bundle_index=b)).remote()
                       for b in seen["bundle_indices"][0]]
            try:  # a worker that cannot fit its bundle stays pending: the timeout fails the test
                seen["workers"] = ray.get([w.where.remote() for w in workers], timeout=120)
            finally:
                for w in workers:
                    ray.kill(w)
            return seen

    return Probe


def run_engine_probes(layout: str, tp: int, nodes: int):
    """Start the plan's device-holding actors with a run's options, and the TRT-LLM workers
    inside each engine-starting one; assert what holds for every layout; return
    (plan, actor name -> what it saw, (node, bundle) -> actor name)."""
    import ray

    plan = planned(layout, tp, nodes)
    actors = [a for a in plan.actors if a.devices is not None]
    live = create_placement(plan.placement, actors, timeout_s=60)
    try:
        options = options_for(live, actors)
        Probe = engine_probe()
        handles = [Probe.options(**options[a.name]).remote() for a in actors]
        seen = dict(zip([a.name for a in actors], ray.get(
            [h.record.remote(list(a.env.entries), tp if a.engine else None, TRTLLM_WORKER_GPU_SHARE)
             for h, a in zip(handles, actors)], timeout=300)))
        for h in handles:
            ray.kill(h)
        groups = [g.id.hex() for g in live.groups]
    finally:
        live.remove()
    engines = 0
    for actor in actors:
        got, (node, index) = seen[actor.name], live.bundles[actor.name]
        assert got["env"] == actor.env.values(), actor.name  # the plan the dry run shows is what runs
        assert got["node"] == live.node_ids[node], actor.name
        # it holds a share (or the whole) of its planned device, and computes on it
        assert got["assigned"] == got["device"] == [str(i) for i in actor.devices.ids], actor.name
        if actor.engine is None:
            assert PLACEMENT_BUNDLE_VAR not in got["env"]
            continue
        engines += 1
        assert got["env"][PLACEMENT_BUNDLE_VAR] == str(index), actor.name
        assert got["group"] == groups[node], actor.name  # its own group, ...
        assert got["bundle_indices"] == [list(range(index, index + tp))], actor.name  # ... its replica's bundles
        assert len(got["workers"]) == tp and all(w["node"] == got["node"] for w in got["workers"])
    assert engines == (len([a for a in actors if a.role == "policy"]) if layout == "hybrid"
                       else plan.actors[-1].replica + 1)
    return plan, seen, {where: name for name, where in live.bundles.items()}


def wrong_devices(plan, seen: dict, in_bundle: dict) -> list[tuple[str, str, str]]:
    """(engine actor, device a worker computes on, device of its bundle's polyrl actor) for
    every worker not on its bundle's device."""
    by_name = {a.name: a for a in plan.actors}
    out = []
    for name, got in seen.items():
        node = by_name[name].devices.node
        for bundle, worker in zip(got.get("bundle_indices", [[]])[0], got.get("workers", [])):
            beside = by_name[in_bundle[(node, bundle)]]
            if worker["device"] != str(beside.devices.ids[0]):
                out.append((name, worker["device"], str(beside.devices.ids[0])))
    return out


@pytest.mark.slow  # a simulated multi-node Ray cluster, as tests/placement/test_simulated_cluster.py
@pytest.mark.parametrize("layout,tp,nodes", [("hybrid", 1, 1), ("standalone", 2, 2)])
# started on the simulated cluster (~15-30 s each): a policy rank that starts its engine, and TP-2
# replicas across two nodes (the one-node TP-2 and the TP-1 layouts place their workers by the
# same bundle rule, checked without starting anything by the plan tests above)
def test_trtllm_workers_schedule_on_the_device_of_the_polyrl_actor_beside_them(cluster, layout, tp, nodes):
    """standalone-2-2: 1 policy rank + 4 TP-2 replicas on two nodes (replica 3 opens node 1, at
    bundle 0); each replica's leader starts the engine, whose two workers land at its bundle and
    the next (its other rank's)."""
    plan, seen, in_bundle = run_engine_probes(layout, tp, nodes)
    assert wrong_devices(plan, seen, in_bundle) == []
    # and it is the device Ray gave the polyrl actor of that bundle
    by_bundle = {a.name: a for a in plan.actors}
    for name, got in seen.items():
        node = by_bundle[name].devices.node
        for bundle, worker in zip(got.get("bundle_indices", [[]])[0], got.get("workers", [])):
            assert [worker["device"]] == seen[in_bundle[(node, bundle)]]["assigned"], (name, bundle)


def test_the_dry_run_shows_the_shares_and_the_bundles():
    """`polyrl train --dry-run --json --platform h100 rollout.backend=trtllm`: what a user sees
    before a run (the CLI in a subprocess, no Ray started)."""
    import json
    import subprocess
    import sys

    from polyrl.envplan.rules import FORWARDED_PREFIXES

    env = {k: v for k, v in os.environ.items() if not k.startswith(FORWARDED_PREFIXES)}
    out = subprocess.run(
        [sys.executable, "-m", "polyrl", "train", "--dry-run", "--json", "--platform", "h100",
         "--engine-version", TRT_VERSION, "rollout.backend=trtllm", "rollout.placement=standalone",
         "rollout.num_replicas=2", "rollout.tensor_parallel_size=2", "rollout.max_model_len=64",
         "actor.num_cpus_per_worker=1"],
        capture_output=True, text=True, env={**env, "RAY_ADDRESS": "127.0.0.1:1"}, timeout=120)
    assert out.returncode == 0, out.stderr
    actors = {a["name"]: a for a in json.loads(out.stdout)["actors"]}
    shown = {name: (a["resources"]["num_gpus"], a["env"].get(PLACEMENT_BUNDLE_VAR, {}).get("value"))
             for name, a in actors.items()}
    assert shown == {"policy rank 0": (1, None),
                     "rollout replica 0 (rank 1)": (0.5, "1"), "rollout replica 0 (rank 2)": (0.5, None),
                     "rollout replica 1 (rank 3)": (0.5, "3"), "rollout replica 1 (rank 4)": (0.5, None)}


def test_a_local_ray_instance_holds_the_workers_cpus(monkeypatch):
    """plan_job sizes a local Ray for the ranks and for TRT-LLM's workers' CPUs (one per device
    of a hybrid rank): without them its placement groups cannot be reserved on a small machine."""
    from polyrl.job import JobConfig
    from polyrl.platform import SIMULATED_PROBES, get_platform
    from polyrl.topology.launch_plan import plan_job
    from polyrl.topology.resources import cpus_needed

    import os

    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a local instance, not a cluster to join
    h100 = get_platform(None, SIMULATED_PROBES["h100"])
    cfg = JobConfig.model_validate({"rollout": {"backend": "trtllm"}, "ray": {"address": None},
                                    "actor": {"world_size": 8, "num_cpus_per_worker": 16}})
    _, ranks = cpus_needed(cfg)
    assert plan_job(cfg, h100).ray_init["num_cpus"] == max(ranks + 8, os.cpu_count() or 1)
    vllm = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"backend": "vllm"})})
    assert plan_job(vllm, h100).ray_init["num_cpus"] == max(ranks, os.cpu_count() or 1)


def starters_of(plan) -> set[str]:
    """The actors whose plan names their bundle: they start a TRT-LLM engine beside its workers."""
    return {a.name for a in plan.actors if PLACEMENT_BUNDLE_VAR in a.env}


@pytest.mark.slow  # a simulated multi-node Ray cluster
@pytest.mark.parametrize("layout,tp,nodes", [
    ("hybrid", 1, 1), ("standalone", 2, 2),
    ("async", 1, 1)])
def test_the_placement_probe_passes_trtllm_engine_starters(cluster, layout, tp, nodes):
    """`polyrl placement` (polyrl/placement/probe.py; scripts/gpu_check.sh runs it) on TRT-LLM
    jobs: each engine starter holds its share of its device, keeps the whole node visible as its
    plan's NOSET says, reads its device by physical id, and the stand-ins of its engine's workers
    land on the devices of their bundles' actors. Before, every starter FAILed ("sees devices
    None, planned '1'", "device index [1], expected [0]", "has RAY_EXPERIMENTAL_NOSET_... although
    it reserves devices"). standalone-2-2: replica 3's engine starts bundle 0 of node 1."""
    import copy

    from polyrl.placement.probe import probe_plan, problems

    plan = planned(layout, tp, nodes)
    node_ids, seen = probe_plan(plan, timeout_s=120)
    assert problems(plan, node_ids, seen) == {a.name: [] for a in plan.actors if a.devices}
    starters, noset = starters_of(plan), "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
    assert starters and {n for n, s in seen.items() if "workers" in s} == starters
    by_name = {a.name: a for a in plan.actors}
    owner = {(by_name[n].devices.node, s["bundle"]): n for n, s in seen.items()}
    for name in starters:
        got, node = seen[name], by_name[name].devices.node
        assert got["holds"] == 1 - TRTLLM_WORKER_GPU_SHARE and got["noset"] == [noset], name
        assert got["visible"]["CUDA_VISIBLE_DEVICES"] is None, name  # Ray left it whole
        assert got["index"] == [int(i) for i in got["assigned"]], name  # by physical id
        assert [w["bundle"] for w in got["workers"]] == list(range(got["bundle"], got["bundle"] + tp))
        for w in got["workers"]:  # each on the device of the polyrl actor of its bundle
            assert w["node"] == got["node"] and w["assigned"] == seen[owner[(node, w["bundle"])]]["assigned"]
    # had Ray narrowed a starter's visibility (its NOSET lost), the probe would say so, and with
    # TP > 1 that its engine's other devices are hidden from the workers inheriting it
    name = min(starters, key=lambda n: seen[n]["bundle"])
    narrowed = copy.deepcopy(seen)
    narrowed[name].update(visible={"CUDA_VISIBLE_DEVICES": seen[name]["assigned"][0]}, index=[0], noset=[])
    bad = problems(plan, node_ids, narrowed)[name]
    assert bad[0] == (f"has no RAY_EXPERIMENTAL_NOSET_*, its plan says ['{noset}']: Ray narrows the "
                      "visibility its engine's workers inherit")
    hidden = [w["assigned"][0] for w in seen[name]["workers"][1:]]
    assert bad[1:] == ([f"sees devices {seen[name]['assigned'][0]!r}: devices {','.join(hidden)} of "
                        "its engine are hidden (planned: the node's whole visibility)"] if hidden else [])


@pytest.mark.slow  # a simulated multi-node Ray cluster
def test_the_placement_probe_names_a_trtllm_worker_with_no_room_in_its_bundle(cluster):
    """The plan before fix 4: each engine starter asked Ray for its whole bundle, so TRT-LLM's
    worker (0.5 of the device and a CPU) could never be scheduled there and the engine's start
    hung. The probe names the bundle instead of hanging: its stand-in worker is still pending at
    the deadline (it can never be scheduled, so the deadline only bounds the wait)."""
    import dataclasses

    from polyrl.placement.probe import probe_plan, problems

    plan = planned("standalone", 1, 1)
    plan = dataclasses.replace(plan, actors=tuple(dataclasses.replace(a, resources=dict(a.bundle_resources))
                                                  if a.bundle else a for a in plan.actors))
    node_ids, seen = probe_plan(plan, timeout_s=120, worker_timeout_s=5)
    starters = starters_of(plan)
    assert problems(plan, node_ids, seen) == {
        a.name: [f"its engine's worker for bundle {seen[a.name]['bundle']} was never scheduled: the "
                 "bundle has no room for it beside its polyrl actor (TRT-LLM's start hangs)"]
        if a.name in starters else [] for a in plan.actors if a.devices}
    assert len(starters) == 2


@pytest.mark.slow  # a simulated multi-node Ray cluster, and a CLI subprocess
def test_polyrl_placement_checks_a_trtllm_job_on_the_cluster(cluster):
    """The command scripts/gpu_check.sh runs, as a user runs it, against the simulated cluster
    (`--platform h100`: its GPUs are logical): one PASS line per device-holding actor, exit 0;
    the TP-2 replica's leader shows its engine's workers on its replica's devices."""
    import subprocess
    import sys

    from polyrl.envplan.rules import FORWARDED_PREFIXES

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(FORWARDED_PREFIXES) and k != "RAY_ADDRESS"}
    out = subprocess.run(
        [sys.executable, "-m", "polyrl", "placement", "--platform", "h100", "--timeout", "120",
         f"ray.address={cluster.address}", "rollout.backend=trtllm", "rollout.placement=standalone",
         "rollout.num_replicas=1", "rollout.tensor_parallel_size=2", "rollout.max_model_len=64",
         "actor.num_cpus_per_worker=1"],
        capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert lines == [
        "PASS device policy rank 0: node 0 ids [0] -> device index [0]",
        "PASS device rollout replica 0 (rank 1): node 0 ids [1] -> device index [1], holds 0.5 of "
        "it; its engine's workers in bundles [1, 2] on devices ['1', '2']",
        "PASS device rollout replica 0 (rank 2): node 0 ids [2] -> device index [0]"]
