"""What every benchmark script shares: ``--quick`` and ``--json``, one line per figure, and an exit
status that says whether the figures were produced.

A figure is a number with its unit and, where the project states one, its goal. Each is printed as
one line starting ``figure:`` (what ``tests/benchmarks/test_benchmarks.py`` and ``benchmarks/run_all.py``
look for), and ``--json PATH`` writes them all with the machine they were measured on. A goal that
is not met is reported, not an error: timings on a shared machine are noisy, and a benchmark's job
is to measure. A script exits non-zero only when it could not produce its figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # scripts are run as files: make the repository importable
    sys.path.insert(0, str(REPO))


@dataclass
class Figure:
    name: str
    value: float
    unit: str = ""
    goal: str = ""  # "<= 1.10", ">= 0.8", or "" (information)
    met: bool | None = None  # None: no goal

    def line(self) -> str:
        goal = f" (goal {self.goal}: {'met' if self.met else 'NOT met'})" if self.goal else ""
        return f"figure: {self.name} = {format_value(self.value)}{self.unit and ' ' + self.unit}{goal}"


def format_value(value: float) -> str:
    if isinstance(value, int) or (math.isfinite(value) and value == int(value) and abs(value) >= 1000):
        return f"{int(value):,}"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"


def machine() -> dict:
    """What the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}
    for package in ("torch", "deepspeed", "transformers"):
        try:
            from importlib.metadata import version

            info[package] = version(package)
        except Exception:  # not installed: leave it out
            continue
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return info


class Report:
    """The figures of one benchmark run."""

    def __init__(self, benchmark: str, args: argparse.Namespace):
        self.benchmark = benchmark
        self.quick = bool(getattr(args, "quick", False))
        self.json_path = getattr(args, "json", None)
        self.figures: list[Figure] = []

    def figure(
        self,
        name: str,
        value: float,
        unit: str = "",
        *,
        at_most: float | None = None,
        at_least: float | None = None,
    ) -> Figure:
        goal, met = "", None
        if at_most is not None:
            goal, met = f"<= {at_most:g}", value <= at_most
        elif at_least is not None:
            goal, met = f">= {at_least:g}", value >= at_least
        figure = Figure(name, float(value), unit, goal, met)
        self.figures.append(figure)
        print(figure.line(), flush=True)
        return figure

    def write(self) -> None:
        if not self.json_path:
            return
        argv, skip = [], False
        for arg in sys.argv[1:]:  # the command that reproduces the figures, less where they went
            if skip or arg == "--json":
                skip = not skip
                continue
            argv.append(arg)
        record = {
            "benchmark": self.benchmark,
            "quick": self.quick,
            "command": " ".join(["python", f"benchmarks/{self.benchmark}.py", *argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(),
            "figures": [asdict(f) for f in self.figures],
        }
        path = Path(self.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="tiny shapes and few repeats (seconds): checks the script runs"
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON here")


def run(benchmark: str, parser: argparse.ArgumentParser, body: Callable[[argparse.Namespace, Report], None]) -> int:
    """Parse the arguments, run ``body``, write the JSON; the exit status says whether figures came out.
    A failure prints its traceback and one last line naming the benchmark."""
    args = parser.parse_args()
    report = Report(benchmark, args)
    try:
        body(args, report)
    except Exception as error:
        traceback.print_exc()
        print(f"{benchmark}: FAILED: {type(error).__name__}: {error}".splitlines()[0], file=sys.stderr, flush=True)
        return 1
    if not report.figures:
        print(f"{benchmark}: FAILED: no figures produced", file=sys.stderr, flush=True)
        return 1
    report.write()
    return 0
