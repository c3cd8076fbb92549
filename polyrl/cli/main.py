"""Entry point of the `polyrl` command."""

from __future__ import annotations

import argparse
import importlib
import sys

from polyrl import __version__
from polyrl.cli.common import CLIError, fail, setup_logging

SUBCOMMANDS = {"train": "polyrl.cli.train", "env": "polyrl.cli.env_cmd", "doctor": "polyrl.cli.doctor",
               "serve": "polyrl.cli.serve", "bench": "polyrl.cli.bench", "plot": "polyrl.cli.plot",
               "sft": "polyrl.cli.sft", "export": "polyrl.cli.export",
               "placement": "polyrl.cli.placement_check"}
"""command -> its module (imported when the parser is built; each defines `add_parser`)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="polyrl",
        description="RL post-training for language models (GRPO / PPO family), laptop to cluster.",
    )
    parser.add_argument("--version", action="version", version=f"polyrl {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parse_args, but KEY=VALUE overrides may also follow an option (`polyrl train a=1 --dry-run
    b=2`): argparse fills a `nargs="*"` positional from its first run of words only and calls the
    rest unrecognized. Those later words join `overrides` in the order given."""
    args, rest = parser.parse_known_args(argv)
    if rest and hasattr(args, "overrides") and all("=" in w and not w.startswith("-") for w in rest):
        args.overrides = [*args.overrides, *rest]
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse(parser, argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    setup_logging(args.verbose)
    try:
        return int(args.func(args) or 0)
    except CLIError as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        fail("interrupted")
        return 130  # the shell's code for SIGINT (EXIT_CODES in polyrl/trainer/interrupts.py)


if __name__ == "__main__":
    sys.exit(main())
