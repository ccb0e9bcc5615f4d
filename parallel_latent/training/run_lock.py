"""One training job per run directory: ``RUN/train.lock``.

Two jobs on one run directory (a second launch, a scheduler that requeues a job whose first instance
still runs) would both move ``latest`` and interleave ``metrics.jsonl``. The first process of a
``train`` (the ``--nproc`` launcher, or rank 0 under another launcher) takes the lock before any
work; a second ``train`` stops with one line naming the holder (host, pid, start time), or waits up
to ``--wait-for-lock SECONDS`` first.

The lock is :class:`parallel_latent.files.ExclusiveLock`: an ``flock``, released by the kernel when
the holder dies however it dies (a rerun after kill -9, preemption or a dead node never needs a manual
unlock, and says in one line that it took over), or a renewed lease where the file system has no
``flock``. Read-only commands (``evaluate``, ``plot``, ``inspect``, ``save-pretrained``, ...) neither
take nor respect it. Nothing here imports torch: the command line takes it before any rank starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from parallel_latent.errors import BadInput
from parallel_latent.files import LEASE_EXPIRES_S, ExclusiveLock

__all__ = ["HELD_BY_LAUNCHER_ENV", "LEASE_EXPIRES_S", "LOCK_FILE", "RunDirLocked", "RunLock", "acquire_run_lock"]

LOCK_FILE = "train.lock"
# Set by ``train --nproc`` for its ranks: the lock file its own process holds for them.
HELD_BY_LAUNCHER_ENV = "PARALLEL_LATENT_RUN_LOCK"


class RunDirLocked(BadInput):
    """Another training job holds the run directory."""


def _holder_words(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, int | float) else "?"
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {when}"


class RunLock(ExclusiveLock):
    """The lock of one run directory, held by this process until :meth:`release`."""

    def __init__(self, run_dir: Path, use_flock: bool = True, notice: Callable[[str], None] = print):
        self.run_dir = Path(run_dir)
        super().__init__(
            self.run_dir / LOCK_FILE,
            use_flock,
            on_takeover=lambda previous: notice(
                f"{self.run_dir}: took over the lock of a training job that is gone ({_holder_words(previous)})"
            ),
        )

    def try_acquire(self) -> dict | None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        return super().try_acquire()


def acquire_run_lock(
    run_dir: str | Path, wait_s: float = 0.0, notice: Callable[[str], None] = print, use_flock: bool = True
) -> RunLock:
    """The run directory's lock, taken by this process (waiting up to ``wait_s`` seconds for a
    holder to end); :class:`RunDirLocked` (one line naming the holder) if another job keeps it."""
    lock = RunLock(Path(run_dir), use_flock=use_flock, notice=notice)
    holder = lock.acquire(wait_s)
    if holder is not None:
        waited = f" after waiting {wait_s:g} s" if wait_s else ""
        raise RunDirLocked(
            f"{lock.run_dir}: another training job holds this run directory{waited} ({_holder_words(holder)}; "
            f"{lock.path}); let it finish, stop it, or give --wait-for-lock SECONDS"
        )
    return lock
