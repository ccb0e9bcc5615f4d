"""What every benchmark script shares: its arguments and report, how it starts other processes
(one environment builder, rank processes, a port for their store), and what memory it reads.

A figure is a number with its unit and, where the project states one, its goal. Each is printed as
one line starting ``figure:`` (what ``tests/benchmarks/test_benchmarks.py`` and ``benchmarks/run_all.py``
look for), and ``--json PATH`` writes them all with the machine they were measured on. A goal that
is not met is reported, not an error: timings on a shared machine are noisy, and a benchmark's job
is to measure. A script exits non-zero only when it could not produce its figures.

A timing ratio comes from :func:`interleaved` repeats (the variants in turn, the order reversed every
other repeat) as a :class:`Spread`: min / median / max of the per-repeat ratios, the median ratio of
CPU time (on a shared machine the steadier one), the load average while it ran, and whether the
first and second halves of the repeats agree on the median within :data:`STABLE_WITHIN` (a script
that can repeat more does, up to its limit, then says "unstable").
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import queue
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"
GPT2 = REPO / "configs" / "gpt2.yaml"
BUNDLED = REPO / "parallel_latent" / "corpus" / "austen_pride_and_prejudice.txt"


# The halves' medians of a stable ratio differ by at most this fraction: half of the 5% within which
# two runs of a script are to agree, since a whole run's median is no steadier than a half's by much.
STABLE_WITHIN = 0.025


@dataclass
class Spread:
    """Per-repeat ratios of two variants timed in turn: their min, median and max; the median ratio of
    their CPU time (user + sys of this process, every thread); the 1-minute load average while they
    ran (median of one sample per repeat); whether the two halves of the repeats agree."""

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
    """Whether the first and second halves of ``ratios`` (in the order measured) have medians within
    ``within`` of each other: a drift or a burst of load in one half shows here."""
    if len(ratios) < 4:
        return False
    half = len(ratios) // 2
    first, second = statistics.median(ratios[:half]), statistics.median(ratios[half:])
    return abs(first - second) <= within * min(abs(first), abs(second))


@dataclass
class Samples:
    """What :func:`interleaved` measured: per variant, wall and CPU seconds of each repeat, and the
    load average after each repeat."""

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]
    load: list[float] = field(default_factory=list)

    def spread(self, numerator: str, denominator: str) -> Spread:
        walls = [a / b for a, b in zip(self.wall[numerator], self.wall[denominator], strict=True)]
        cpus = [a / b for a, b in zip(self.cpu[numerator], self.cpu[denominator], strict=True) if b > 0]
        return Spread(
            low=min(walls),
            median=statistics.median(walls),
            high=max(walls),
            cpu=statistics.median(cpus) if cpus else math.nan,
            repeats=len(walls),
            load=statistics.median(self.load) if self.load else os.getloadavg()[0],
            stable=halves_agree(walls),
        )

    def median(self, name: str) -> float:
        return statistics.median(self.wall[name])


def interleaved(
    fns: dict[str, Callable[[], float | None]],
    repeats: int,
    *,
    warmup: int = 2,
    ratios: list[tuple[str, str]] = (),
    most: int | None = None,
    agree: Callable[[bool], bool] = bool,
) -> Samples:
    """Time ``fns`` in turn ``repeats`` times after ``warmup`` untimed rounds, in the given order on
    even repeats and reversed on odd ones (whoever runs first in a round gets no edge). A function
    that returns a float reports its own wall time (work inside it that is not to be counted, a
    barrier, say, stays out); CPU time is always this process's around the call. With ``ratios``
    and ``most``, repeats continue in steps of ``repeats`` until every named ratio's halves agree or
    ``most`` repeats are done. ``agree`` turns this process's verdict into the one every process
    of a multi-process measurement acts on (an all-reduce), so that all stop together."""
    names = list(fns)
    samples = Samples({name: [] for name in names}, {name: [] for name in names})
    done, target = 0, repeats
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
        spread: Spread | None = None,
    ) -> Figure:
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
            "command": " ".join(["python", "-m", f"benchmarks.{self.benchmark}", *argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(),
            "figures": [asdict(f) for f in self.figures],
        }
        path = Path(self.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")


@contextlib.contextmanager
def started_trainer(cfg, source: str = "bench"):
    """A trainer of a run of ``cfg`` started in this process (every rank of a job calls it), ended
    as the command line's ranks end: closed, its watchdog stopped and the process groups torn down
    before the interpreter exits (gloo's threads left to the interpreter's exit can abort it)."""
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


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="tiny shapes and few repeats (seconds): checks the script runs"
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON here")


def add_repeat_arguments(parser: argparse.ArgumentParser, repeats: int, most: int) -> None:
    """A timing script's repeats: at least ``repeats``, more (in steps of ``repeats``) until each
    ratio's halves agree, at most ``most``."""
    parser.add_argument("--repeats", type=int, default=repeats, help="interleaved repeats per step of the measurement")
    parser.add_argument(
        "--most-repeats", type=int, default=most, help="repeats at most while a ratio's halves disagree"
    )


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


def all_ranks_agree(settled: bool) -> bool:
    """Every rank's verdict on its ratios' stability, the same on all: they repeat, or stop, together."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([int(settled)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


# --------------------------------------------------------------------------- #
# Other processes: their environment, their memory, ranks and the port of their store.
# --------------------------------------------------------------------------- #


def child_environment(threads: int | None = None, *, cpu: bool = False, **variables: str) -> dict[str, str]:
    """This process's environment for a child: ``threads`` compute threads (OMP_NUM_THREADS; None:
    as inherited), DeepSpeed on the CPU with ``cpu``, and ``variables`` (TOKENIZERS_PARALLELISM="false"
    where the child forks after tokenising: the tokenizers' warning, not their speed, is the point)."""
    env = {**os.environ, **variables}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if cpu:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def peak_rss_mb(pid: int) -> float | None:
    """VmHWM of a running process: the peak resident set of its current program. (ru_maxrss from
    wait4 would not do: it keeps the high-water mark of the image before exec, i.e. of this
    benchmark process, which forked the child.)"""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_rss_while(process, stop: Callable[[], bool] = lambda: False) -> float:
    """The peak resident set (MB) of a running ``process``, sampled every 10 ms until it exits or
    ``stop()`` (asked after each sample) says to stop watching."""
    peak = 0.0
    while process.poll() is None:
        peak = max(peak, peak_rss_mb(process.pid) or 0.0)
        if stop():
            break
        time.sleep(0.01)
    return peak


def _resident(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def peak_extra_bytes(fn) -> int:
    """Peak resident memory over ``fn()`` above what was resident before (Linux: resets the high-water
    mark through /proc/self/clear_refs; large tensors are mmapped, so they leave when freed)."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    before = _resident("VmRSS:")
    fn()
    return _resident("VmHWM:") - before


def free_port() -> int:
    """A port for a store that a process started later will host, kept from every other taker
    meanwhile: a port merely bound and closed is free for the next ``bind(0)`` (a gloo listener of
    a test running beside) before that process, seconds of imports later, binds it, and then the
    job's rank 0 cannot host its store and the others wait out their bound. Here the port is left
    in TIME_WAIT (about 60 s), which the kernel never hands to ``bind(0)`` or ``connect()``, while
    the store's own bind (``SO_REUSEADDR``, as every TCPStore binds) still takes it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            accepted, _ = listener.accept()
            accepted.close()  # the side that closes first holds the TIME_WAIT, on this port
    return port


def rank_environment(rank: int, world: int, port: int) -> dict[str, str]:
    """What a launcher tells rank ``rank`` of a job of ``world`` processes on this machine."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip


def _rank(rank: int, world: int, port: int, task, args: tuple, results) -> None:
    import torch

    os.environ.update({**rank_environment(rank, world, port), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)  # several ranks on few cores: one thread each, or they fight over the cores
    value = task(*args)
    if rank == 0:
        results.put(value)


def on_ranks(world: int, task, *args):
    """Rank 0's ``task(*args)``, run on each of ``world`` spawned processes (the ranks of a job on
    this machine, told so by their environment); a rank that fails ends them all."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results, port = context.Queue(), free_port()
    processes = [context.Process(target=_rank, args=(r, world, port, task, args, results)) for r in range(world)]
    for process in processes:
        process.start()
    while True:
        try:
            value = results.get(timeout=5)
            break
        except queue.Empty:
            failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
            if failed:
                for process in processes:
                    process.kill()
                raise RuntimeError(f"a rank exited with status {failed[0]}") from None
    for process in processes:
        process.join()
    return value
