"""One training job per run directory: ``RUN/train.lock``.

Two jobs on one run directory (a second launch, a scheduler that requeues a job whose first instance
still runs) would both move ``latest`` and interleave ``metrics.jsonl``. The first process of a
``train`` (the ``--nproc`` launcher, or rank 0 under another launcher) takes the lock before any
work; a second ``train`` stops with one line naming the holder (host, pid, start time), or waits up
to ``--wait-for-lock SECONDS`` first.

The lock is an ``flock`` on the file, which the kernel (or the NFS server, after its lease) releases
when the holder dies however it dies: a rerun after kill -9, preemption or a dead node never needs a
manual unlock, and says in one line that it took over. Where the file system has no ``flock``, the
holder instead renews a lease in the file every :data:`LEASE_RENEW_S` seconds, and a lease not
renewed for :data:`LEASE_EXPIRES_S` is taken over. The file records its holder either way.
Read-only commands (``evaluate``, ``plot``, ``inspect``, ``save-pretrained``, ...) neither take nor
respect it. Nothing here imports torch: the command line takes it before any rank starts.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from parallel_latent.errors import BadInput

__all__ = ["HELD_BY_LAUNCHER_ENV", "LOCK_FILE", "RunDirLocked", "RunLock", "acquire_run_lock"]

LOCK_FILE = "train.lock"
# Set by ``train --nproc`` for its ranks: the lock file its own process holds for them.
HELD_BY_LAUNCHER_ENV = "PARALLEL_LATENT_RUN_LOCK"
LEASE_RENEW_S = 10.0
LEASE_EXPIRES_S = 60.0
NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunDirLocked(BadInput):
    """Another training job holds the run directory."""


def _holder_words(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, int | float) else "?"
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {when}"


class RunLock:
    """The lock of one run directory, held by this process until :meth:`release`."""

    def __init__(self, run_dir: Path, use_flock: bool = True, notice: Callable[[str], None] = print):
        self.run_dir, self.path = Path(run_dir), Path(run_dir) / LOCK_FILE
        self.use_flock, self.notice = use_flock, notice
        self.holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "state": "held"}
        self.created_file = False
        self._fd: int | None = None
        self._lease_stop = threading.Event()
        self._lease_thread: threading.Thread | None = None

    def _read_holder(self) -> dict:
        with contextlib.suppress(OSError, ValueError):
            holder = json.loads(self.path.read_text(encoding="utf-8") or "{}")
            if isinstance(holder, dict):
                return holder
        return {}

    def _write_holder(self) -> None:
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(self.holder).encode(), 0)
        os.fsync(self._fd)

    def try_acquire(self) -> dict | None:
        """Take the lock now: None when taken, else the holder's record."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.created_file = self.created_file or not self.path.exists()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if self.use_flock:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return self._read_holder() or {"host": "?"}
            except OSError as error:
                if error.errno not in NO_FLOCK:
                    os.close(fd)
                    raise
                self.use_flock = False  # this file system has no flock: a lease instead
        previous = self._read_holder()
        if not self.use_flock and previous.get("state") == "held":
            renewed = previous.get("renewed", previous.get("started", 0))
            if time.time() - float(renewed) < LEASE_EXPIRES_S:
                os.close(fd)
                return previous
        self._fd = fd
        if previous.get("state") == "held":
            self.notice(
                f"{self.run_dir}: took over the lock of a training job that is gone ({_holder_words(previous)})"
            )
        self.holder["renewed"] = time.time()
        self._write_holder()
        if not self.use_flock:
            self._lease_thread = threading.Thread(target=self._renew, name="parallel-latent-run-lock", daemon=True)
            self._lease_thread.start()
        return None

    def _renew(self) -> None:
        while not self._lease_stop.wait(LEASE_RENEW_S):
            with contextlib.suppress(OSError):
                self.holder["renewed"] = time.time()
                self._write_holder()

    def release(self, remove: bool = False) -> None:
        """Give the lock up (its record says so); ``remove``: delete the file too if this lock made
        it (a start that failed on bad input leaves nothing behind)."""
        if self._fd is None:
            return
        self._lease_stop.set()
        if self._lease_thread is not None:
            self._lease_thread.join(timeout=5)
        with contextlib.suppress(OSError):
            self.holder["state"] = "released"
            self._write_holder()
        if remove and self.created_file:
            self.path.unlink(missing_ok=True)
        os.close(self._fd)  # (releases the flock)
        self._fd = None


def acquire_run_lock(
    run_dir: str | Path, wait_s: float = 0.0, notice: Callable[[str], None] = print, use_flock: bool = True
) -> RunLock:
    """The run directory's lock, taken by this process (waiting up to ``wait_s`` seconds for a
    holder to end); :class:`RunDirLocked` (one line naming the holder) if another job keeps it."""
    lock = RunLock(Path(run_dir), use_flock=use_flock, notice=notice)
    deadline = time.monotonic() + max(0.0, wait_s)
    while (holder := lock.try_acquire()) is not None:
        if time.monotonic() >= deadline:
            waited = f" after waiting {wait_s:g} s" if wait_s else ""
            raise RunDirLocked(
                f"{lock.run_dir}: another training job holds this run directory{waited} ({_holder_words(holder)}; "
                f"{lock.path}); let it finish, stop it, or give --wait-for-lock SECONDS"
            )
        time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
    return lock
