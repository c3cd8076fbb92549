"""`polyrl train`: run RL post-training. With no arguments: the bundled tiny model learns the
bundled arithmetic task on this machine's CPU in a few minutes."""

from __future__ import annotations

import argparse
import logging
import signal
from pathlib import Path
from typing import Callable

from polyrl.cli.common import CLIError, add_config_args, load_job_config

logger = logging.getLogger("polyrl")

EMBEDDED_DEFAULT = Path(__file__).resolve().parents[1] / "configs" / "embedded_default.yaml"
"""The same file as polyrl/api.py `EMBEDDED_DEFAULT` (this module is imported before the API)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a policy with GRPO-family RL (default: bundled tiny model and task, on CPU)",
        description="Train with reinforcement learning from verifiable rewards. Config: YAML "
        "files (-c) then KEY=VALUE overrides, e.g. `polyrl train rollout.n=8 actor.lr=1e-4`. "
        "Without -c, training starts from the embedded default (bundled tiny model and "
        "arithmetic task, polyrl/configs/embedded_default.yaml).",
    )
    add_config_args(p)
    p.add_argument("--output-dir", help="where metrics, samples and summary.json go "
                   "(same as trainer.output_dir=...)")
    p.add_argument("--print-config", action="store_true",
                   help="print the fully resolved config and exit")
    p.add_argument("--help-config", action="store_true",
                   help="list every config key with its default and meaning, and exit")
    plan = p.add_argument_group(
        "dry run", "print the launch plan (Ray job, every actor's resources, environment and "
        "engine arguments) and exit without starting anything; docs/dry_run.md")
    plan.add_argument("--dry-run", action="store_true", help="print the launch plan and exit")
    plan.add_argument("--json", action="store_true", help="with --dry-run: one JSON object on stdout")
    plan.add_argument("--platform", help="plan for this platform (cpu, cuda, rocm, npu) or machine "
                      "(h100, gb200, gb300, mi300x, ascend910) instead of this one")
    plan.add_argument("--capability", metavar="MAJOR.MINOR",
                      help="simulate a device capability, e.g. 10.0 for Blackwell")
    plan.add_argument("--nodes", type=int, metavar="N",
                      help="simulate a cluster of N nodes of the platform's devices (with --dry-run)")
    plan.add_argument("--gpus-per-node", type=int, metavar="N",
                      help="devices per node of the simulated machine")
    plan.add_argument("--engine-version", metavar="VERSION",
                      help="assume this rollout-engine version (default: the installed one)")
    p.set_defaults(func=run)


PLAN_ONLY = ("json", "platform", "capability", "gpus_per_node", "nodes", "engine_version")


def run(args: argparse.Namespace) -> int:
    from polyrl.config import describe, to_yaml
    from polyrl.job import JobConfig

    if args.help_config:
        for key, type_name, default, doc in describe(JobConfig):
            print(f"{key} ({type_name}, default {default!r})\n    {' '.join(doc.split())}")
        return 0
    if args.output_dir:
        args.overrides = [*args.overrides, f"trainer.output_dir={args.output_dir}"]
    if not args.config:  # no config file: start from the embedded default (tiny model + task)
        args.config = [str(EMBEDDED_DEFAULT)]
    if not args.dry_run:
        given = [f"--{name.replace('_', '-')}" for name in PLAN_ONLY if getattr(args, name)]
        if given:
            raise CLIError(f"{', '.join(given)} only apply with --dry-run (to choose the platform "
                           "of a run, set platform=cuda|rocm|npu|cpu)")
    cfg = load_job_config(args)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    if args.dry_run:
        return plan_only(cfg, args)
    return train(cfg)


def plan_only(cfg, args: argparse.Namespace) -> int:
    """`--dry-run`: the launch plan for `cfg` on the chosen (possibly simulated) platform."""
    from polyrl.cli.common import choose_platform
    from polyrl.cli.dry_run import dry_run
    from polyrl.rollout.factory import installed_version

    platform = choose_platform(args.platform or cfg.platform, args.capability, args.gpus_per_node)
    version = args.engine_version or installed_version(cfg.rollout.backend)
    return dry_run(cfg, platform, version, args.json, nodes=args.nodes)


def train(cfg) -> int:
    """Run training; every failure a user can cause becomes one line and an exit code
    (polyrl/trainer/interrupts.py `EXIT_CODES`)."""
    from polyrl.config import to_yaml

    def fit() -> int:
        logger.info("resolved config:\n%s", to_yaml(cfg))
        return _fit(cfg)

    return run_interruptible(fit)


def run_interruptible(fit: Callable[[], int]) -> int:
    """`fit()` with a signal during start-up stopping it at once and one in the loop finishing the
    step (polyrl/trainer/interrupts.py); either way one line and the signal's exit code."""
    from polyrl.trainer.interrupts import StartupInterrupted, TrainingInterrupted, abort_on_signals

    try:
        with abort_on_signals():  # installed before the first log line: tests wait for that line
            return fit()
    except (TrainingInterrupted, StartupInterrupted) as exc:
        logger.error("%s", exc)
        return exc.exit_code
    except KeyboardInterrupt:  # the second Ctrl-C (interrupts.py stop_on_signals)
        logger.error("second Ctrl-C: abandoned the current step without a checkpoint; rerun the "
                     "same command (trainer.resume=auto) to continue from the last checkpoint")
        return 128 + signal.SIGINT


def _fit(cfg) -> int:
    from polyrl.api import run_training
    from polyrl.config import ConfigError
    from polyrl.data import DataFileError
    from polyrl.platform import PlatformError
    from polyrl.rewards import UnknownDataSourceError
    from polyrl.rollout.factory import EngineUnavailable
    from polyrl.trainer.checkpoint import CheckpointError
    from polyrl.trainer.loop import TrainingError
    from polyrl.trainer.sinks import SinkUnavailable
    from polyrl.training.model_loading import ModelLoadError
    from polyrl.training.base import NonFiniteUpdate
    from polyrl.training.lora import LoraError

    try:  # errors raised inside Ray actors arrive unwrapped (polyrl/api.py `unwrapped`)
        summary = run_training(cfg)
    except ConfigError as exc:  # pre-flight checks (trainer/preflight.py): one problem each
        raise CLIError("; ".join(exc.problems)) from None
    except (DataFileError, UnknownDataSourceError, EngineUnavailable, TrainingError,
            ModelLoadError, NonFiniteUpdate, FileNotFoundError, CheckpointError,
            SinkUnavailable, PlatformError, OSError, LoraError) as exc:
        # pre-flight checks LoRA settings; what only a rank sees (its adapter files) is one line too
        raise CLIError(str(exc)) from None
    before, after = summary["initial_accuracy"], summary["final_accuracy"]
    if before is not None and after is not None:
        teacher = summary.get("teacher_accuracy")
        versus = f" (the distillation teacher's: {teacher:.1%})" if teacher is not None else ""
        print(f"held-out accuracy: {before:.1%} -> {after:.1%}{versus} "
              f"({summary['steps']} steps, {summary['wall_seconds']:.0f}s); "
              f"metrics and summary.json in {summary['output_dir']}")
    return 0
