"""``parallel-latent plot``: PNG curves of a run's metrics."""

from __future__ import annotations

import argparse

from parallel_latent.errors import ExitStatus, require_dir, require_output_dir


def cmd_plot(args: argparse.Namespace) -> int:
    from parallel_latent.plot import plot_run

    run_dir = require_dir(args.run_dir, "run directory")
    out = require_output_dir(args.out) if args.out else None
    for path in plot_run(run_dir, out):
        print(path)
    return ExitStatus.OK


def add_subcommands(sub) -> None:
    plot = sub.add_parser("plot", help="write PNG curves of a run's metrics (needs matplotlib)")
    plot.add_argument("run_dir", help="the run directory (holds metrics.jsonl)")
    plot.add_argument("--out", default=None, help="output directory (default RUN_DIR/plots)")
    plot.set_defaults(handler=cmd_plot)
