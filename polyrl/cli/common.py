"""Pieces shared by the subcommands: config loading, platform choice, console output."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace

from polyrl.config import ConfigError, load_config
from polyrl.platform import (
    SIMULATED_PROBES,
    Platform,
    PlatformError,
    detect_platform_name,
    get_platform,
    simulated_probe,
)
from polyrl.platform.detect import DEFAULT_GPU_PLATFORM, PLATFORMS
from polyrl.job import JobConfig


class CLIError(Exception):
    """A user-facing error: printed as one message, exit code 2, no traceback."""


def setup_logging(verbose: bool = False) -> None:
    """Configured once, at CLI start (never at import)."""
    from rich.console import Console
    from rich.logging import RichHandler

    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(message)s",
        datefmt="[%X]",
        handlers=[RichHandler(console=Console(stderr=True), show_path=False, rich_tracebacks=False)],
    )
    for noisy in ("httpx", "urllib3", "filelock", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", action="append", default=[], metavar="FILE",
                        help="YAML config file (repeatable; later files win)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides, e.g. rollout.n=8 actor.lr=1e-4")


def load_job_config(args: argparse.Namespace) -> JobConfig:
    try:
        return load_config(JobConfig, files=args.config, overrides=args.overrides)
    except ConfigError as exc:
        raise CLIError(str(exc)) from None


def parse_capability(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    try:
        major, _, minor = text.partition(".")
        return int(major), int(minor or 0)
    except ValueError:
        raise CLIError(f"--capability: expected MAJOR.MINOR such as 9.0 or 10.3, got {text!r}") from None


def choose_platform(name: str | None, capability: str | None = None,
                    devices_per_node: int | None = None) -> Platform:
    """The real platform, or a simulated one when the user plans for other hardware.

    `name`: a platform (cpu, cuda, rocm, npu) or a simulated machine (h100, gb200, gb300, mi300x,
    ascend910); `devices_per_node` replaces the simulated machine's device count."""
    cap = parse_capability(capability)
    name = None if name in (None, "", "auto") else name
    try:
        if name in SIMULATED_PROBES and name not in PLATFORMS:  # a machine, e.g. gb200
            probe = simulated_probe(name, cap)
            platform = get_platform(detect_platform_name(probe), probe)
        else:
            platform = _platform_by_name(name, cap)
        if devices_per_node is None:
            return platform
        if not platform.ray_resource:
            raise CLIError(f"--gpus-per-node needs an accelerator platform, not {platform.name}: "
                           f"add --platform cuda, rocm, npu or a machine such as h100")
        if devices_per_node < 1:
            raise CLIError(f"--gpus-per-node: expected a positive count, got {devices_per_node}")
        probe = replace(platform.probe, device_count=devices_per_node, smi_device_count=0,
                        simulated=True)
        return get_platform(platform.name, probe)
    except PlatformError as exc:
        raise CLIError(str(exc)) from None


def _platform_by_name(name: str | None, cap: tuple[int, int] | None) -> Platform:
    real = get_platform(None)
    target = name or (real.name if cap is None or real.ray_resource else DEFAULT_GPU_PLATFORM)
    if target == real.name and cap is None:
        return real
    if target not in PLATFORMS:
        return get_platform(target)  # raises, listing the registered platforms
    return get_platform(target, simulated_probe(target, cap))


def fail(message: str) -> int:
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    return 2


def stdout_is_tty() -> bool:
    return sys.stdout.isatty()
