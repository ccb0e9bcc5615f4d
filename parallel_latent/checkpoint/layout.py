"""Where checkpoints live and how they become visible.

A run keeps its training checkpoints in ``<run_dir>/checkpoints/``::

    latest                       # the tag of the newest complete checkpoint ("step_00000020")
    step_00000020/
      checkpoint.json            # layout (TP, DP, ZeRO stage, precision), step, tensor table; written last
      client_state.json          # the trainer's state (data position, ...), engine counters, LR schedule
      rng/rank_00000.json ...    # every RNG of every rank (JSON, no pickle)
      mp_rank_00_model_states.pt, zero_pp_rank_0_mp_rank_00_optim_states.pt, ...   (DeepSpeed)
      model/                     # portable weights (manifest.json + safetensors per TP rank)
      universal/                 # layout-free fp32 weights + Adam moments (made when resharding)
    .tmp-step_00000030/          # a save in progress, or one that died: never `latest`

Everything is written into a staging directory, fsynced, and made visible whole by one rename
(:func:`publish`); ``latest`` moves only afterwards, atomically too, so a save that fails or is
killed at any point leaves the earlier checkpoints and ``latest`` as they were.
"""

import contextlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from parallel_latent.coordination import broadcast_value, first_failure, is_main
from parallel_latent.errors import CheckpointError, ExitStatus, first_line, require_writable
from parallel_latent.files import JSONProblem, Staged, discard, load_json_file, publish, replace_file

logger = logging.getLogger(__name__)
T = TypeVar("T")

RUN_CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
TAG_PATTERN = re.compile(r"^step_(\d{8,})$")
STAGING_PREFIX = ".tmp-"
REPLACED_PREFIX = ".replaced-"
DAMAGED_PREFIX = ".damaged-"  # a damaged checkpoint moved aside (:func:`.integrity.move_aside`)
INFO_FILE = "checkpoint.json"
CLIENT_STATE_FILE = "client_state.json"
RNG_DIR = "rng"
PORTABLE_DIR = "model"
UNIVERSAL_DIR = "universal"
MANIFEST_NAME = "manifest.json"


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, an I/O error, no permission): nothing was
    published; the message is one line."""

    exit_status = ExitStatus.SAVE_FAILED


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / RUN_CHECKPOINTS_DIR


def checkpoint_tag(step: int) -> str:
    return f"step_{step:08d}"


def error_reason(error: BaseException) -> str:
    """One line saying why a write failed: the OS's words for an OSError or for the safetensors
    library's ``(os error 28)``, else the message's first line."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    if os_error := re.search(r"\(os error (\d+)\)", str(error)):
        return os.strerror(int(os_error.group(1)))
    return first_line(error)


def read_json(path: Path, what: str) -> Any:
    try:
        return load_json_file(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {what} missing") from None
    except JSONProblem as problem:
        raise CheckpointError(f"{problem} ({what})") from None
    except OSError as error:
        raise CheckpointError(f"{path}: unreadable {what} ({error})") from None


def read_info(step_dir: Path) -> dict[str, Any]:
    if not (step_dir / INFO_FILE).is_file():
        raise CheckpointError(f"{step_dir}: {INFO_FILE} missing (not a complete training checkpoint)")
    return read_json(step_dir / INFO_FILE, "checkpoint info")


def is_complete(step_dir: Path) -> bool:
    """A step directory of its own run (a plain directory, never a link) whose save was published."""
    return (
        TAG_PATTERN.match(step_dir.name) is not None and not step_dir.is_symlink() and (step_dir / INFO_FILE).is_file()
    )


def step_of(step_dir: Path) -> int:
    return int(TAG_PATTERN.match(step_dir.name).group(1))


def list_checkpoints(checkpoint_dir: str | Path) -> list[Path]:
    """Complete checkpoints under ``checkpoint_dir``, oldest first."""
    return sorted((p for p in Path(checkpoint_dir).glob("step_*") if p.is_dir() and is_complete(p)), key=step_of)


def linked_steps(checkpoint_dir: str | Path) -> list[tuple[Path, str]]:
    """The entries of ``checkpoint_dir`` named as step directories that are links (out of the run,
    to another of its checkpoints, or a loop), oldest first, each with the one line that says so:
    a run's checkpoints are plain directories of its own, and a link is never resumed from."""
    links = sorted(
        (p for p in Path(checkpoint_dir).glob("step_*") if TAG_PATTERN.match(p.name) and p.is_symlink()), key=step_of
    )
    return [(p, f"{p}: a link to {os.readlink(p)}, not a checkpoint directory of this run") for p in links]


def find_latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The newest complete checkpoint. ``latest`` names it unless a save was cut off between
    publishing its checkpoint and moving ``latest`` (then a newer complete one is there, and is it),
    or ``latest`` names one that is gone or incomplete."""
    checkpoint_dir = Path(checkpoint_dir)
    latest = checkpoint_dir / LATEST_FILE
    complete = list_checkpoints(checkpoint_dir)
    if latest.is_symlink():  # (a loop among them: is_file() would say False, and nothing would be said)
        raise CheckpointError(f"{latest}: a link to {os.readlink(latest)}, not the file a save writes; not read")
    if latest.is_file():
        tag = latest.read_text(encoding="utf-8").strip()
        if not TAG_PATTERN.match(tag):  # never a path: a tag names a checkpoint beside it, nothing else
            raise CheckpointError(f"{latest}: names {tag[:80]!r}, not a checkpoint directory beside it; not read")
        candidate = checkpoint_dir / tag
        if is_complete(candidate):
            if complete[-1] != candidate:
                logger.warning("%s names %s; %s is newer and complete: using it", latest, tag, complete[-1].name)
            return complete[-1]
        if not (checkpoint_dir / f"{DAMAGED_PREFIX}{tag}").exists():  # moved aside: the line that did it says so
            logger.warning(
                "%s names %s, which is not a complete checkpoint; using the newest complete one", latest, candidate.name
            )
    return complete[-1] if complete else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A training checkpoint from a path to it, to the directory holding ``latest``, or to a run."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint or run directory")
    if not path.is_dir():
        raise CheckpointError(f"{path}: is a file; expected a checkpoint or run directory")
    if path.name.startswith((STAGING_PREFIX, REPLACED_PREFIX)):
        raise CheckpointError(f"{path}: an unfinished save (never published); not loadable")
    if (path / INFO_FILE).is_file():
        return path
    if (path / RUN_CHECKPOINTS_DIR).is_dir():
        path = path / RUN_CHECKPOINTS_DIR
    found = find_latest_checkpoint(path)
    if found is None:
        raise CheckpointError(f"{path}: no complete training checkpoint here ({INFO_FILE} or {LATEST_FILE} missing)")
    return found


def resolve_portable_dir(path: str | Path) -> Path:
    """The portable directory of ``path``: itself, or the ``model/`` of the training checkpoint that
    :func:`resolve_checkpoint` finds there."""
    path = Path(path)
    if (path / MANIFEST_NAME).is_file():
        return path
    step_dir = resolve_checkpoint(path)
    if not (step_dir / PORTABLE_DIR / MANIFEST_NAME).is_file():
        raise CheckpointError(
            f"{step_dir}: saved without portable weights (checkpoint.export_portable was off); "
            f"run `parallel-latent export {step_dir} OUT` first"
        )
    return step_dir / PORTABLE_DIR


# A newest checkpoint that a running job prunes while it is being read is resolved this many times.
READ_ATTEMPTS = 3


def read_newest(path: str | Path, read: Callable[[Path], T]) -> T:
    """``read(resolve_portable_dir(path))``. Where ``path`` names a run or its checkpoints (not one
    checkpoint), a job that trains in it meanwhile may prune the checkpoint found before ``read`` has
    opened it (``checkpoint.keep_last``): the newest is then resolved again. A checkpoint that is
    still there when ``read`` fails is damaged, not pruned: its error is raised."""
    attempt = 1
    while True:
        directory = resolve_portable_dir(path)
        try:
            return read(directory)
        except (CheckpointError, OSError):
            pruned = not directory.exists() and Path(path) not in (directory, directory.parent)
            if not pruned or attempt == READ_ATTEMPTS:
                raise
        attempt += 1


def write_json(path: Path, data: Any, indent: int | None = 1) -> None:
    """A JSON file inside a staging directory (made durable when the directory is published)."""
    path.write_text(json.dumps(data, indent=indent) + "\n", encoding="utf-8")


def publish_checkpoint(checkpoint_dir: Path, staging: Path, tag: str) -> None:
    """Rank 0: publish the staging directory as ``tag``, then move ``latest``; on a failure, put
    back what was there."""
    final, replaced = checkpoint_dir / tag, checkpoint_dir / f"{REPLACED_PREFIX}{tag}-{os.getpid()}"
    if final.exists():
        # The same step saved again (e.g. a run resumed at its last step): the old copy is moved
        # aside, not deleted, until the new one is in place.
        os.rename(final, replaced)
    try:
        publish(staging, final)
        replace_file(checkpoint_dir / LATEST_FILE, tag + "\n")
    except BaseException:
        if final.exists() and not staging.exists():
            os.rename(final, staging)  # unpublished again; the caller removes it
        if replaced.exists():
            os.rename(replaced, final)
        raise
    discard(replaced)


def require_empty_output(output: Path) -> None:
    """Refuse an output directory that is a file or holds anything: outputs are never merged into."""
    if output.exists() and not output.is_dir():
        raise CheckpointError(f"{output}: exists and is a file; give a new or empty directory")
    if output.is_dir() and any(output.iterdir()):
        raise CheckpointError(f"{output}: exists and is not empty; not overwriting")
    require_writable(output, "output directory")


def partial(final: Path) -> Path:
    """Where a one-off output (an export, a consolidation) is staged before it is published."""
    return final.with_name(f".{final.name}.partial")


@contextlib.contextmanager
def staged(final: Path) -> Iterator[Path]:
    """A new, empty staging directory (:class:`parallel_latent.files.Staged`), published as ``final``
    when the block ends. For writers in one process: on a failure it is removed, and a failed write
    raises :class:`CheckpointSaveError`."""
    stage = Staged(final, partial(final))  # a file in the way of the output path is the caller's error, as it is
    try:
        with stage:
            yield stage.path
            stage.publish()
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointSaveError(f"{final}: not written: {error_reason(error)}") from error


CONVERTING_NOTE = "CONVERTING.txt"
DEEPSPEED_CONVERTERS = ("zero_to_fp32.py", "zero_to_torch.py")
CONVERTING_TEXT = """\
These are DeepSpeed ZeRO checkpoints whose model is also split over tensor-parallel ranks.
DeepSpeed's zero_to_fp32.py reads one model-parallel rank's files and stops on them. What reads
them, at any TP x DP x ZeRO layout (CHECKPOINT: this directory for its latest, or a step_N in it):

  parallel-latent consolidate CHECKPOINT OUT   the whole model in one safetensors file, for one process
  parallel-latent export CHECKPOINT OUT        portable safetensors shards and their manifest
  parallel-latent reshard CHECKPOINT           the optimizer state without a layout (resume anywhere)
  parallel-latent inspect CHECKPOINT           what a checkpoint holds
"""


def write_converting_note(checkpoints_dir: str | Path) -> None:
    """In place of DeepSpeed's recovery scripts (they cannot read these checkpoints): a short note of
    the commands that do, written once; scripts an older save left there are removed."""
    directory = Path(checkpoints_dir)
    for script in DEEPSPEED_CONVERTERS:
        (directory / script).unlink(missing_ok=True)
    note = directory / CONVERTING_NOTE
    if not note.exists() or note.read_text() != CONVERTING_TEXT:
        replace_file(note, CONVERTING_TEXT)


def attempt(failures: list[str], write: Callable[[], Any]) -> None:
    """Run a write of this rank alone (no collective inside) unless one failed already; a failure
    is recorded in ``failures``, not raised, so that this rank stays in step with the others."""
    if not failures:
        try:
            write()
        except Exception as error:
            failures.append(error_reason(error))


def _agreed(failures: list[str]) -> str | None:
    return first_failure(failures[0] if failures else None)


def begin_save(staging: Path) -> str | None:
    """Rank 0 makes a fresh, empty ``staging`` directory; every rank learns whether it could (its
    failure, or None; collective)."""
    failures: list[str] = []
    if is_main():
        attempt(failures, lambda: (discard(staging), staging.mkdir(parents=True)))
    return _agreed(failures)


def save_collectively(staging: Path, write: Callable[[list[str]], None], finish: Callable[[], None]) -> str | None:
    """How every collective writer saves: rank 0 makes a fresh ``staging`` directory; every rank runs
    ``write`` (which records its failures in the list it gets, never raising); if no rank failed,
    rank 0 runs ``finish`` (publishes). The ranks agree after each stage, so all take the same way
    out. Returns the first failure on every rank (None: published; else the staging is gone)."""
    failures: list[str] = []
    failure = begin_save(staging)
    if failure is None:
        write(failures)
        failure = _agreed(failures)
    if failure is None and is_main():
        attempt(failures, finish)
        failure = failures[0] if failures else None
    if failure is not None and is_main():
        discard(staging)  # before the others hear of it: when they return, it is gone
    return broadcast_value(failure)


def remove_unfinished_saves(checkpoint_dir: Path) -> list[Path]:
    """Delete what dead saves left in ``checkpoint_dir``: saves are collective and serial, so any
    staging directory or replaced copy is a dead one."""
    dead = [p for p in checkpoint_dir.glob(".*") if p.is_dir() and p.name.startswith((STAGING_PREFIX, REPLACED_PREFIX))]
    for path in dead:
        discard(path)
    return dead


def prune_checkpoints(checkpoint_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints (0 = keep all) and what dead
    saves left; never the one ``latest`` names."""
    removed = []
    latest = find_latest_checkpoint(checkpoint_dir)
    if keep_last > 0:
        for old in list_checkpoints(checkpoint_dir)[:-keep_last]:
            if latest is None or old.resolve() != latest.resolve():
                discard(old)
                removed.append(old)
    return removed + remove_unfinished_saves(checkpoint_dir)
