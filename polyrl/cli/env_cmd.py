"""`polyrl env`: print the environment plan of a role, with where each value comes from."""

from __future__ import annotations

import argparse
import json
import os

from polyrl.cli.common import CLIError, add_config_args, choose_platform, load_job_config
from polyrl.config.vocabulary import canonical_placement
from polyrl.envplan import BACKENDS, MODES, PLACEMENTS, ROLES, PlanContext, build_plan
from polyrl.envplan.plan import hosts_engine
from polyrl.envplan.rules import BUNDLE_BACKENDS, PLACEMENT_BUNDLE_VAR


def _placement(value: str) -> str:
    """--placement with an earlier spelling (hybrid, standalone) read as its name."""
    return str(canonical_placement(value, "rollout.placement"))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "env",
        help="show every environment variable polyrl gives a process, and why",
        description="Print the environment plan for one role. Values you set in your "
        "environment or in the config's env: section always win over polyrl's defaults. "
        "Use --platform/--capability to plan for hardware you do not have.",
    )
    p.add_argument("--role", choices=ROLES, default="rollout", help="which process (default: rollout)")
    p.add_argument("--backend", choices=BACKENDS, help="rollout engine (default: from the config)")
    p.add_argument("--placement", choices=PLACEMENTS, type=_placement,
                   help="colocated or disaggregated (default: the config's; hybrid and standalone are "
                   "accepted as their aliases)")
    p.add_argument("--mode", choices=MODES, help="sync or async (default: from the config)")
    p.add_argument("--platform", help="cpu, cuda, rocm, npu (default: detect, or the config)")
    p.add_argument("--capability", metavar="MAJOR.MINOR",
                   help="simulate a device capability, e.g. 10.0 for GB200")
    p.add_argument("--backend-version", help="assume this engine version (default: installed)")
    p.add_argument("--bundle", type=int, metavar="INDEX",
                   help="the environment of a TensorRT-LLM engine starter started in placement-group "
                   f"bundle INDEX ({PLACEMENT_BUNDLE_VAR}; `polyrl train --dry-run` shows each "
                   "actor's), e.g. --backend trtllm --platform h100 --bundle 1")
    p.add_argument("--json", action="store_true",
                   help="print an object: variable -> {value, source, reason}")
    add_config_args(p)
    p.set_defaults(func=run)


def plan_for(args: argparse.Namespace):
    from polyrl.rollout.factory import installed_version

    cfg = load_job_config(args)
    platform = choose_platform(args.platform or cfg.platform, args.capability)
    backend = args.backend or cfg.rollout.backend
    ctx = PlanContext(
        platform=platform,
        role=args.role,
        backend=backend,
        placement=args.placement or cfg.topology.placement,
        mode=args.mode or cfg.topology.mode,
        backend_version=args.backend_version or installed_version(backend),
        placement_bundle=args.bundle,
    )
    if args.bundle is not None:
        check_bundle(ctx)
    return build_plan(ctx, user_env=os.environ, config_env=cfg.env)


def check_bundle(ctx: PlanContext) -> None:
    """`--bundle` where a run tells an actor its bundle (polyrl/topology/launch_plan.py:in_bundles):
    an engine that starts Ray workers in its starter's bundles, in a process that starts the
    engine, on a platform whose devices Ray places. Anything else would show a variable no
    actor gets."""
    if ctx.placement_bundle < 0:
        raise CLIError(f"--bundle: expected a bundle index >= 0, got {ctx.placement_bundle}")
    if ctx.backend not in BUNDLE_BACKENDS:
        raise CLIError(f"--bundle: only {', '.join(sorted(BUNDLE_BACKENDS))} engine starters are told "
                       f"their bundle; the {ctx.backend} engine runs in its actor's own reservation "
                       "(add --backend trtllm)")
    if not hosts_engine(ctx):
        raise CLIError(f"--bundle: the {ctx.role} role starts no engine in {ctx.placement} "
                       "placement; use --role rollout (or --role trainer --placement colocated)")
    if not ctx.platform.ray_resource:
        raise CLIError(f"--bundle: on {ctx.platform.name} TensorRT-LLM places no Ray workers in "
                       "polyrl's bundles; add --platform cuda or a machine such as h100")


def run(args: argparse.Namespace) -> int:
    plan = plan_for(args)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2, sort_keys=True))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    c = plan.context
    title = (f"environment plan: role={c.role} backend={c.backend} placement={c.placement} "
             f"mode={c.mode} platform={c.platform.describe()}"
             + (f" bundle={c.placement_bundle}" if c.placement_bundle is not None else ""))
    table = Table(title=title, show_lines=False, expand=False)
    for col in ("variable", "value", "source", "reason"):
        table.add_column(col, overflow="fold")
    for name, entry in plan.entries.items():
        reason = entry.reason + (f" ({entry.link})" if entry.link else "")
        # escaped: a reason's "[batch, response, vocab]" is text, not rich markup
        table.add_row(*(escape(cell) for cell in (name, entry.value, entry.source, reason)))
    Console().print(table)
    return 0
