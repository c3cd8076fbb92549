"""`polyrl plot RUN_DIR`: draw a run's training curves to RUN_DIR/curves.png and print a summary.

Works on a finished run and on one still training (it reads what metrics.jsonl holds so far).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from polyrl.cli.common import CLIError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="plot a run's reward, accuracy and length curves (PNG) and summarise it",
                       description="Read RUN_DIR/metrics.jsonl, write RUN_DIR/curves.png and print "
                       "first/last/best of the key metrics.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's trainer.output_dir")
    p.add_argument("-o", "--output", metavar="PNG", help="where to write the figure "
                   "(default RUN_DIR/curves.png)")
    p.add_argument("--no-summary", action="store_true", help="only write the figure")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from polyrl.trainer.plots import MetricsFileError, plot_run, print_summary

    run_dir = Path(args.run_dir)
    try:
        path = plot_run(run_dir, Path(args.output) if args.output else None)
    except MetricsFileError as exc:
        raise CLIError(str(exc)) from None
    except OSError as exc:
        raise CLIError(f"could not write the figure: {exc}") from None
    console = Console(soft_wrap=True)
    console.print(f"wrote {path}", highlight=False)
    if not args.no_summary:
        print_summary(run_dir, console)
    return 0
