"""`polyrl placement`: check on the live Ray cluster that every actor of a job gets its planned
devices, before a run (polyrl/placement/probe.py holds the check; scripts/gpu_check.sh runs it).

    polyrl placement -c my.yaml rollout.backend=trtllm rollout.placement=disaggregated

Plans the job as `polyrl train` would (polyrl/topology/launch_plan.py), joins or starts Ray as the
run does (`plan_job`), starts one probe actor per device-holding actor with the run's options and
prints one `PASS device <actor>: ...` / `FAIL device <actor>: ... (what differs)` line each. Exit
status 0: all placed as planned; 1: an actor is not; 2: bad input (one line, before Ray starts).
"""

from __future__ import annotations

import argparse

from polyrl.cli.common import CLIError, add_config_args, choose_platform, load_job_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "placement",
        help="check on the live Ray cluster that every actor gets its planned devices",
        description="Start one probe actor per device-holding actor of the job, with the Ray "
        "options a run uses, and compare the node, devices, visibility and environment each "
        "gets with the launch plan (`polyrl train --dry-run` shows the plan). TensorRT-LLM "
        "engine starters also start stand-ins of the engine's Ray workers in their bundles. "
        "One PASS / FAIL line per actor; exit 1 if any actor is misplaced. Loads no model.",
    )
    p.add_argument("--platform", help="plan for this platform (cuda, rocm, npu) or simulated machine "
                   "(h100, ...; for Ray's test clusters with logical GPUs) instead of detecting it")
    p.add_argument("--timeout", type=float, default=300, metavar="SECONDS",
                   help="deadline for reserving the placement groups and for each probe (default 300)")
    add_config_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from polyrl.placement.probe import probe_plan, report
    from polyrl.topology.launch_plan import plan_job, plan_launch

    cfg = load_job_config(args)
    platform = choose_platform(args.platform or cfg.platform)
    if not platform.ray_resource:
        raise CLIError(f"polyrl placement checks device placement; platform {platform.name} has no "
                       "devices: run it on the GPU / NPU machines of the job, or pass --platform")
    if args.timeout <= 0:
        raise CLIError(f"--timeout: expected a positive number of seconds, got {args.timeout:g}")
    errors = [e for e in plan_launch(cfg, platform).errors if not e.startswith("placement:")]
    if errors:  # the engine's launch arguments: bad input, whatever the cluster (one line: the
        raise CLIError(errors[0])  # first actor's; every actor of the engine has the same)
    import ray

    ray.init(**plan_job(cfg, platform).ray_init, log_to_driver=False)
    try:
        nodes = sum(1 for n in ray.nodes() if n.get("Alive") and n["Resources"].get(platform.ray_resource))
        plan = plan_launch(cfg, platform, nodes=nodes or None)
        if plan.errors:  # the job does not fit this cluster
            print(f"FAIL device plan: {'; '.join(plan.errors)}")
            return 1
        node_ids, seen = probe_plan(plan, timeout_s=args.timeout)
    finally:
        ray.shutdown()
    lines = report(plan, node_ids, seen)
    print("\n".join(lines))
    return 1 if any(line.startswith("FAIL") for line in lines) else 0
