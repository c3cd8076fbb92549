"""Entry point of the `polyrl` command."""

from __future__ import annotations

import argparse
import importlib
import sys

from polyrl import __version__
from polyrl.cli.common import CLIError, fail, setup_logging

SUBCOMMANDS = ("train", "env", "doctor", "serve", "bench", "plot")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="polyrl",
        description="RL post-training for language models (GRPO / PPO family), laptop to cluster.",
    )
    parser.add_argument("--version", action="version", version=f"polyrl {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"polyrl.cli.{name}_cmd" if name == "env" else f"polyrl.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("polyrl.cli"):
                continue  # subcommand not built yet
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    setup_logging(args.verbose)
    try:
        return int(args.func(args) or 0)
    except CLIError as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        return fail("interrupted")


if __name__ == "__main__":
    sys.exit(main())
