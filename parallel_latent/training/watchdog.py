"""The hang watchdog: a stalled rank ends the job within minutes, with one line naming it.

Each rank's main thread records what it is doing in a :class:`Progress` (the step and the phase, with
the time it entered it) as it moves; nothing else writes it, so a main thread that no longer moves
(a deadlock, a wedged GPU, a hung read) reports no progress even while the process lives. A
background thread per rank (:class:`Watchdog`) publishes that record, with the time it wrote it,
as a small file in ``RUN_DIR/progress/``: the run directory is one file system for all ranks
(start-up checks it), and a file needs no peer to be running, unlike a collective or a store hosted
by rank 0's process (under ``srun`` or the ``deepspeed`` launcher, rank 0 hosts the rendezvous
store: a stopped rank 0 would take it down with it).

Two ranks (the first and the last) read every record each ``interval`` and decide (:func:`find_stall`):

- a rank whose record was not rewritten for ``hang_timeout_s`` does not run at all (stopped, its
  node gone): it is stalled, whatever its phase;
- otherwise the job is stalled when no rank's main thread has moved for its allowance:
  ``hang_timeout_s``, or ``hang_long_phase_s`` while any rank is in a phase that legitimately takes
  long without reporting (start-up with data preparation and model loading, the first step with
  its compilation, evaluation, a checkpoint save). The stalled rank is then the one that moved
  last longest ago: the others blocked after it, in a collective it never joined.

The watcher that finds a stall publishes ``progress/hang.json``; every rank that still runs sees it
within one interval, writes the Python stack of each of its threads to the run's log directory, and
exits with status 5 (:attr:`ExitStatus.HANG`) and the one line, which the launcher's teardown of the
remaining ranks (SIGKILL for a stopped one) follows.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from parallel_latent.errors import ExitStatus, error_line
from parallel_latent.files import replace_file
from parallel_latent.launching.reports import write_error_file
from parallel_latent.launching.worker_logs import WORKER_LOGS_ENV

__all__ = [
    "LONG_PHASES",
    "PROGRESS_DIR",
    "HangReport",
    "Progress",
    "Watchdog",
    "bounded_phase",
    "clear_progress",
    "collective_timeout_s",
    "find_stall",
    "hang_line",
    "previous_job_failure",
]

PROGRESS_DIR = "progress"
MARKER = "hang.json"
# Phases that may take long without reporting progress (their allowance is hang_long_phase_s).
LONG_PHASES = frozenset({"start-up", "evaluation", "save"})
# Beyond the watchdog's longest allowance: a collective's own timeout, so that the watchdog, with
# its one line, always fires first and no wait is unbounded.
COLLECTIVE_GRACE_S = 120.0


def collective_timeout_s(hang_timeout_s: float, hang_long_phase_s: float) -> float:
    """The timeout of the process groups' collectives: the longest wait the watchdog allows, plus a
    grace period."""
    return max(hang_timeout_s, hang_long_phase_s) + COLLECTIVE_GRACE_S


class Progress:
    """What this rank's main thread is doing: written by the main thread only (see the module)."""

    def __init__(self) -> None:
        self.step = 0
        self.phase = "start-up"
        self.at = time.time()
        self.first_step = True  # the first step of this process: compilation, first allocations

    def enter(self, phase: str, step: int | None = None) -> None:
        self.phase, self.at = phase, time.time()
        if step is not None:
            self.step = step

    def finished_step(self) -> None:
        self.first_step = False

    @property
    def long(self) -> bool:
        return self.phase in LONG_PHASES or (self.first_step and self.phase != "shutdown")


@dataclass(frozen=True)
class HangReport:
    """A stalled rank, as the watcher found it."""

    rank: int
    host: str
    pid: int
    step: int
    phase: str
    idle_s: float  # since its main thread last moved
    runs: bool  # its process still runs (only its main thread is stuck)
    allowance_s: float
    stacks: str  # where the ranks that run write their stacks

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)


def hang_line(report: HangReport) -> str:
    """The job's last line: which rank, where, at which step and phase, and where the stacks are."""
    if report.runs:
        stacks = f"its main thread has not moved; the Python stacks of every rank, its own included: {report.stacks}"
    else:
        stacks = (
            "its process does not run (stopped, or its node is gone), so it wrote no stack; the other ranks' "
            f"Python stacks: {report.stacks}"
        )
    return (
        f"rank {report.rank} (host {report.host}, pid {report.pid}) stalled at step {report.step} in "
        f"{report.phase}: no progress for {report.idle_s:.0f} s (allowance {report.allowance_s:.0f} s, "
        f"training.hang_timeout_s / hang_long_phase_s); {stacks}; rerun the command to resume from the last "
        "complete checkpoint"
    )


def find_stall(
    records: dict[int, dict], now: float, hang_timeout_s: float, hang_long_phase_s: float
) -> tuple[int, float, bool] | None:
    """(stalled rank, its allowance, whether its process runs) from every rank's last record, or
    None while the job moves (see the module's two rules). A record is ``{"written_at", "at",
    "long", "state"}`` (times in seconds since the epoch); ranks that have exited are left out."""
    running = {rank: r for rank, r in records.items() if r.get("state") != "exited"}
    if not running:
        return None
    silent = [rank for rank, r in running.items() if now - r["written_at"] > hang_timeout_s]
    if silent:
        rank = min(silent, key=lambda rank: (running[rank]["at"], rank))
        return rank, hang_timeout_s, False
    allowance = hang_long_phase_s if any(r["long"] for r in running.values()) else hang_timeout_s
    allowance = max(allowance, hang_timeout_s)
    if now - max(r["at"] for r in running.values()) <= allowance:
        return None
    rank = min(running, key=lambda rank: (running[rank]["at"], rank))
    return rank, allowance, True


def _where(record: dict) -> str:
    return (
        f"rank {record.get('rank')} (host {record.get('host', '?')}, pid {record.get('pid', '?')}; last seen at step "
        f"{record.get('step', 0)} in {record.get('phase', 'start-up')})"
    )


def previous_job_failure(run_dir: Path) -> str | None:
    """How the job that ran last in ``run_dir`` ended, from its progress records (read before
    :func:`clear_progress`): the rank the watchdog found stalled; else the ranks whose record was
    never closed (they died without a word: killed, their node gone); else the first rank that
    failed, with its reason; None when every rank finished, or there are no records."""
    directory = Path(run_dir) / PROGRESS_DIR
    stalled = _read_json(directory / MARKER)
    if stalled is not None:
        return f"{_where(stalled)} stalled (no progress for {_number(stalled.get('idle_s')):.0f} s)"
    records = [r for r in (_read_json(p) for p in sorted(directory.glob("rank_*.json"))) if r]
    unclosed = [r for r in records if r.get("state") == "running"]
    if unclosed:
        return "; ".join(_where(r) for r in unclosed) + " stopped without a word"
    failed = sorted(
        (r for r in records if r.get("failure")), key=lambda r: (_number(r.get("written_at")), _number(r.get("rank")))
    )
    if failed:
        return f"{_where(failed[0])} failed: {failed[0]['failure']}"
    return None


def clear_progress(run_dir: Path) -> None:
    """Remove a previous job's records (rank 0, before any rank's watchdog starts)."""
    directory = Path(run_dir) / PROGRESS_DIR
    if directory.is_dir():
        for path in directory.iterdir():
            with contextlib.suppress(OSError):
                path.unlink()


def _record_path(directory: Path, rank: int) -> Path:
    return directory / f"rank_{rank:05d}.json"


def _read_json(path: Path) -> dict | None:
    """A record, or None: not written yet, a reader on a file system without atomic rename, or a
    file that is no record (a record is only ever a notice's source: never worth a traceback)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def report_hang(line: str, detected_here: bool) -> None:
    """Say that the hang watchdog ends this rank (from its thread, before ``os._exit``): the error
    file for the launcher on every rank; on the terminal, the rank that found the stall says it (the
    stalled rank may be rank 0), unless the agent of ``train --nproc`` says it once for all."""
    write_error_file(line, line, ExitStatus.HANG)
    under_agent = os.environ.get(WORKER_LOGS_ENV) and "RANK" in os.environ
    if detected_here and not under_agent:
        print(error_line(line), file=sys.stderr, flush=True)
    sys.stdout.flush()


class Watchdog:
    """This rank's reporter, and on the first and last rank the watcher (see the module).

    ``stacks_dir``: where every rank that runs writes its stacks when a stall is found (the launch's
    log directory). ``exit``: how the process ends once it has said so (``os._exit``: the main thread
    may be stuck in a collective, so nothing can unwind it). ``active``: whether the job it watches
    still exists (its process groups): a watchdog whose job was torn down without :meth:`stop` ends."""

    def __init__(
        self,
        progress: Progress,
        run_dir: Path,
        rank: int,
        world_size: int,
        hang_timeout_s: float,
        hang_long_phase_s: float,
        stacks_dir: Path,
        report: Callable[[str, bool], None] = report_hang,
        exit: Callable[[int], None] = os._exit,
        active: Callable[[], bool] = lambda: True,
    ) -> None:
        self.progress, self.rank, self.world_size = progress, rank, world_size
        self.timeout, self.long_phase = float(hang_timeout_s), float(hang_long_phase_s)
        self.directory = Path(run_dir) / PROGRESS_DIR
        self.stacks_dir, self.report, self.exit, self.active = Path(stacks_dir), report, exit, active
        # Often enough that a stall is found within a few seconds of its allowance and that every
        # rank sees the marker before the launcher's SIGTERM-to-SIGKILL window (30 s) ends.
        self.interval = max(0.2, min(5.0, self.timeout / 6))
        self.watcher = rank in (0, world_size - 1)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.started = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._write("running")
        self._thread = threading.Thread(target=self._loop, name="parallel-latent-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self, failure: str | None = None) -> None:
        """This rank is done, or failing by itself (``failure``: its one line, which its record keeps
        for the restart that follows): leave it out of the watch from now on."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)
            self._thread = None
            with contextlib.suppress(OSError):
                self._write("exited", failure)

    def _write(self, state: str, failure: str | None = None) -> None:
        p = self.progress
        record = {
            "rank": self.rank, "host": self.host, "pid": self.pid, "step": p.step, "phase": p.phase, "at": p.at,
            "long": p.long, "written_at": time.time(), "state": state, "failure": failure,
        }  # fmt: skip
        replace_file(_record_path(self.directory, self.rank), json.dumps(record))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            if not self.active():
                return
            try:
                self._write("running")
                found = _read_json(self.directory / MARKER)
                if found is None and self.watcher:
                    found = self._watch()
                if found is not None:
                    self._end(HangReport(**found), detected_here=False)
                    return
            except OSError:
                continue  # a file system hiccup: the next round tries again

    def _records(self) -> dict[int, dict]:
        records = {}
        for rank in range(self.world_size):
            record = _read_json(_record_path(self.directory, rank))
            # A rank not heard of yet counts from this watch's start, in its start-up.
            records[rank] = record or {"written_at": self.started, "at": self.started, "long": True, "state": ""}
        return records

    def _watch(self) -> dict | None:
        records = self._records()
        now = time.time()
        # This process runs the watch, so its own record is not silent, however late a loaded machine
        # scheduled this thread after it wrote it: only its main thread's progress ("at") is judged.
        records[self.rank] = {**records[self.rank], "written_at": now}
        stall = find_stall(records, now, self.timeout, self.long_phase)
        if stall is None:
            return None
        rank, allowance, runs = stall
        record = records[rank]
        report = HangReport(
            rank=rank, host=record.get("host", "?"), pid=int(record.get("pid", 0)), step=int(record.get("step", 0)),
            phase=str(record.get("phase", "start-up")), idle_s=now - record["at"], runs=runs,
            allowance_s=allowance, stacks=str(self.stacks_dir),
        )  # fmt: skip
        replace_file(self.directory / MARKER, report.to_json())
        self._end(report, detected_here=True)
        return None  # (not reached: _end exits)

    def _end(self, report: HangReport, detected_here: bool) -> None:
        """Write this rank's stacks, say the line, exit with the hang status."""
        stacks_dir = Path(report.stacks)  # the watcher's choice, the same for every rank
        with contextlib.suppress(OSError):
            stacks_dir.mkdir(parents=True, exist_ok=True)
            with open(stacks_dir / f"stack_rank{self.rank}.txt", "w", encoding="utf-8") as stacks:
                faulthandler.dump_traceback(stacks, all_threads=True)
        if detected_here:
            # The others see the marker within one interval: give them the time to write theirs
            # before this exit makes the launcher tear the job down.
            time.sleep(math.ceil(self.interval) + 1.0)
        self.report(hang_line(report), detected_here)
        self.exit(int(ExitStatus.HANG))


@contextlib.contextmanager
def bounded_phase(phase: str, allowance_s: float, key: str, undo: Callable[[], None]) -> Iterator[None]:
    """A phase of one process that no rank's watchdog covers yet (the launcher's acceptance of a
    job: reading the checkpoint whole, the decoder's files, a download): past ``allowance_s`` (0:
    unbounded) it runs ``undo`` (what the phase took, given back) and ends the process with one line
    naming the phase, ``key`` and the code its main thread was stuck in, exit status 5."""
    if allowance_s <= 0:
        yield
        return
    main = threading.main_thread()

    def expire() -> None:
        frame = sys._current_frames().get(main.ident)
        where = f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})" if frame else "unknown"
        with contextlib.suppress(Exception):
            undo()
        line = f"{phase}: not done within {allowance_s:g} s ({key}); its main thread was at {where}"
        print(error_line(line), file=sys.stderr, flush=True)
        os._exit(ExitStatus.HANG)

    timer = threading.Timer(allowance_s, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
