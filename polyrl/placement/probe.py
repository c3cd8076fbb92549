"""Check a job's placement on a live Ray cluster: start one probe actor per device-holding actor
of the launch plan with the options a run uses, and compare what each sees with the plan.

    python -m polyrl.placement.probe [-c FILE] [key=value ...]     # scripts/gpu_check.sh runs this

Each probe reports its Ray node, the accelerator ids Ray assigned, the visible-devices variable,
the in-process device index its platform derives from the reservation and, on a real GPU, the
device's name as torch sees it. One line per actor (`PASS device ...` / `FAIL device ...`);
exit status 1 if any actor sits elsewhere than planned. A probe only checks placement; it never
loads a model.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import ray

from polyrl.placement.ray_groups import create_placement, options_for


@ray.remote(num_cpus=0)
class DeviceProbe:
    def __init__(self, platform_name: str, probe: Any = None):
        from polyrl.platform import get_platform

        self.platform = get_platform(platform_name, probe)

    def record(self, env_names: list[str]) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        p = self.platform
        seen = {"node": ctx.get_node_id(),
                "assigned": [str(i) for i in ctx.get_accelerator_ids().get(p.ray_resource or "", [])],
                "visible": {v: os.environ.get(v) for v in p.visible_devices_vars},
                "index": p.reserved_devices(),
                "env": {n: os.environ.get(n) for n in env_names},
                "noset": sorted(k for k in os.environ if k.startswith("RAY_EXPERIMENTAL_NOSET_")),
                "device_name": None}
        seen["device_count"] = None
        if not p.probe.simulated:
            seen["device_count"] = p.device_module().device_count()  # an engine host: its k
            if seen["index"]:
                p.set_device(seen["index"][0])
                seen["device_name"] = p.device_module().get_device_name(seen["index"][0])
        return seen


def probe_plan(plan: Any, timeout_s: float = 300) -> tuple[Any, dict[str, dict[str, Any]]]:
    """Start the probes of a `LaunchPlan`; returns (the live placement's node ids, what each saw)."""
    actors = [a for a in plan.actors if a.devices is not None]
    live = create_placement(plan.placement, actors, timeout_s)
    try:
        options = options_for(live, actors)
        probe = plan.platform.probe if plan.platform.probe.simulated else None
        handles = [DeviceProbe.options(**options[a.name]).remote(plan.platform.name, probe)
                   for a in actors]
        seen = ray.get([h.record.remote(list(a.env.entries)) for h, a in zip(handles, actors)],
                       timeout=timeout_s)
        for h in handles:
            ray.kill(h)
        return list(live.node_ids), {a.name: s for a, s in zip(actors, seen)}
    finally:
        live.remove()


def problems(plan: Any, node_ids: list[str], seen: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Actor name -> what differs from the plan (empty list: placed as planned)."""
    out: dict[str, list[str]] = {}
    for a in (a for a in plan.actors if a.devices is not None):
        got, ids, bad = seen[a.name], [str(i) for i in a.devices.ids], []
        host = getattr(a, "hands", None) is not None  # an engine host: asks Ray for no device
        sees = [str(i) for i in a.hands] if host else ids
        if got["node"] != node_ids[a.devices.node]:
            bad.append(f"on Ray node {got['node'][:8]}, planned node {a.devices.node}")
        if got["assigned"] != ([] if host else ids):
            bad.append(f"Ray assigned ids {got['assigned']}, planned {[] if host else ids}")
        visible = next((v for v in got["visible"].values() if v), None)
        if visible != ",".join(sees):
            bad.append(f"sees devices {visible!r}, planned {','.join(sees)!r}")
        if got["index"] != ([] if host else list(range(len(ids)))):
            bad.append(f"device index {got['index']}, expected {list(range(len(ids)))}")
        if got["noset"] and not host:
            bad.append(f"has {', '.join(got['noset'])} although it reserves devices")
        if host and got.get("device_count") not in (None, len(sees)):
            bad.append(f"torch sees {got['device_count']} devices, its replica has {len(sees)}")
        if host and not got["noset"]:
            bad.append("an engine host without RAY_EXPERIMENTAL_NOSET_*: Ray may rewrite what it sees")
        if got["env"] != a.env.values():
            bad.append("environment differs from the plan")
        out[a.name] = bad
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    from polyrl.cli.common import add_config_args, load_job_config
    from polyrl.platform import current_platform
    from polyrl.topology.launch_plan import plan_launch

    parser = argparse.ArgumentParser(prog="python -m polyrl.placement.probe")
    add_config_args(parser)
    cfg = load_job_config(parser.parse_args(argv))
    ray.init(address=cfg.ray.address or None, log_to_driver=False)
    try:
        nodes = sum(1 for n in ray.nodes() if n.get("Alive") and n["Resources"].get("GPU"))
        plan = plan_launch(cfg, current_platform(), nodes=nodes or None)
        if plan.errors:
            print(f"FAIL device plan: {'; '.join(plan.errors)}")
            return 1
        node_ids, seen = probe_plan(plan)
    finally:
        ray.shutdown()
    failed = 0
    for name, bad in problems(plan, node_ids, seen).items():
        a, s = next(a for a in plan.actors if a.name == name), seen[name]
        d = a.devices
        where = f"node {d.node} ids {list(d.ids)} -> {s['device_name'] or 'device'} index {s['index']}"
        if a.hands is not None:
            where = f"node {d.node} engine host, hands its engine ids {list(a.hands)} -> sees {s['visible']}"
        print(f"{'FAIL' if bad else 'PASS'} device {name}: {where}" + (f" ({'; '.join(bad)})" if bad else ""))
        failed += bool(bad)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
