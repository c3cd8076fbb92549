"""Check a job's placement on a live Ray cluster: start one probe actor per device-holding actor
of a launch plan with the options a run uses, and compare what each sees with the plan.

    node_ids, seen = probe_plan(plan)               # plan: a LaunchPlan (polyrl/topology/launch_plan.py)
    for line in report(plan, node_ids, seen):       # `PASS device ...` / `FAIL device ...`
        print(line)

`polyrl placement [-c FILE] [key=value ...]` (polyrl/cli/placement_check.py; scripts/gpu_check.sh
runs it) plans the job and prints the report. This module only takes a plan: it never imports the
layers above placement (tests/placement/test_probe_layer.py).

Each probe reports its Ray node, the accelerator ids and the device share Ray assigned, the
visible-devices variable, the in-process device index its platform derives from the reservation
and, on a real GPU, the device's name as torch sees it. Three kinds of actor are checked:

- an actor reserving its devices: Ray narrowed its visibility to exactly them (index 0..n-1);
- an engine host (`hands`: a TP-k disaggregated replica's leader) asks Ray for no device and sees
  its replica's k devices (RAY_EXPERIMENTAL_NOSET_*);
- a TensorRT-LLM engine starter (its plan names its bundle, POLYRL_PLACEMENT_BUNDLE) holds a share
  of its device and keeps the whole node visible, as its plan's NOSET says, so that TRT-LLM's
  workers find their device by physical id. Its probe also starts, in its own placement group,
  one stand-in worker per bundle of its engine exactly as TRT-LLM does (`per_worker_gpu_share`
  of a device, Ray's default CPU, this process's environment): each must be scheduled on the
  device of the polyrl actor of its bundle. A worker that does not fit its bundle stays pending
  and is reported, the hang a real start would show.

A probe only checks placement; it never loads a model.
"""

from __future__ import annotations

import os
from typing import Any

import ray

from polyrl.envplan.rules import PLACEMENT_BUNDLE_VAR
from polyrl.placement.ray_groups import create_placement, options_for

NOSET_PREFIX = "RAY_EXPERIMENTAL_NOSET_"


@ray.remote
class EngineWorkerStandIn:
    """Asks Ray for what a TensorRT-LLM Ray worker asks (tensorrt_llm/executor/ray_gpu_worker.py
    `RayWorkerWrapper`: `@ray.remote` with `.options(num_gpus=per_worker_gpu_share)` only) and
    reports where Ray put it."""

    def where(self) -> dict[str, Any]:
        return {"node": ray.get_runtime_context().get_node_id(),
                "assigned": [str(i) for i in ray.get_gpu_ids()],
                "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}


@ray.remote(num_cpus=0)
class DeviceProbe:
    def __init__(self, platform_name: str, probe: Any = None):
        from polyrl.platform import get_platform

        self.platform = get_platform(platform_name, probe)

    def record(self, env_names: list[str], workers: tuple[float, int] | None = None,
               worker_timeout_s: float = 60) -> dict[str, Any]:
        """What this actor sees; with `workers` (share, count): also where the engine's Ray
        workers land in the bundles its engine uses (`start_engine_workers`)."""
        ctx = ray.get_runtime_context()
        p = self.platform
        seen = {"node": ctx.get_node_id(),
                "assigned": [str(i) for i in ctx.get_accelerator_ids().get(p.ray_resource or "", [])],
                "holds": ctx.get_assigned_resources().get(p.ray_resource or "", 0),
                "visible": {v: os.environ.get(v) for v in p.visible_devices_vars},
                "index": p.reserved_devices(),
                "env": {n: os.environ.get(n) for n in env_names},
                "noset": sorted(k for k in os.environ if k.startswith(NOSET_PREFIX)),
                "device_name": None, "device_count": None}
        if not p.probe.simulated:
            seen["device_count"] = p.device_module().device_count()  # an engine host: its k
            if seen["index"]:
                p.set_device(seen["index"][0])
                seen["device_name"] = p.device_module().get_device_name(seen["index"][0])
        if workers is not None:
            seen["workers"] = start_engine_workers(*workers, timeout_s=worker_timeout_s)
        return seen


def start_engine_workers(share: float, count: int, timeout_s: float) -> list[dict[str, Any]]:
    """In the calling actor's placement group, one stand-in worker per bundle from the one named
    by PLACEMENT_BUNDLE_VAR on (as polyrl/rollout/engines/trtllm.py:placement hands TRT-LLM its
    replica's bundles), each with a copy of this process's environment (as TRT-LLM's Ray executor
    starts them). Per bundle: where the worker runs, or `pending` when Ray could not schedule it
    within `timeout_s` (its bundle has no room)."""
    from ray.util import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group, first = get_current_placement_group(), os.environ.get(PLACEMENT_BUNDLE_VAR, "")
    if group is None or not first.isdigit():
        return [{"error": f"not in a placement group, or {PLACEMENT_BUNDLE_VAR}={first!r} names no bundle"}]
    bundles = [int(first) + k for k in range(count)]
    handles = [EngineWorkerStandIn.options(
        num_gpus=share, runtime_env={"env_vars": dict(os.environ)},
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=b)
    ).remote() for b in bundles]
    refs = [h.where.remote() for h in handles]
    try:
        # a worker that does not fit its bundle never starts: the deadline reports it as pending
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        done = dict(zip(ready, ray.get(ready)))
    finally:
        for h in handles:
            ray.kill(h)
    return [{"bundle": b, **done[r]} if r in done else {"bundle": b, "pending": True}
            for b, r in zip(bundles, refs)]


def device_share(resources: dict[str, Any]) -> float:
    """Devices a Ray resource dict asks for (num_gpus or a custom resource such as NPU)."""
    return resources.get("num_gpus", 0) + sum((resources.get("resources") or {}).values())


def engine_workers(actor: Any) -> tuple[float, int] | None:
    """(device share each, how many) of the Ray workers `actor`'s engine starts in its bundles:
    one per tensor-parallel rank, each asking `per_worker_gpu_share` (the engine's launch
    arguments; TensorRT-LLM). None for an actor whose plan names no bundle: its engine, if any,
    runs in its own reservation."""
    if PLACEMENT_BUNDLE_VAR not in actor.env:
        return None
    args = (actor.engine.args if actor.engine is not None else None) or {}
    return float(args.get("per_worker_gpu_share", 1.0)), int(args.get("tensor_parallel_size", 1))


def probe_plan(plan: Any, timeout_s: float = 300,
               worker_timeout_s: float = 60) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Start the probes of a `LaunchPlan` (anything with `.actors`, `.placement`, `.platform`);
    returns (the live placement's node ids, actor name -> what it saw, with `bundle`: the live
    bundle index it ran in)."""
    actors = [a for a in plan.actors if a.devices is not None]
    live = create_placement(plan.placement, actors, timeout_s)
    try:
        options = options_for(live, actors)
        probe = plan.platform.probe if plan.platform.probe.simulated else None
        handles = [DeviceProbe.options(**options[a.name]).remote(plan.platform.name, probe)
                   for a in actors]
        seen = ray.get([h.record.remote(list(a.env.entries), engine_workers(a), worker_timeout_s)
                        for h, a in zip(handles, actors)], timeout=timeout_s)
        for h in handles:
            ray.kill(h)
        for a, s in zip(actors, seen):
            s["bundle"] = live.bundles[a.name][1]
        return list(live.node_ids), {a.name: s for a, s in zip(actors, seen)}
    finally:
        live.remove()


def problems(plan: Any, node_ids: list[str], seen: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Actor name -> what differs from the plan (empty list: placed as planned)."""
    actors = [a for a in plan.actors if a.devices is not None]
    # (planned node, live bundle) -> the actor there: whose device an engine worker must share
    in_bundle = {(a.devices.node, seen[a.name].get("bundle")): a for a in actors}
    return {a.name: _problems(a, node_ids, seen[a.name], in_bundle) for a in actors}


def _problems(a: Any, node_ids: list[str], got: dict[str, Any],
              in_bundle: dict[tuple[int, Any], Any]) -> list[str]:
    ids, bad = [str(i) for i in a.devices.ids], []
    host = getattr(a, "hands", None) is not None  # an engine host: asks Ray for no device
    starter = engine_workers(a) is not None  # starts an engine whose workers share its bundles
    if got["node"] != node_ids[a.devices.node]:
        bad.append(f"on Ray node {got['node'][:8]}, planned node {a.devices.node}")
    if got["assigned"] != ([] if host else ids):
        bad.append(f"Ray assigned ids {got['assigned']}, planned {[] if host else ids}")
    planned_share = device_share(a.resources)
    if "holds" in got and round(got["holds"], 4) != round(planned_share, 4):
        bad.append(f"holds {got['holds']:g} of a device, planned {planned_share:g}")
    visible = next((v for v in got["visible"].values() if v), None)
    planned_noset = sorted(k for k in a.env.entries if k.startswith(NOSET_PREFIX))
    if host:
        sees = [str(i) for i in a.hands]
        if visible != ",".join(sees):
            bad.append(f"sees devices {visible!r}, planned {','.join(sees)!r}")
        if got["index"] != []:
            bad.append(f"device index {got['index']}, expected []")
        if got.get("device_count") not in (None, len(sees)):
            bad.append(f"torch sees {got['device_count']} devices, its replica has {len(sees)}")
        if not got["noset"]:
            bad.append("an engine host without RAY_EXPERIMENTAL_NOSET_*: Ray may rewrite what it sees")
    elif starter:
        bad += _starter_problems(a, got, ids, visible, planned_noset, in_bundle)
    else:
        if visible != ",".join(ids):
            bad.append(f"sees devices {visible!r}, planned {','.join(ids)!r}")
        if got["index"] != list(range(len(ids))):
            bad.append(f"device index {got['index']}, expected {list(range(len(ids)))}")
        if got["noset"]:
            bad.append(f"has {', '.join(got['noset'])} although it reserves devices")
    expected_env = a.env.values()
    if starter and "bundle" in got:
        planned_bundle, live_bundle = expected_env.get(PLACEMENT_BUNDLE_VAR), str(got["bundle"])
        if planned_bundle != live_bundle:
            bad.append(f"started in bundle {live_bundle}, the plan (dry run) says {planned_bundle}")
        expected_env = {**expected_env, PLACEMENT_BUNDLE_VAR: live_bundle}  # the live one decides
    if got["env"] != expected_env:
        differ = sorted(k for k in expected_env if got["env"].get(k) != expected_env[k])
        bad.append(f"environment differs from the plan: {', '.join(differ)}")
    return bad


def _starter_problems(a: Any, got: dict[str, Any], ids: list[str], visible: str | None,
                      planned_noset: list[str], in_bundle: dict[tuple[int, Any], Any]) -> list[str]:
    """A TensorRT-LLM engine starter: a share of its device, the visibility its plan says (Ray
    must not narrow it: the workers inherit it and find their device by physical id), its
    device index read through that visibility, and each engine worker on its bundle's device."""
    bad = []
    if got["noset"] != planned_noset:
        bad.append(f"has {got['noset'] or 'no RAY_EXPERIMENTAL_NOSET_*'}, its plan says {planned_noset}: "
                   "Ray narrows the visibility its engine's workers inherit")
    order = [x.strip() for x in visible.split(",")] if visible else None
    workers = got.get("workers") or []
    needed = ids + [str(in_bundle[(a.devices.node, w["bundle"])].devices.ids[0])
                    for w in workers if (a.devices.node, w.get("bundle")) in in_bundle]
    hidden = sorted({i for i in needed if order is not None and i not in order}, key=int)
    if hidden:
        bad.append(f"sees devices {visible!r}: devices {','.join(hidden)} of its engine are hidden "
                   "(planned: the node's whole visibility)")
    # Platform.local_device_indices: by physical id with no list, else its position in the list
    expected = ([int(i) for i in ids] if order is None
                else [order.index(i) for i in ids if i in order])
    if got["index"] != expected:
        bad.append(f"device index {got['index']}, expected {expected}")
    for w in workers:
        if "error" in w:
            bad.append(f"its engine's workers: {w['error']}")
            continue
        owner = in_bundle.get((a.devices.node, w["bundle"]))
        if w.get("pending"):
            bad.append(f"its engine's worker for bundle {w['bundle']} was never scheduled: the "
                       "bundle has no room for it beside its polyrl actor (TRT-LLM's start hangs)")
        elif owner is None:
            bad.append(f"its engine's worker went to bundle {w['bundle']}, where no actor is planned")
        elif w["node"] != got["node"] or w["assigned"] != [str(owner.devices.ids[0])]:
            bad.append(f"its engine's worker for bundle {w['bundle']} runs on device {w['assigned']}, "
                       f"the bundle's actor ({owner.name}) on {owner.devices.ids[0]}")
        elif w["visible"] and w["assigned"][0] not in w["visible"].split(","):
            bad.append(f"its engine's worker for bundle {w['bundle']} sees {w['visible']!r}, "
                       f"not its device {w['assigned'][0]}")
    return bad


def report(plan: Any, node_ids: list[str], seen: dict[str, dict[str, Any]]) -> list[str]:
    """One `PASS device <actor>: ...` / `FAIL device <actor>: ... (what differs)` line per actor."""
    lines = []
    for name, bad in problems(plan, node_ids, seen).items():
        a, s = next(a for a in plan.actors if a.name == name), seen[name]
        d = a.devices
        where = f"node {d.node} ids {list(d.ids)} -> {s['device_name'] or 'device'} index {s['index']}"
        if a.hands is not None:
            where = f"node {d.node} engine host, hands its engine ids {list(a.hands)} -> sees {s['visible']}"
        elif s.get("workers"):
            placed = [(w.get("assigned") or ["pending"])[0] for w in s["workers"]]
            where += (f", holds {s['holds']:g} of it; its engine's workers in bundles "
                      f"{[w.get('bundle') for w in s['workers']]} on devices {placed}")
        lines.append(f"{'FAIL' if bad else 'PASS'} device {name}: {where}"
                     + (f" ({'; '.join(bad)})" if bad else ""))
    return lines


if __name__ == "__main__":  # the command moved up to the cli layer, which plans the job
    import sys

    print("python -m polyrl.placement.probe is now `polyrl placement [-c FILE] [key=value ...]` "
          "(docs/dry_run.md)", file=sys.stderr)
    sys.exit(2)
