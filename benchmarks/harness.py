"""What every benchmark script shares: its arguments, its timing ratios and its report. A figure prints as
``figure: NAME = VALUE`` (what the tests and run_all.py look for); a goal not met is reported, not an
error; a timing ratio is an :func:`interleaved` :class:`Spread` (docs/development.md, Benchmarks)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"
GPT2 = REPO / "configs" / "gpt2.yaml"
BUNDLED = REPO / "parallel_latent" / "corpus" / "austen_pride_and_prejudice.txt"
# configs/gpt2.yaml's model shrunk for a quick run, and configs/tiny.yaml's smallest (a CPU test of a whole run).
GPT2_SHRUNK = ["model.d_model=64", "model.n_heads=4", "model.n_encoder_layers=2", "model.n_decoder_layers=2",
               "feature_model.n_layer=4", "feature_model.n_head=4", "feature_model.n_embd=64"]  # fmt: skip
SMALLEST = ["model.d_model=32", "model.n_heads=2", "model.n_encoder_layers=1", "model.n_decoder_layers=1",
            "model.max_length=8", "feature_model.n_layer=3", "feature_model.n_head=2", "feature_model.n_embd=32",
            "data.max_samples=400"]  # fmt: skip
# A run that leaves nothing behind it need not: no evaluation, checkpoint, export, progress bar or TensorBoard.
QUIET_RUN = ["training.eval_every=0", "checkpoint.save_every=0", "checkpoint.export_portable=false",
             "checkpoint.resume=never", "logging.progress_bar=false", "logging.tensorboard=false"]  # fmt: skip

# The halves' medians of a stable ratio differ by at most this fraction: half of the 5% within which
# two runs of a script are to agree, since a whole run's median is no steadier than a half's by much.
STABLE_WITHIN = 0.025


@dataclass
class Spread:
    """Per-repeat ratios of two variants timed in turn, the median CPU-time ratio and load average."""

    low: float
    median: float
    high: float
    cpu: float
    repeats: int
    load: float
    stable: bool

    def words(self) -> str:
        steady = "" if self.stable else ", unstable"
        return (f"{format_value(self.low)}-{format_value(self.high)} over {self.repeats} repeats, "
                f"CPU time {format_value(self.cpu)}, load {self.load:.1f}{steady}")  # fmt: skip


def halves_agree(ratios: list[float], within: float = STABLE_WITHIN) -> bool:
    """Whether the two halves of ``ratios`` (in the order measured) have medians within ``within``."""
    if len(ratios) < 4:
        return False
    half = len(ratios) // 2
    first, second = statistics.median(ratios[:half]), statistics.median(ratios[half:])
    return abs(first - second) <= within * min(abs(first), abs(second))


@dataclass
class Samples:  # per variant, wall and CPU seconds of each repeat; the load average after each
    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]
    load: list[float] = field(default_factory=list)

    def spread(self, numerator: str, denominator: str) -> Spread:
        walls = [a / b for a, b in zip(self.wall[numerator], self.wall[denominator], strict=True)]
        cpus = [a / b for a, b in zip(self.cpu[numerator], self.cpu[denominator], strict=True) if b > 0]
        return Spread(low=min(walls), median=statistics.median(walls), high=max(walls),
                      cpu=statistics.median(cpus) if cpus else math.nan, repeats=len(walls),
                      load=statistics.median(self.load) if self.load else os.getloadavg()[0],
                      stable=halves_agree(walls))  # fmt: skip

    def median(self, name: str) -> float:
        return statistics.median(self.wall[name])


def interleaved(fns: dict[str, Callable[[], float | None]], repeats: int, *, warmup: int = 2,
                ratios: list[tuple[str, str]] = (), most: int | None = None,
                agree: Callable[[bool], bool] = bool) -> Samples:  # fmt: skip
    """Time ``fns`` in turn ``repeats`` times after ``warmup`` rounds, the order reversed on odd repeats (a
    function returning a float reports its own wall time). With ``ratios`` and ``most``, repeats go on in
    steps until every ratio's halves agree or ``most`` are done; ``agree``: every process stops together."""
    names = list(fns)
    samples, done, target = Samples({name: [] for name in names}, {name: [] for name in names}), 0, repeats
    for _ in range(warmup):
        for name in names:
            fns[name]()
    while True:
        while done < target:
            for name in names if done % 2 == 0 else reversed(names):
                cpu, wall = time.process_time(), time.perf_counter()
                reported = fns[name]()
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                samples.wall[name].append(wall if reported is None else reported)
                samples.cpu[name].append(cpu)
            samples.load.append(os.getloadavg()[0])
            done += 1
        settled = all(samples.spread(a, b).stable for a, b in ratios)
        if most is None or done >= most or agree(settled):
            return samples
        target = min(most, done + repeats)


@dataclass
class Figure:
    name: str
    value: float
    unit: str = ""
    goal: str = ""  # "<= 1.10", ">= 0.8", or "" (information)
    met: bool | None = None  # None: no goal (for a ratio with a spread: judged on its median)
    spread: dict | None = None  # a timing ratio's Spread, as a dict

    def line(self) -> str:
        goal = f" (goal {self.goal}: {'met' if self.met else 'NOT met'})" if self.goal else ""
        spread = f" [{Spread(**self.spread).words()}]" if self.spread else ""
        return f"figure: {self.name} = {format_value(self.value)}{self.unit and ' ' + self.unit}{spread}{goal}"


def format_value(value: float) -> str:
    if isinstance(value, int) or (math.isfinite(value) and value == int(value) and abs(value) >= 1000):
        return f"{int(value):,}"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"


def machine() -> dict:
    """What the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        names = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")]
        cpu = names[0].split(":", 1)[1].strip() if names else cpu
    info = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}
    for package in ("torch", "deepspeed", "transformers"):
        with contextlib.suppress(Exception):  # not installed: left out
            info[package] = version(package)
    with contextlib.suppress(ImportError):
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    return info


class Report:
    def __init__(self, benchmark: str, args: argparse.Namespace):
        self.benchmark, self.quick = benchmark, bool(getattr(args, "quick", False))
        self.json_path = getattr(args, "json", None)
        self.figures: list[Figure] = []

    def figure(self, name: str, value: float, unit: str = "", *, at_most: float | None = None,
               at_least: float | None = None, spread: Spread | None = None) -> Figure:  # fmt: skip
        """A figure; a timing ratio passes its :class:`Spread` and its median as ``value``."""
        goal, met = "", None
        if at_most is not None:
            goal, met = f"<= {at_most:g}", value <= at_most
        elif at_least is not None:
            goal, met = f">= {at_least:g}", value >= at_least
        figure = Figure(name, float(value), unit, goal, met, None if spread is None else asdict(spread))
        self.figures.append(figure)
        print(figure.line(), flush=True)
        return figure

    def ratio(self, name: str, samples: Samples, numerator: str, denominator: str, at_most: float | None = None,
              at_least: float | None = None):  # fmt: skip
        """The figure of an :func:`interleaved` timing ratio: its median, with its spread."""
        spread = samples.spread(numerator, denominator)
        return self.figure(name, spread.median, "x", at_most=at_most, at_least=at_least, spread=spread)

    def write(self) -> None:
        if not self.json_path:
            return
        # The command that reproduces the figures, less where they went (each --json and the word after it).
        argv = [arg for i, arg in enumerate(sys.argv[1:]) if "--json" not in sys.argv[i : i + 2]]
        record = {"benchmark": self.benchmark, "quick": self.quick,
                  "command": " ".join(["python", "-m", f"benchmarks.{self.benchmark}", *argv]),
                  "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  "machine": machine(), "figures": [asdict(f) for f in self.figures]}  # fmt: skip
        path = Path(self.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")


@contextlib.contextmanager
def started_trainer(cfg, source: str = "bench"):
    """A trainer of ``cfg`` started in this process, ended as the command line's ranks end (process groups
    torn down before the interpreter exits: gloo's threads left to its exit can abort it)."""
    from parallel_latent.parallel import destroy_distributed
    from parallel_latent.training.startup import start_run
    from parallel_latent.training.trainer import Trainer

    trainer = Trainer(start_run(cfg, source=source))
    try:
        yield trainer
    finally:
        trainer.close()
        trainer.job.release()
        destroy_distributed()


def config_with_tokenizer(path: Path, overrides: list[str]):
    """(the config at ``path`` with ``overrides`` and its tokenizer's facts, the tokenizer)."""
    from parallel_latent.config import load_config
    from parallel_latent.feature_model.tokenizer import apply_tokenizer_facts, load_tokenizer, tokenizer_facts

    cfg = load_config(path, overrides)
    tokenizer = load_tokenizer(cfg.tokenizer)
    return apply_tokenizer_facts(cfg, tokenizer_facts(tokenizer)), tokenizer


def script_parser(doc: str, arguments: Callable[[argparse.ArgumentParser], None] | None = None):
    """A script's parser: ``doc`` its description, ``arguments(parser)`` its options, then --quick and --json."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if arguments:
        arguments(parser)
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes and few repeats (seconds): checks the script runs")  # fmt: skip
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON here")
    return parser


def add_repeat_arguments(parser: argparse.ArgumentParser, repeats: int, most: int) -> None:
    """At least ``repeats``, more (in steps of ``repeats``) until each ratio's halves agree, at most ``most``."""
    parser.add_argument("--repeats", type=int, default=repeats, help="interleaved repeats per step of the measurement")
    parser.add_argument("--most-repeats", type=int, default=most,
                        help="repeats at most while a ratio's halves disagree")  # fmt: skip


def run(benchmark: str, parser: argparse.ArgumentParser, body: Callable[[argparse.Namespace, Report], None]) -> int:
    """Parse the arguments, run ``body``, write the JSON; non-zero (and a line saying so) without figures."""
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


def command(benchmark: str, doc: str, body: Callable[[argparse.Namespace, Report], None],
            arguments: Callable[[argparse.ArgumentParser], None] | None = None,
            module: str = "") -> Callable[[], int]:  # fmt: skip
    """The ``main`` of script ``benchmark``: :func:`run` of ``body`` under :func:`script_parser`. Where
    ``module`` (the script's ``__name__``) is ``"__main__"``, run at once, its status the process's."""
    main = functools.partial(run, benchmark, script_parser(doc, arguments), body)
    if module == "__main__":
        sys.exit(main())
    return main


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
