"""`polyrl env`: print the environment plan of a role, with where each value comes from."""

from __future__ import annotations

import argparse
import json
import os

from polyrl.cli.common import add_config_args, choose_platform, load_job_config
from polyrl.envplan import BACKENDS, MODES, PLACEMENTS, ROLES, PlanContext, build_plan


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
    p.add_argument("--placement", choices=PLACEMENTS, help="hybrid or standalone (default: config)")
    p.add_argument("--mode", choices=MODES, help="sync or async (default: from the config)")
    p.add_argument("--platform", help="cpu, cuda, rocm, npu (default: detect, or the config)")
    p.add_argument("--capability", metavar="MAJOR.MINOR",
                   help="simulate a device capability, e.g. 10.0 for GB200")
    p.add_argument("--backend-version", help="assume this engine version (default: installed)")
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
        placement=args.placement or cfg.rollout.placement,
        mode=args.mode or cfg.trainer.mode,
        backend_version=args.backend_version or installed_version(backend),
    )
    return build_plan(ctx, user_env=os.environ, config_env=cfg.env)


def run(args: argparse.Namespace) -> int:
    plan = plan_for(args)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2, sort_keys=True))
        return 0
    from rich.console import Console
    from rich.table import Table

    c = plan.context
    title = (f"environment plan: role={c.role} backend={c.backend} placement={c.placement} "
             f"mode={c.mode} platform={c.platform.describe()}")
    table = Table(title=title, show_lines=False, expand=False)
    for col in ("variable", "value", "source", "reason"):
        table.add_column(col, overflow="fold")
    for name, entry in plan.entries.items():
        reason = entry.reason + (f" ({entry.link})" if entry.link else "")
        table.add_row(name, entry.value, entry.source, reason)
    Console().print(table)
    return 0
