"""The test suite's time budget on this machine, measured in one invocation: the README's first
command (the embedded default trained with ``--nproc 2``), the fast suite (``-m "not slow"``) and the
whole suite (the README's test command), each timed on the wall clock, with the suite's times as
ratios to the first command's. The budget (docs/development.md): the whole suite within 8x the first
command, the fast suite within 2.5x. A machine's speed differs from day to day; the ratios do not
depend on it.

    python tools/suite_budget.py            # all three, about 15 minutes on 2 cores
    python tools/suite_budget.py --skip-whole

Prints one line per figure, then the ratios; exits 1 when a ratio is over its budget or a command
failed. Run it on a quiet machine: it measures what else runs too.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIRST_COMMAND = ["parallel-latent", "train", "--config", "configs/tiny.yaml", "--nproc", "2"]
FAST_SUITE = [sys.executable, "-m", "pytest", "tests", "-q", "-m", "not slow"]
WHOLE_SUITE = [sys.executable, "-m", "pytest", "tests", "-q"]
BUDGET = {"fast suite": 2.5, "whole suite": 8.0}


def timed(label: str, command: list[str]) -> tuple[float, int]:
    """``command`` run from the repository's root: its wall time and exit status (its output kept
    in a log whose path is printed, the last line of it shown)."""
    log = Path(tempfile.mkstemp(prefix=f"suite-budget-{label.replace(' ', '-')}-", suffix=".log")[1])
    started = time.perf_counter()
    with log.open("w") as out:
        status = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    seconds = time.perf_counter() - started
    last = next((line for line in reversed(log.read_text().splitlines()) if line.strip()), "")
    print(f"{label}: {seconds:.0f} s, exit status {status} ({last.strip()[:100]}; log {log})", flush=True)
    return seconds, status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/suite_budget.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-whole", action="store_true", help="the first command and the fast suite only")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="suite-budget-run-") as run_dir:
        first, status = timed("first command", [*FIRST_COMMAND, f"logging.run_dir={run_dir}"])
    failed = status != 0
    figures = {}
    for label, command in (("fast suite", FAST_SUITE), ("whole suite", WHOLE_SUITE)):
        if label == "whole suite" and args.skip_whole:
            continue
        figures[label], status = timed(label, command)
        failed |= status != 0
    over = False
    for label, seconds in figures.items():
        ratio = seconds / first
        within = ratio <= BUDGET[label]
        over |= not within
        print(f"{label} / first command: {ratio:.2f}x (budget {BUDGET[label]}x: {'within' if within else 'OVER'})")
    return 1 if failed or over else 0


if __name__ == "__main__":
    sys.exit(main())
