"""Start a job's ranks on this machine (``train --nproc N``, ``encode-corpus --nproc N``) and
watch them to the end: torchrun through the agent (:mod:`.agent`), in its own session, that dies
with this process; a terminal's Ctrl-C forwarded to the ranks themselves.

Torch-free: the launcher itself never loads torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from parallel_latent.errors import ExitStatus

from .worker_logs import WORKER_LOGS_ENV, close_worker_logs, mark_stop, open_worker_logs

__all__ = ["launch_local", "torchrun_command"]

AGENT_MODULE = "parallel_latent.launching.agent"  # what `python -m` runs: the agent of the local job


def torchrun_command(nproc: int, argv: list[str], max_restarts: int = 0) -> list[str]:
    """torchrun through the agent of :mod:`.agent` (one line per failure), which restarts the ranks
    up to ``max_restarts`` times when one fails."""
    return [
        sys.executable,
        "-m",
        AGENT_MODULE,
        "--standalone",
        f"--nproc_per_node={nproc}",
        f"--max-restarts={max_restarts}",
        "-m",
        "parallel_latent",
        *argv,
    ]


def _children(pid: int) -> list[int]:
    """Direct child processes of ``pid`` (Linux /proc scan; empty elsewhere)."""
    children = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            children.append(int(entry.name))
    return children


def _die_with_parent() -> None:
    """preexec_fn: the launched torchrun gets SIGTERM if this process dies (Linux only)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def launch_local(
    nproc: int,
    argv: list[str],
    run_dir: Path,
    lock=None,
    run_dir_existed: bool | None = None,
    max_restarts: int = 0,
    rank_env: dict[str, str] | None = None,
) -> int:
    """Run ``argv`` as ``nproc`` ranks on this machine under torchrun; return the exit status of
    the first rank that failed (0 if none did).

    torchrun runs in its own session so a terminal's Ctrl-C reaches only this process, which
    forwards SIGTERM to the ranks themselves (not to the torchrun agent): they finish the step,
    write a checkpoint and exit 0, and torchrun then exits 0 as well.  (Signalling the agent
    instead makes it tear the ranks down and exit non-zero.)  A second Ctrl-C kills the ranks.

    Rank 0 keeps the terminal; the other ranks, torchrun's messages and any traceback go to
    ``RUN_DIR/logs/<time>/`` (see :mod:`.worker_logs`), and a failure ends with its one line
    (:mod:`.reports`). Bad input (status 2) leaves no logs behind, nor a run directory made only for
    them.

    ``lock``: the run directory's (:mod:`parallel_latent.training.run_lock`), held for the ranks (across
    restarts), then released; ``rank_env`` tells the ranks so (with any other variables they need).
    ``max_restarts``: how often torchrun restarts every rank when one fails; each restart resumes
    from the newest complete checkpoint, and says so in one line.
    """
    log_dir, existed = open_worker_logs(run_dir)
    env = {**os.environ, WORKER_LOGS_ENV: str(log_dir.resolve()), **(rank_env or {})}
    # One compute thread per rank unless told otherwise: ranks share the machine's cores.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    process = subprocess.Popen(
        torchrun_command(nproc, argv, max_restarts),
        env=env,
        start_new_session=True,
        # A single prctl() call, and this process has started no thread.
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,  # noqa: PLW1509
    )
    signals_seen = 0

    def forward(signum, frame):
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen == 1:  # before the ranks hear of it: the agent reads it
            mark_stop(log_dir, interrupted=signum == signal.SIGINT)
        ranks = _children(process.pid)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM if signals_seen == 1 else signal.SIGKILL)
        if not ranks:  # not Linux, or the ranks have not started yet: the agent handles it
            process.send_signal(signal.SIGTERM)
        elif signals_seen > 1:  # the user asked for it: no report of ranks "killed by SIGKILL"
            process.kill()

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                status = process.wait()
                break
            except InterruptedError:
                continue
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if lock is not None:
            lock.release(undo=process.returncode == ExitStatus.BAD_INPUT)
    close_worker_logs(log_dir, existed if run_dir_existed is None else run_dir_existed, status, ExitStatus.BAD_INPUT)
    return 128 - status if status < 0 else status  # killed by a signal: the shell's convention
