"""Whether a published training checkpoint is intact, and which one a run resumes from.

Each checkpoint records, when it is published, what its files should be (``checkpoint.json``'s
``files``: every file's size, and the SHA-256 of the small ones, which costs nothing). Before any
rank loads it, rank 0 compares the files with that record; a file that is missing, shorter or longer,
or whose small-file checksum differs makes the checkpoint damaged. Checkpoints written before the
record existed are checked for what can be checked without it: JSON files parse, DeepSpeed's
``.pt`` files are whole zip archives (their central directory is at the end: a truncated one has
none), the portable weights match their manifest's sizes and safetensors headers. A missing record
is never damage. Files that match their record are then read for what they hold (:mod:`.schema`):
a record can be rewritten to match anything.

With ``checkpoint.resume=auto`` a damaged newest checkpoint is moved aside (``.damaged-step_N``,
renamed, not deleted) with one line saying so, and the run resumes from the newest intact one; an
explicitly named checkpoint that is damaged stops the run with one line.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

from parallel_latent.files import JSONProblem, inside, load_json_file, replace_file

from .layout import (
    DAMAGED_PREFIX,
    INFO_FILE,
    LATEST_FILE,
    MANIFEST_NAME,
    PORTABLE_DIR,
    TAG_PATTERN,
    CheckpointError,
    find_latest_checkpoint,
    linked_steps,
    list_checkpoints,
    step_of,
)
from .schema import CHECKPOINT_INFO, content_damage, schema_problem
from .shards import PortableCheckpoint

__all__ = [
    "DAMAGED_PREFIX",
    "checkpoint_damage",
    "damaged_error",
    "file_record",
    "move_aside",
    "require_intact",
    "resumable",
]

# Files up to this size get a checksum in the record (JSON, RNG states): reading them is free.
CHECKSUM_MAX_BYTES = 1 << 20


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _zip_crcs(path: Path) -> str | None:
    """A digest of the CRC32s a zip archive (a torch file) keeps of its entries, read from its
    directory alone: with the entries checked against them (:mod:`.schema`), the record holds the
    whole content of a file too big to hash at every resume. None for a file that is no archive."""
    try:
        with zipfile.ZipFile(path) as archive:
            crcs = [f"{info.filename}:{info.CRC:08x}" for info in archive.infolist()]
    except (OSError, zipfile.BadZipFile):
        return None
    return hashlib.sha256("\n".join(crcs).encode()).hexdigest()


def file_record(directory: Path) -> dict[str, dict]:
    """What ``directory``'s files are now (relative name -> bytes, and sha256 for small files, the
    digest of their entries' CRCs for torch files); written into ``checkpoint.json`` when the
    checkpoint is published."""
    record = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != INFO_FILE):
        size = path.stat().st_size
        entry: dict = {"bytes": size}
        if size <= CHECKSUM_MAX_BYTES:
            entry["sha256"] = _sha256(path)
        elif path.suffix == ".pt" and (crcs := _zip_crcs(path)) is not None:
            entry["zip_crcs"] = crcs
        record[path.relative_to(directory).as_posix()] = entry
    return record


def _against_record(step_dir: Path, record: dict[str, dict]) -> str | None:
    for name, expected in record.items():
        try:
            path = inside(step_dir, name, INFO_FILE)
        except ValueError as error:
            return str(error)
        if not path.is_file():
            return f"{path}: missing"
        if (size := path.stat().st_size) != expected["bytes"]:
            return f"{path}: {size} bytes, {expected['bytes']} when it was saved"
        if "sha256" in expected and _sha256(path) != expected["sha256"]:
            return f"{path}: its contents changed since it was saved (checksum)"
        if "zip_crcs" in expected and _zip_crcs(path) != expected["zip_crcs"]:
            return f"{path}: its contents changed since it was saved (the CRCs of its entries)"
    return None


def _without_record(step_dir: Path) -> str | None:
    """What can be checked of a checkpoint saved before files were recorded."""
    for path in sorted(p for p in step_dir.rglob("*") if p.is_file()):
        if path.stat().st_size == 0:
            return f"{path}: empty"
        if path.suffix == ".json":
            try:
                load_json_file(path)
            except (OSError, UnicodeDecodeError, ValueError):
                return f"{path}: not readable JSON"
        elif path.suffix == ".pt" and not zipfile.is_zipfile(path):
            return f"{path}: not a whole torch file (no zip directory at its end)"
    if (step_dir / PORTABLE_DIR / MANIFEST_NAME).is_file():
        try:
            PortableCheckpoint(step_dir / PORTABLE_DIR, verify_checksums=False).open_files()
        except CheckpointError as error:
            return str(error)
    return None


def checkpoint_damage(step_dir: Path, contents: bool = True) -> str | None:
    """Why the checkpoint ``step_dir`` is damaged (a file and what is wrong with it), or None.
    ``contents``: also what every file holds (:func:`.schema.content_damage`, which reads the whole
    checkpoint); False checks the record alone, for a process whose launcher read it whole."""
    try:
        info = load_json_file(step_dir / INFO_FILE)
    except FileNotFoundError:
        return f"{step_dir / INFO_FILE}: missing"
    except JSONProblem as problem:
        return str(problem)
    except (OSError, UnicodeDecodeError, ValueError):
        return f"{step_dir / INFO_FILE}: not readable JSON"
    if (problem := schema_problem(info, CHECKPOINT_INFO)) is not None:
        return f"{step_dir / INFO_FILE}: {problem}"
    if (named := TAG_PATTERN.match(step_dir.name)) and int(named.group(1)) != info["step"]:
        return f"{step_dir / INFO_FILE}: records step {info['step']}, in the directory of step {int(named.group(1))}"
    record = info.get("files")
    damage = _against_record(step_dir, record) if isinstance(record, dict) else _without_record(step_dir)
    return damage if damage is not None or not contents else content_damage(step_dir, info)


def damaged_error(step_dir: Path, damage: str) -> CheckpointError:
    return CheckpointError(f"{damage}: the checkpoint {step_dir} is truncated or damaged; not loaded")


def require_intact(step_dir: Path, contents: bool = True) -> Path:
    """``step_dir`` if it is intact (:func:`checkpoint_damage`); else CheckpointError (one line,
    naming the file)."""
    if (damage := checkpoint_damage(step_dir, contents)) is not None:
        raise damaged_error(step_dir, damage)
    return step_dir


def resumable(checkpoint_dir: Path, contents: bool = True) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The checkpoint a run in ``checkpoint_dir`` resumes from: the one :func:`find_latest_checkpoint`
    finds, or when it is damaged the newest intact one before it (None if there is none); and the
    damaged ones passed over, newest first, each with its damage. Reads, never changes anything."""
    links = linked_steps(checkpoint_dir)  # never resumed from: passed over as damage, newest first
    latest = find_latest_checkpoint(checkpoint_dir)
    if latest is None:
        return None, links[::-1]
    newest = step_of(latest)
    damaged = [link for link in links[::-1] if step_of(link[0]) > newest]
    candidates = [p for p in list_checkpoints(checkpoint_dir) if step_of(p) <= newest]
    for step_dir in sorted(candidates + [p for p, _ in links if step_of(p) <= newest], key=step_of, reverse=True):
        if step_dir.is_symlink():
            damaged.append(next(link for link in links if link[0] == step_dir))
        elif (damage := checkpoint_damage(step_dir, contents)) is None:
            return step_dir, damaged
        else:
            damaged.append((step_dir, damage))
    return None, damaged


def move_aside(step_dir: Path, intact: Path | None) -> Path:
    """Rename a damaged checkpoint out of the run's way (``.damaged-step_N``, never deleted; a link
    is renamed, not what it leads to) and, if ``latest`` named it, point ``latest`` at ``intact``
    (the plan's choice: the newest intact checkpoint left, or None)."""
    checkpoint_dir = step_dir.parent
    target = checkpoint_dir / f"{DAMAGED_PREFIX}{step_dir.name}"
    suffix = 1
    while target.exists() or target.is_symlink():
        suffix += 1
        target = checkpoint_dir / f"{DAMAGED_PREFIX}{step_dir.name}-{suffix}"
    os.rename(step_dir, target)
    latest = checkpoint_dir / LATEST_FILE
    named = latest.read_text(encoding="utf-8").strip() if latest.is_file() and not latest.is_symlink() else ""
    if named == step_dir.name or not TAG_PATTERN.match(named or "x"):
        if intact is not None:
            replace_file(latest, intact.name + "\n")
        else:
            latest.unlink(missing_ok=True)
    return target
