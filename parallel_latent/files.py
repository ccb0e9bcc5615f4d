"""Durable files: fsync, publish a file or a directory by one atomic rename, stage a directory that is
published whole or not at all, replace a small file atomically, read a JSONL log, and hold an
exclusive lock on a file.

Used by the checkpoints, the prepared corpus copies, the latent export, the run directory's lock and
the hang watchdog: whatever a reader finds under its final name is complete, and stays so after a
crash of the machine. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from parallel_latent.errors import BadInput

__all__ = [
    "JSON_MAX_BYTES",
    "JSON_MAX_DEPTH",
    "LEASE_EXPIRES_S",
    "LEASE_RENEW_S",
    "ExclusiveLock",
    "JSONProblem",
    "Staged",
    "discard",
    "fsync",
    "inside",
    "link_problem",
    "load_json_file",
    "parse_json",
    "publish",
    "read_jsonl",
    "replace_file",
]


def inside(directory: Path, name: str, what: str) -> Path:
    """``directory / name`` for a ``name`` that a file of ``directory`` records (a manifest's shard):
    refused (ValueError, one line) when it is absolute or climbs with ``..``. Directories are
    downloaded from hubs: what they name must stay in them. (Links are followed: a Hugging Face
    cache's snapshot is links into its blob store.)"""
    if not name or Path(name).is_absolute() or ".." in Path(name).parts or "\\" in name:
        raise ValueError(f"{directory}: {what} names {name!r}, which is not a file inside the directory; not read")
    return Path(directory) / name


def link_problem(directory: Path, what: str) -> str | None:
    """The first link under ``directory`` that loops or resolves outside it, said in one line
    (``what`` names the directory: "the checkpoint's directory"), or None: a directory that must be
    self-contained (a checkpoint, a model) names its files inside it, and the file system must not
    lead elsewhere either. The one exception is a Hugging Face cache snapshot
    (``.../snapshots/REV``), whose files are links into the repository's ``blobs/``."""
    try:
        root = Path(directory).resolve()
    except (RuntimeError, OSError):
        return f"{directory}: a symbolic link loop"
    blobs = root.parent.parent / "blobs" if root.parent.name == "snapshots" else None
    for folder, folders, files in os.walk(directory):  # (never follows links: a loop cannot trap it)
        for name in sorted(folders + files):
            path = Path(folder) / name
            if not path.is_symlink():
                continue
            try:
                target = path.resolve(strict=True)
            except (RuntimeError, OSError) as error:
                if isinstance(error, FileNotFoundError):
                    return f"{path}: a link to {os.readlink(path)}, which does not exist"
                return f"{path}: a symbolic link loop"
            if not (target.is_relative_to(root) or (blobs is not None and target.is_relative_to(blobs))):
                return f"{path}: a link to {target}, outside {what}"
    return None


def fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to the disk. A file system that cannot fsync a
    directory says EINVAL: nothing to flush there."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP) or not path.is_dir():
            raise
    finally:
        os.close(fd)


def replace_file(path: Path, text: str) -> None:
    """Replace the small file ``path`` atomically: readers see the old or the new, never a mix."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        temporary.write_text(text, encoding="utf-8")
        fsync(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    fsync(path.parent)


def publish(staging: Path, final: Path) -> None:
    """Make ``staging`` (a file, or every file under a directory) durable, here and nowhere else, then
    rename it to the new ``final`` in one atomic step."""
    if staging.is_dir():
        # safetensors creates its files 0600; checkpoints and exports are read by other users of a
        # shared file system, so every file gets the mode the umask gives this directory's files.
        mode = staging.stat().st_mode & 0o666
        for root, _, names in os.walk(staging):
            for name in names:
                os.chmod(Path(root, name), mode)
                fsync(Path(root, name))
            fsync(Path(root))
    else:
        fsync(staging)
    os.rename(staging, final)
    fsync(final.parent)


def tree_bytes(path: Path) -> int:
    """The bytes of the files under ``path`` (a file: its own)."""
    path = Path(path)
    if not path.is_dir():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def discard(path: Path) -> None:
    """Remove whatever is left of a staging file or directory."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class Staged:
    """A new, empty staging directory for ``final`` (``staging``, by default ``.<name>.partial``
    beside it): filled inside ``with``, then :meth:`publish`\\ ed by one rename; it is removed if the
    block raises or the publish fails. Creating it raises what the file system says (a file in the
    way of the output is the caller's error)."""

    def __init__(self, final: Path, staging: Path | None = None):
        self.final = Path(final)
        self.path = Path(staging) if staging is not None else self.final.with_name(f".{self.final.name}.partial")
        discard(self.path)
        self.path.mkdir(parents=True)

    def publish(self) -> None:
        try:
            publish(self.path, self.final)
        except BaseException:
            discard(self.path)
            raise

    def __enter__(self) -> Staged:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is not None:
            discard(self.path)


# What a JSON file a job reads may hold (a checkpoint's record, a client state, a decoder's config, a
# manifest, a safetensors header): parsed only within these bounds, so that a crafted or damaged
# file ends in one line, never in a RecursionError, a MemoryError or a NaN that training reads.
JSON_MAX_BYTES = 64 << 20
JSON_MAX_DEPTH = 64


class JSONProblem(BadInput):
    """Why a JSON text is refused (one line, without the file's name)."""


def _refuse_constant(name: str):
    raise JSONProblem(f"holds {name}, which is no number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise JSONProblem(f"holds the number {text[:40]}, out of a float's range")
    return value


def parse_json(text: str | bytes, max_depth: int = JSON_MAX_DEPTH) -> Any:
    """``text`` parsed, or JSONProblem (one line): not JSON, NaN or infinities, a number out of
    range, or nesting deeper than ``max_depth``."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise JSONProblem(f"nested deeper than {max_depth} levels") from None
    except JSONProblem:
        raise
    except json.JSONDecodeError as error:
        at = f"column {error.colno}" if error.lineno == 1 else f"line {error.lineno}, column {error.colno}"
        raise JSONProblem(f"invalid JSON: {error.msg} ({at})") from None
    except UnicodeDecodeError:
        raise JSONProblem("not readable JSON (not UTF-8 text)") from None
    except ValueError as error:  # (an integer of more digits than Python converts)
        raise JSONProblem(f"not readable JSON ({str(error).splitlines()[0][:80]})") from None
    stack = [(value, 1)]
    while stack:  # iterative: the depth check itself must not recurse
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > max_depth:
                raise JSONProblem(f"nested deeper than {max_depth} levels")
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return value


def load_json_file(path: str | Path, max_bytes: int = JSON_MAX_BYTES) -> Any:
    """The JSON file ``path`` parsed within the bounds above; JSONProblem naming the file otherwise
    (OSErrors pass: a missing file is the caller's to say)."""
    path = Path(path)
    if (size := path.stat().st_size) > max_bytes:
        raise JSONProblem(f"{path}: {size} bytes, more than the {max_bytes} a JSON file here may hold")
    try:
        return parse_json(path.read_bytes())
    except JSONProblem as problem:
        raise JSONProblem(f"{path}: {problem}") from None


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSONL file written by appends (a torn last line, from a killed writer, is
    ignored)."""
    records = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


# --------------------------------------------------------------------------- #
# An exclusive lock on a file.
# --------------------------------------------------------------------------- #

LEASE_RENEW_S = 10.0
LEASE_EXPIRES_S = 60.0
# What a file system without flock says (some network file systems).
NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def _could_hold(holder: dict) -> bool:
    """Whether a lock file's record can be the holder's: held, by a process that is not gone."""
    if holder.get("state") != "held":
        return False
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return True  # (another host's process cannot be looked at)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # (alive, another user's)
    return True


class ExclusiveLock:
    """An exclusive lock on the file ``path``, held by this process until :meth:`release`.

    It is an ``flock``, which the kernel (or the NFS server, after its lease) releases when the
    holder dies however it dies: a rerun after kill -9 never needs a manual unlock. Where the file
    system has no ``flock``, the holder instead renews a lease in the file every
    :data:`LEASE_RENEW_S` seconds, and a lease not renewed for :data:`LEASE_EXPIRES_S` is taken over.
    The file records its holder (host, pid, start time) either way; ``on_takeover(previous)`` hears
    of a holder that died holding it."""

    def __init__(self, path: Path, use_flock: bool = True, on_takeover: Callable[[dict], None] | None = None) -> None:
        self.path, self.use_flock, self.on_takeover = Path(path), use_flock, on_takeover
        self.holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "state": "held"}
        self.created_file = False
        self.found: bytes = b""  # the file's bytes when this lock took it: what undo puts back
        self.found_times: tuple[int, int] | None = None  # its (atime, mtime) in ns, or its directory's
        self._fd: int | None = None
        self._lease_stop = threading.Event()
        self._lease_thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def read_holder(self) -> dict:
        with contextlib.suppress(OSError, ValueError):
            holder = json.loads(self.path.read_text(encoding="utf-8") or "{}")
            if isinstance(holder, dict):
                return holder
        return {}

    def _write_holder(self) -> None:
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(self.holder).encode(), 0)
        os.fsync(self._fd)

    def _flock(self, fd: int) -> bool:
        """Whether the flock is taken (False: someone holds it); no flock here switches to the lease."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as error:
            if error.errno not in NO_FLOCK:
                raise
            self.use_flock = False
        return True

    def try_acquire(self) -> dict | None:
        """Take the lock now: None when taken, else the holder's record."""
        self.created_file = self.created_file or not self.path.exists()
        before = self.path.parent.stat() if self.created_file else None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            taken = not self.use_flock or self._flock(fd)
        except OSError:
            os.close(fd)
            raise
        if not taken:
            os.close(fd)
            return self._holder_of_the_flock()
        previous = self.read_holder()
        found = self.path.read_bytes()
        stat = before or os.fstat(fd)
        if not self.use_flock and previous.get("state") == "held":
            renewed = previous.get("renewed", previous.get("started", 0))
            if time.time() - float(renewed) < LEASE_EXPIRES_S:
                os.close(fd)
                return previous
        self._fd, self.found = fd, found
        if self.found_times is None:
            self.found_times = (stat.st_atime_ns, stat.st_mtime_ns)
        if previous.get("state") == "held" and self.on_takeover is not None:
            self.on_takeover(previous)
        self.holder["renewed"] = time.time()
        self._write_holder()
        if not self.use_flock:
            self._lease_thread = threading.Thread(target=self._renew, name="parallel-latent-lease", daemon=True)
            self._lease_thread.start()
        return None

    def _holder_of_the_flock(self) -> dict:
        """The record of the process that holds the flock. It writes its record right after taking
        the flock: until then the file holds the job's before it (released, or of a process of this
        host that is gone), which is read again for up to a second rather than named."""
        deadline = time.monotonic() + 1.0
        while not _could_hold(holder := self.read_holder()) and time.monotonic() < deadline:
            time.sleep(0.02)
        return holder or {"host": "?"}

    def acquire(self, wait_s: float = 0.0) -> dict | None:
        """Take the lock, waiting up to ``wait_s`` seconds (``math.inf``: as long as it takes) for a
        holder to end: None when taken, else the holder's record."""
        deadline = time.monotonic() + max(0.0, wait_s)
        while (holder := self.try_acquire()) is not None:
            if time.monotonic() >= deadline:
                return holder
            time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
        return None

    def _renew(self) -> None:
        while not self._lease_stop.wait(LEASE_RENEW_S):
            with contextlib.suppress(OSError):
                self.holder["renewed"] = time.time()
                self._write_holder()

    def release(self, undo: bool = False) -> None:
        """Give the lock up (its record says so); ``undo`` (a job refused before it began): leave the
        file as this lock found it, deleted if this lock made it, else its bytes put back, and its
        (or its directory's) modification time too: a refused job leaves the tree as it was."""
        if self._fd is None:
            return
        self._lease_stop.set()
        if self._lease_thread is not None:
            self._lease_thread.join(timeout=5)
        with contextlib.suppress(OSError):
            self.holder["state"] = "released"
            self._write_holder()
            if undo and not self.created_file:
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, self.found, 0)
                os.fsync(self._fd)
                os.utime(self._fd, ns=self.found_times)
        if undo and self.created_file:
            self.path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                os.utime(self.path.parent, ns=self.found_times)
        os.close(self._fd)  # (releases the flock)
        self._fd = None
