"""Pieces shared by the subcommands: config loading, platform choice, console output."""

from __future__ import annotations

import argparse
import logging
import sys

from polyrl.config import ConfigError, load_config
from polyrl.platform import Platform, PlatformError, get_platform, simulated_probe
from polyrl.platform.detect import DEFAULT_GPU_PLATFORM, PLATFORMS
from polyrl.trainer.config import JobConfig


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


def choose_platform(name: str | None, capability: str | None = None) -> Platform:
    """The real platform, or a simulated one when the user plans for other hardware."""
    cap = parse_capability(capability)
    name = None if name in (None, "", "auto") else name
    try:
        real = get_platform(None)
        target = name or (real.name if cap is None or real.ray_resource else DEFAULT_GPU_PLATFORM)
        if target == real.name and cap is None:
            return real
        if target not in PLATFORMS:
            return get_platform(target)  # raises, listing the registered platforms
        return get_platform(target, simulated_probe(target, cap))
    except PlatformError as exc:
        raise CLIError(str(exc)) from None


def fail(message: str) -> int:
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    return 2


def stdout_is_tty() -> bool:
    return sys.stdout.isatty()
