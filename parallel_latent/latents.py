"""Latent datasets: a whole corpus encoded by a trained autoencoder into shards that a downstream
trainer memory-maps, and reading them back.

:func:`export_latents` (behind :func:`parallel_latent.api.encode_corpus` and ``parallel-latent
encode-corpus``) reads every sample of the corpus's prepared copy in row order, encodes fixed-size
export batches with the model's own ``encode`` and writes::

    DIR/data-00000-of-000NN.arrow   Arrow IPC stream files, one per shard of ``export.shard_size``
                                    rows; columns ``latents`` [T', d'] (float32, or bfloat16 stored as
                                    its 16-bit pattern in uint16), ``attention_mask`` [T] int8,
                                    ``index`` (the row in the prepared copy), ``num_tokens``, ``truncated``
    DIR/state.json, dataset_info.json
                                    what ``datasets.load_from_disk(DIR)`` reads (memory-mapped)
    DIR/latents.json                the index: format version, model record, shapes, dtype, the export
                                    settings, the corpus (and the rows each source file gave),
                                    per-shard row ranges and XXH3-128 checksums, the latents'
                                    per-feature mean and std; no timestamps, so the whole
                                    directory is the same bytes whoever wrote it, in however many runs

Work is split by shards: data-parallel rank ``r`` takes every ``dp``-th shard still missing, its
tensor-parallel group encodes each batch together, and the group's first rank writes. A shard is
staged under ``DIR/.export/``, made durable, recorded (bytes, checksum, statistics), then renamed to
its final name: a reader never finds half a shard, and a rerun of the same command (with any
``--nproc``) encodes only the shards that are missing. The batches, and so the bytes, depend on
``export.batch_size`` and the corpus alone. ``DIR/.export/`` goes when the export is complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import math
import os
import queue
import shutil
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from parallel_latent import coordination, files, pretrained
from parallel_latent.checkpoint import PortableCheckpoint, resolve_portable_dir
from parallel_latent.checkpoint.layout import MANIFEST_NAME
from parallel_latent.config import (
    EXPORT_SECTION,
    Config,
    ExportConfig,
    ModelConfig,
    apply_overrides,
    config_from_dict,
    export_config_from_dict,
)
from parallel_latent.console import WORKER_LOGS_ENV
from parallel_latent.data import open_for_training, resolve_source
from parallel_latent.data.sources import read_split, samples_per_file
from parallel_latent.errors import BadInput, ExitStatus, first_line, os_reason
from parallel_latent.model import eval_mode
from parallel_latent.parallel import get_parallel_state

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "INDEX_FILE",
    "ExportError",
    "ExportPlan",
    "ExportWriteError",
    "LatentDataset",
    "export_latents",
    "open_latents",
    "plan_export",
]

FORMAT = "parallel-latent-latents"
# 2: shard checksums are XXH3-128 (``xxh3_128``), not SHA-256. SHA-256 hashes some 2 GB/s on one
# core: the writer thread would cap a GPU export of gpt2.yaml's latents (196 KB a sample) near 10k
# samples/s; on 2 CPU cores it was a third of the writer's work. The columns are version 1's, so
# both are read.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
INDEX_FILE = "latents.json"
WORK_DIR = ".export"
RUN_FILE = "run.json"
LOCK_FILE = "lock"
RECORDS_DIR = "shards"
TMP_PREFIX = "tmp-"
# Tests stop an export at a known point to kill it there: with this set to a shard's number, the
# writer of that shard stops after its first batch (the shard half-written under .export/) and
# says so in PAUSE_MARKER.
PAUSE_IN_SHARD_ENV = "PARALLEL_LATENT_EXPORT_PAUSE_IN_SHARD"
PAUSE_MARKER = "paused"
LOGS_DIR = "logs"  # the --nproc launcher's worker logs (removed by the launcher, not by the ranks)
# The keys of a training config that an export reads; everything else comes from the checkpoint.
OVERRIDABLE = ("data.", "parallel.tensor_parallel", "parallel.backend", "training.device", "logging.progress_bar")
# Batches handed to the writer thread ahead of it: the model never waits for the disk unless the
# disk is slower than the model, and at most this many batches are held in memory.
WRITE_AHEAD = 4
IDENTITY_WORDS = {
    "checkpoint": "another checkpoint",
    "corpus": "another corpus",
    "num_samples": "another corpus",
    "max_length": "another corpus",
    "precision": "another export.precision",
    "batch_size": "another export.batch_size",
    "shard_size": "another export.shard_size",
    "format": "another format",
    "version": "another format version",
}


class ExportError(BadInput):
    """An export that cannot start: bad settings, an output directory holding something else, a
    checkpoint that is not an autoencoder (one line, exit status 2)."""


class ExportWriteError(RuntimeError):
    """A shard or the index could not be written (a full disk, an I/O error): every completed shard
    is intact and a rerun continues from them (one line, exit status 4, as a failed checkpoint save)."""

    exit_status = ExitStatus.SAVE_FAILED


def shard_name(index: int, count: int) -> str:
    return f"data-{index:05d}-of-{count:05d}.arrow"


# --------------------------------------------------------------------------- #
# What to export: the settings, checked before anything is built.
# --------------------------------------------------------------------------- #


@dataclass
class ExportPlan:
    """An export's settings: the config (the checkpoint's model, the corpus, the parallel layout),
    the ``export.*`` settings, and the checkpoint's portable directory and manifest digest."""

    cfg: Config
    export: ExportConfig
    checkpoint: str  # as given (a path or a hub id)
    directory: Path  # its portable directory
    manifest: dict
    manifest_sha256: str

    @property
    def tensor_parallel(self) -> int:
        return self.cfg.parallel.tensor_parallel


def _split_overrides(overrides: Sequence[str], source: str) -> tuple[list[str], dict]:
    """(training-config overrides, the ``export.*`` values), refusing keys an export does not read."""
    config_overrides, export_values = [], {}
    for override in overrides:
        key, separator, raw = override.partition("=")
        key = key.strip()
        if separator and key.startswith(f"{EXPORT_SECTION}."):
            try:
                export_values[key.removeprefix(f"{EXPORT_SECTION}.")] = yaml.safe_load(raw) if raw.strip() else ""
            except yaml.YAMLError:
                export_values[key.removeprefix(f"{EXPORT_SECTION}.")] = raw
        elif separator and (key.startswith(OVERRIDABLE[0]) or key in OVERRIDABLE[1:]):
            config_overrides.append(override)
        else:
            raise ExportError(
                f"{source}: override {override!r}: an export takes export.*, data.*, "
                + ", ".join(OVERRIDABLE[1:])
                + " (the model comes from the checkpoint)"
            )
    return config_overrides, export_values


def plan_export(
    checkpoint: str | Path, data: str | Path, overrides: Sequence[str] = (), source: str = ""
) -> ExportPlan:
    """The settings of an export of ``data`` through ``checkpoint`` with ``key=value`` overrides;
    ExportError / ConfigError / CheckpointError (one line) when they cannot work. Writes nothing.
    Collective under a process group only when ``checkpoint`` is a hub id (it is downloaded once)."""
    source = source or "encode-corpus"
    directory = resolve_portable_dir(pretrained.pretrained_directory(checkpoint))
    manifest_path = directory / MANIFEST_NAME
    manifest = PortableCheckpoint(directory, verify_checksums=False).manifest
    if not manifest.get("model_config") or not manifest.get("feature_model_config"):
        raise ExportError(f"{directory}: not an autoencoder checkpoint (its manifest records no model config)")
    config_overrides, export_values = _split_overrides(overrides, source)
    saved = manifest.get("config") or {}
    base = {
        "model": ModelConfig.saved(manifest["model_config"]),
        "feature_model": manifest["feature_model_config"],
        "tokenizer": saved.get("tokenizer") or {},
        "data": {"path": str(data)},
    }
    cfg = config_from_dict(apply_overrides(base, config_overrides, source), source)
    export = export_config_from_dict(export_values, source)
    digest = hashlib.sha256(manifest_path.read_bytes()).hexdigest()
    return ExportPlan(cfg, export, str(checkpoint), directory, manifest, digest)


# --------------------------------------------------------------------------- #
# The output directory: what it holds, who may write it.
# --------------------------------------------------------------------------- #


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ExportError(f"{path}: unreadable ({first_line(error)}); delete the export to start again") from None
    if not isinstance(value, dict):
        raise ExportError(f"{path}: not an export record; delete the export to start again")
    return value


def output_state(out: Path) -> tuple[str, dict | None]:
    """``("new", None)``, ``("partial", identity)`` or ``("complete", identity)`` for an export
    directory; ExportError when ``out`` is a file or a directory holding anything else."""
    if not out.exists():
        return "new", None
    if not out.is_dir():
        raise ExportError(f"{out}: --out is a file, expected a directory")
    if (out / INDEX_FILE).is_file():
        index = _read_json(out / INDEX_FILE)
        if index.get("format") != FORMAT:
            raise ExportError(f"{out}: holds a {INDEX_FILE} that is not a {FORMAT} index; choose another --out")
        return "complete", index.get("identity")
    if (out / WORK_DIR / RUN_FILE).is_file():
        return "partial", _read_json(out / WORK_DIR / RUN_FILE)
    others = sorted(p.name for p in out.iterdir() if p.name != WORK_DIR)
    if others:
        raise ExportError(f"{out}: not empty and not an export (holds {others[0]}); choose a new or empty --out")
    return "new", None


def identity_difference(found: dict, wanted: dict) -> str | None:
    """What makes the export found in a directory another one than ``wanted`` (the first key), or None."""
    for key, value in wanted.items():
        if found.get(key) != value:
            return f"{IDENTITY_WORDS.get(key, key)} ({key}: {found.get(key)} there, {value} now)"
    return None


@contextlib.contextmanager
def _exclusive(work: Path, out: Path):
    """Hold the export's lock for the block: a second export into ``out`` is refused, not queued.
    The kernel drops the lock with the process, so a killed export never blocks its rerun."""
    work.mkdir(parents=True, exist_ok=True)
    fd = os.open(work / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o664)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ExportError(
                f"{out}: another export is writing into it (one export at a time per directory)"
            ) from None
        except OSError as error:  # no flock on this file system: publishing by rename still holds
            if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
        yield
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- #
# Writing one shard (a background thread, so the disk works while the model encodes).
# --------------------------------------------------------------------------- #


def _features(latent_shape: tuple[int, int], storage: str, max_length: int):
    import datasets

    listed = getattr(datasets, "List", None) or datasets.Sequence  # datasets >= 4 names it List
    return datasets.Features(
        {
            "latents": listed(listed(datasets.Value(storage), length=latent_shape[1]), length=latent_shape[0]),
            "attention_mask": listed(datasets.Value("int8"), length=max_length),
            "index": datasets.Value("int64"),
            "num_tokens": datasets.Value("int32"),
            "truncated": datasets.Value("bool"),
        }
    )


class _HashingFile:
    """A binary file that hashes what is written to it (the shard's checksum without reading it back).
    XXH3-128 detects damage as well as a cryptographic hash, at tens of GB/s (``xxh128sum`` checks a
    shard from a shell); nothing here needs to resist a forger."""

    def __init__(self, path: Path):
        import xxhash

        self.handle = open(path, "wb")  # noqa: SIM115 (closed in close())
        self.digest = xxhash.xxh3_128()
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data)
        self.digest.update(view)
        self.size += view.nbytes
        return self.handle.write(view)

    def flush(self) -> None:
        self.handle.flush()

    @property
    def closed(self) -> bool:
        return self.handle.closed

    def close(self) -> None:
        self.handle.close()


@dataclass
class _Moments:
    """count, mean and sum of squared deviations per feature (Chan et al.'s pairwise update), in
    float64 and in a fixed order: the same bits whoever computes them."""

    count: int
    mean: np.ndarray
    m2: np.ndarray

    @classmethod
    def of(cls, vectors: np.ndarray) -> _Moments:
        values = vectors.astype(np.float64)
        mean = values.mean(axis=0) if len(values) else np.zeros(values.shape[1])
        return cls(len(values), mean, ((values - mean) ** 2).sum(axis=0))

    def merged(self, other: _Moments) -> _Moments:
        count = self.count + other.count
        if not other.count:
            return self
        if not self.count:
            return other
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.count / count)
        m2 = self.m2 + other.m2 + delta**2 * (self.count * other.count / count)
        return _Moments(count, mean, m2)

    def to_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean.tolist(), "m2": self.m2.tolist()}

    @classmethod
    def from_dict(cls, record: dict) -> _Moments:
        return cls(int(record["count"]), np.asarray(record["mean"], np.float64), np.asarray(record["m2"], np.float64))


class ShardWriter:
    """Writes the shards of one tensor-parallel group, one at a time, on a background thread:
    :meth:`begin`, :meth:`put` per batch, :meth:`end`; :meth:`close` waits and raises the first
    failure (:class:`ExportWriteError`). After a failure the thread drops what it is given and
    :attr:`failed` is set, so the encoding loop can stop."""

    def __init__(self, out: Path, num_shards: int, max_length: int, precision: str):
        self.out, self.work = out, out / WORK_DIR
        self.num_shards, self.max_length, self.precision = num_shards, max_length, precision
        self.failed = threading.Event()
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=WRITE_AHEAD)
        self._thread = threading.Thread(target=self._run, name="latent-shard-writer", daemon=True)
        self._thread.start()

    def begin(self, index: int, first: int, count: int) -> None:
        self._queue.put(("begin", index, first, count))

    def put(self, latents: np.ndarray, mask: np.ndarray, rows: np.ndarray, lengths: np.ndarray, truncated) -> None:
        self._queue.put(("batch", latents, mask, rows, lengths, truncated))

    def end(self) -> None:
        self._queue.put(("end",))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        shard = None
        while (message := self._queue.get()) is not None:
            if self.error is not None:
                continue
            try:
                if message[0] == "begin":
                    shard = _OpenShard(self, *message[1:])
                elif message[0] == "batch":
                    shard.write(*message[1:])
                else:
                    shard.publish()
                    shard = None
            except Exception as error:
                self.error = _write_error(error, self.out)
                self.failed.set()
                if shard is not None:
                    shard.discard()
                    shard = None


def _write_error(error: BaseException, out: Path) -> BaseException:
    if isinstance(error, OSError):
        return ExportWriteError(f"{out}: shard not written: {os_reason(error)}")
    return error


class _OpenShard:
    """One shard being staged under ``.export/``."""

    def __init__(self, writer: ShardWriter, index: int, first: int, count: int):
        import pyarrow as pa

        self.pa, self.writer = pa, writer
        self.index, self.first, self.count = index, first, count
        self.name = shard_name(index, writer.num_shards)
        self.staging = writer.work / f"{TMP_PREFIX}{self.name}-{os.getpid()}"
        self.file = _HashingFile(self.staging)
        self.stream = None
        self.written = self.tokens = 0
        self.moments: _Moments | None = None
        self.latent_shape: tuple[int, int] | None = None

    def write(self, latents: np.ndarray, mask: np.ndarray, rows: np.ndarray, lengths: np.ndarray, truncated) -> None:
        pa = self.pa
        batch, length, width = latents.shape
        if self.stream is None:
            self.latent_shape = (length, width)
            storage = "float32" if latents.dtype == np.float32 else "uint16"
            self.schema = _features(self.latent_shape, storage, self.writer.max_length).arrow_schema
            self.stream = pa.ipc.new_stream(pa.PythonFile(self.file, mode="w"), self.schema)
        inner = pa.FixedSizeListArray.from_arrays(pa.array(latents.reshape(-1)), width)
        columns = [
            pa.FixedSizeListArray.from_arrays(inner, length),
            pa.FixedSizeListArray.from_arrays(pa.array(mask.astype(np.int8).reshape(-1)), mask.shape[1]),
            pa.array(rows.astype(np.int64)),
            pa.array(lengths.astype(np.int32)),
            pa.array(truncated.astype(bool)),
        ]
        self.stream.write_batch(pa.record_batch(columns, schema=self.schema))
        self.written += batch
        if os.environ.get(PAUSE_IN_SHARD_ENV) == str(self.index):
            self.file.flush()
            (self.writer.work / PAUSE_MARKER).write_text(str(self.index))
            threading.Event().wait()  # until the process is killed
        self.tokens += int(lengths.sum())
        values = _as_float32(latents)
        # Statistics over the latent vectors of real tokens (all positions if the latents have
        # another length than the tokens, e.g. behind a bottleneck).
        vectors = values[mask.astype(bool)] if length == mask.shape[1] else values.reshape(-1, width)
        moments = _Moments.of(vectors)
        self.moments = moments if self.moments is None else self.moments.merged(moments)

    def publish(self) -> None:
        """Durable, recorded, then renamed to its final name (the rename is what a reader sees)."""
        if self.written != self.count:
            raise RuntimeError(f"shard {self.index}: {self.written} rows written, {self.count} expected")
        self.stream.close()
        self.file.flush()
        os.fsync(self.file.handle.fileno())
        self.file.close()
        record = {
            "file": self.name,
            "first": self.first,
            "count": self.count,
            "num_tokens": self.tokens,
            "bytes": self.file.size,
            "xxh3_128": self.file.digest.hexdigest(),
            "latent_shape": list(self.latent_shape),
            "moments": self.moments.to_dict(),
        }
        records = self.writer.work / RECORDS_DIR
        files.replace_file(records / f"{self.index:05d}.json", json.dumps(record) + "\n")
        os.rename(self.staging, self.writer.out / self.name)
        files.fsync(self.writer.out)

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
        self.staging.unlink(missing_ok=True)


def _as_float32(latents: np.ndarray) -> np.ndarray:
    """float32 values of stored latents (bfloat16 bit patterns widened: the high half of a float32)."""
    if latents.dtype == np.float32:
        return latents
    return (latents.astype(np.uint32) << 16).view(np.float32)


# --------------------------------------------------------------------------- #
# The export.
# --------------------------------------------------------------------------- #


def _identity(plan: ExportPlan, data) -> dict:
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "checkpoint": plan.manifest_sha256,
        "corpus": data.content_digest,
        "num_samples": len(data),
        "max_length": data.max_length,
        "precision": plan.export.precision,
        "batch_size": plan.export.batch_size,
        "shard_size": plan.export.shard_size,
    }


def _completed_shards(out: Path, num_shards: int) -> list[dict]:
    """Records of the shards already published, less their statistics (d floats each: they are
    merged from the files at the end, so that no rank holds them all); the rest, and their
    leftovers, are removed."""
    work, done = out / WORK_DIR, []
    for index in range(num_shards):
        final, record_path = out / shard_name(index, num_shards), work / RECORDS_DIR / f"{index:05d}.json"
        record = None
        if record_path.is_file():
            with contextlib.suppress(ValueError, OSError):
                record = json.loads(record_path.read_text(encoding="utf-8"))
        if record and final.is_file() and final.stat().st_size == record.get("bytes"):
            done.append({key: value for key, value in record.items() if key != "moments"})
            continue
        final.unlink(missing_ok=True)
        record_path.unlink(missing_ok=True)
    return done


def _start(plan: ExportPlan, out: Path, data, lock_stack: contextlib.ExitStack) -> tuple[str, list[dict]]:
    """Rank 0: check the directory against this export, take its lock, record the export and
    clear a dead run's staging files. ("complete" | "go", the shards already done)."""
    identity = _identity(plan, data)
    state, found = output_state(out)
    if state != "new":
        difference = identity_difference(found or {}, identity)
        if difference:
            raise ExportError(f"{out}: holds an export of {difference}; choose another --out, or delete it")
    if state == "complete":
        return "complete", []
    work = out / WORK_DIR
    lock_stack.enter_context(_exclusive(work, out))
    state, found = output_state(out)  # as it is now that no one else writes
    if state == "complete":
        return "complete", []
    for leftover in work.glob(f"{TMP_PREFIX}*"):
        leftover.unlink(missing_ok=True)
    (work / RECORDS_DIR).mkdir(exist_ok=True)
    if state == "new":
        files.replace_file(work / RUN_FILE, json.dumps(identity, indent=1) + "\n")
    return "go", _completed_shards(out, math.ceil(len(data) / plan.export.shard_size))


def _agreed(function, *args):
    """``function(*args)`` on rank 0, its value (or its one-line BadInput) on every rank."""
    value = error = None
    if coordination.is_main():
        try:
            value = function(*args)
        except BadInput as caught:
            error = (type(caught), str(caught))
    value, error = coordination.broadcast_value((value, error))
    if error is not None:
        raise error[0](error[1])
    return value


def _progress_bar(enabled: bool, total: int, initial: int):
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        initial=initial,
        unit="samples",
        desc="encoding",
        disable=not enabled or not coordination.is_main(),
        dynamic_ncols=True,
        mininterval=1.0,
        file=sys.stderr,
    )


def _stop_together(failed: bool, state) -> bool:
    """Whether the writer of this tensor-parallel group has failed, on every rank of the group (the
    others must stop encoding with it, or they would wait for it in the next collective)."""
    if state.tp_size == 1:
        return failed
    import torch.distributed as dist

    flag = torch.tensor([1 if failed else 0], dtype=torch.int32, device=state.device)
    dist.broadcast(flag, src=state.tp_ranks[0], group=state.tp_group)
    return bool(flag.item())


def _encode_shards(autoencoder, data, shards, plan: ExportPlan, out: Path, state, progress) -> None:
    """This rank's share of the missing shards, encoded batch by batch and (on the first rank of
    its tensor-parallel group) written; ExportWriteError when writing fails."""

    export, model, device = plan.export, autoencoder.model, autoencoder.device
    num_shards = math.ceil(len(data) / export.shard_size)
    writer = ShardWriter(out, num_shards, data.max_length, export.precision) if state.tp_rank == 0 else None
    try:
        with torch.no_grad(), eval_mode(model):
            for index in shards:
                first = index * export.shard_size
                end = min(first + export.shard_size, len(data))
                if writer is not None:
                    writer.begin(index, first, end - first)
                for start in range(first, end, export.batch_size):
                    rows = np.arange(start, min(start + export.batch_size, end))
                    batch = data.rows(rows)
                    mask = batch["attention_mask"]
                    latents = model.encode(batch["input_ids"].to(device), mask.to(device))
                    if _stop_together(writer is not None and writer.failed.is_set(), state):
                        return
                    if writer is not None:
                        writer.put(_stored(latents), mask.numpy(), rows, mask.sum(1).numpy(), data.truncated[rows])
                    # Rank 0 counts the other data-parallel ranks' batches as its own (they run abreast).
                    progress.update(max(0, min(len(rows) * state.dp_size, progress.total - progress.n)))
                if writer is not None:
                    writer.end()
    finally:
        if writer is not None:
            writer.close()


def _stored(latents: torch.Tensor) -> np.ndarray:
    """What a shard holds: float32, or a bfloat16's 16 bits as uint16."""
    latents = latents.detach().cpu()
    if latents.dtype == torch.bfloat16:
        return latents.contiguous().view(torch.int16).numpy().view(np.uint16)
    return latents.float().contiguous().numpy()


def _rows_of_files(plan: ExportPlan, num_samples: int) -> list[dict] | None:
    """Which rows come from which part of the source: row ``first_row`` + k is the part's k-th
    sample, by the preparation's rules (see :func:`parallel_latent.data.sources.samples_per_file`).
    Files: one entry per file, ``format`` its format. A saved or hub dataset: one entry for all of
    it, ``file`` its location (the directory, or ``hf:NAME[:CONFIG]``), ``format`` ``saved`` or
    ``hub``, ``split`` the split read (null for a saved ``Dataset``, which has none), first_row 0
    and every row. None where the source cannot be read now, or its counts do not add up to the
    prepared copy's rows (it changed since it was prepared)."""
    data = plan.cfg.data
    source = resolve_source(data.path, data.format)
    counts = samples_per_file(source, data.text_field, data.sample_unit, data.split)
    if counts is None or sum(counts) != num_samples:
        return None
    if source.kind in ("saved", "hub"):
        location = source.location if source.kind == "hub" else str(Path(source.location).resolve())
        split = read_split(source, data.split)
        return [{"file": location, "format": source.kind, "split": split, "first_row": 0, "rows": num_samples}]
    starts = np.cumsum([0, *counts[:-1]]).tolist()
    return [
        {"file": path, "format": fmt, "first_row": int(first), "rows": count}
        for (path, fmt), first, count in zip(source.files, starts, counts, strict=True)
    ]


def _finish(plan: ExportPlan, out: Path, data) -> dict:
    """Rank 0, every shard published: the datasets files and the index, then the work files go."""
    num_shards = math.ceil(len(data) / plan.export.shard_size)
    records = _completed_shards(out, num_shards)
    if len(records) != num_shards:
        missing = sorted(set(range(num_shards)) - {r["first"] // plan.export.shard_size for r in records})
        raise ExportWriteError(f"{out}: shard {missing[0]} is missing after every rank finished; rerun to continue")
    shapes = {tuple(r["latent_shape"]) for r in records}
    if len(shapes) != 1:
        raise RuntimeError(f"{out}: the shards hold latents of several shapes {sorted(shapes)}")
    (latent_shape,) = shapes
    moments = None
    for index in range(num_shards):  # in shard order, one record at a time: the same bits every run
        part = _Moments.from_dict(_read_json(out / WORK_DIR / RECORDS_DIR / f"{index:05d}.json")["moments"])
        moments = part if moments is None else moments.merged(part)
    bf16 = plan.export.precision == "bf16"
    features = _features(latent_shape, "uint16" if bf16 else "float32", data.max_length)
    shards = [{key: r[key] for key in ("file", "first", "count", "num_tokens", "bytes", "xxh3_128")} for r in records]
    index = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "identity": _identity(plan, data),
        "model": {
            "checkpoint": plan.checkpoint,
            "manifest_sha256": plan.manifest_sha256,
            "model_config": plan.manifest["model_config"],
            "feature_model_config": plan.manifest["feature_model_config"],
            "tokenizer": plan.manifest.get("tokenizer"),
            "step": plan.manifest.get("step"),
        },
        "corpus": {
            "source": data.meta.get("source"),
            "record": data.meta.get("record"),
            "prepared_fingerprint": data.fingerprint,
            "content_sha256": data.content_digest,
            # The prepared copy's rule: its rows are the source's non-empty samples, in order.
            "rows": "row i is the i-th non-empty sample of the source (record.source: its files in that order, "
            "or a saved or hub dataset's split), cut to max_length tokens: a line or paragraph of a text file "
            "(record.sample_unit), the text_field of a JSONL, parquet or CSV record or of a dataset's row; files: "
            "the rows each part gave, row first_row + k its k-th sample (an entry per file; a saved or hub "
            "dataset: one, its location and split, every row), null if the source cannot be read now or its "
            "counts do not add up to the copy's rows (it changed since it was prepared)",
            "max_length": data.max_length,
            "files": _rows_of_files(plan, len(data)),
        },
        "export": dataclasses.asdict(plan.export),
        "latents": {
            "shape": list(latent_shape),
            "dtype": "bfloat16" if bf16 else "float32",
            "stored_as": "uint16: the bfloat16 bit pattern (torch: tensor.view(torch.bfloat16))" if bf16 else "float32",
        },
        "columns": {
            "latents": f"[{latent_shape[0]}, {latent_shape[1]}] the model's encode of the sample",
            "attention_mask": f"[{data.max_length}] int8, 1 at the sample's tokens (right-padded)",
            "index": "int64, the sample's row in the prepared copy",
            "num_tokens": "int32, the sample's tokens (after cutting to max_length)",
            "truncated": "bool, the sample had more than max_length tokens",
        },
        "num_samples": len(data),
        "num_tokens": sum(r["num_tokens"] for r in records),
        "shards": shards,
        "statistics": {
            "over": "every latent vector at a real token (every position if the latents are not one per token)",
            "count": moments.count,
            "mean": moments.mean.tolist(),
            "std": np.sqrt(moments.m2 / max(moments.count, 1)).tolist(),
        },
    }
    fingerprint = hashlib.sha256("".join(s["xxh3_128"] for s in shards).encode()).hexdigest()[:16]
    state = {
        "_data_files": [{"filename": s["file"]} for s in shards],
        "_fingerprint": fingerprint,
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    info = {
        "citation": "",
        "description": f"{FORMAT}: latents of {len(data)} samples; see {INDEX_FILE}",
        "features": features.to_dict(),
        "homepage": "",
        "license": "",
    }
    files.replace_file(out / "state.json", json.dumps(state, indent=2) + "\n")
    files.replace_file(out / "dataset_info.json", json.dumps(info, indent=2) + "\n")
    files.replace_file(out / INDEX_FILE, json.dumps(index, indent=1) + "\n")  # last: the export is complete
    # The logs of the --nproc launcher that runs this job stay for it to close; a dead job's go.
    remove_work_files(out, keep_logs=WORKER_LOGS_ENV in os.environ)
    return index


def remove_work_files(out: Path, keep_logs: bool) -> None:
    """``.export/`` of a complete export (its ``logs/`` kept for the launcher that writes them)."""
    work = out / WORK_DIR
    if not work.is_dir():
        return
    for entry in work.iterdir():
        if keep_logs and entry.name == LOGS_DIR:
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        work.rmdir()  # only if empty


def export_latents(autoencoder, plan: ExportPlan, out: str | Path, *, progress: bool | None = None) -> dict:
    """Encode every sample of ``plan``'s corpus with ``autoencoder`` (a
    :class:`parallel_latent.api.TextAutoencoder` loaded from ``plan.directory`` at the job's TP
    degree, in ``export.precision``) into the latent dataset ``out`` (see the module docstring);
    returns its index. Collective over the process groups of :mod:`parallel_latent.parallel.state`
    (world = TP x DP; every rank calls it). A directory holding this very export, partly or wholly,
    is continued (nothing done twice); one holding another export or anything else is refused
    (ExportError, one line), as is a second export into it while one runs."""

    out, cfg, state = Path(out), plan.cfg, get_parallel_state()
    wanted = torch.bfloat16 if plan.export.precision == "bf16" else torch.float32
    if next(autoencoder.model.parameters()).dtype != wanted:
        raise ExportError(f"export.precision={plan.export.precision} but the model holds other than {wanted} weights")
    _agreed(output_state, out)  # a file, or someone else's directory: refused before any work
    prepared = open_for_training(cfg, autoencoder.tokenizer, announce=coordination.is_main())
    with contextlib.ExitStack() as lock:
        status, done = _agreed(_start, plan, out, prepared, lock)
        if status == "complete":
            return _read_json(out / INDEX_FILE)
        num_shards = math.ceil(len(prepared) / plan.export.shard_size)
        finished = {record["first"] // plan.export.shard_size for record in done}
        pending = [index for index in range(num_shards) if index not in finished]
        mine = pending[state.dp_rank :: state.dp_size]
        enabled = cfg.logging.progress_bar if progress is None else progress
        initial = sum(record["count"] for record in done)
        error = None
        with _progress_bar(enabled, len(prepared), initial) as bar:
            try:
                _encode_shards(autoencoder, prepared, mine, plan, out, state, bar)
            except ExportWriteError as caught:
                error = caught
        # Every rank learns whether any shard failed, so that none waits for the index forever.
        failures = [m for m in coordination.all_gather_value(None if error is None else str(error)) if m]
        if error is not None:
            raise error
        if failures:
            raise ExportWriteError(failures[0])
        index = None
        if coordination.is_main():
            try:
                index = _finish(plan, out, prepared)
            except OSError as caught:
                error = ExportWriteError(f"{out}: index not written: {os_reason(caught)}")
        message = coordination.broadcast_value(None if error is None else str(error))
        if error is not None:
            raise error
        if message is not None:
            raise ExportWriteError(message)
    return index if index is not None else _read_json(out / INDEX_FILE)


# --------------------------------------------------------------------------- #
# Reading.
# --------------------------------------------------------------------------- #


class LatentDataset:
    """A latent dataset, memory-mapped: ``len()`` samples; ``dataset[i]`` (or a slice, or a sequence
    of indices) gives ``{"latents", "attention_mask", "index", "num_tokens", "truncated"}`` as torch
    tensors (latents float32, or bfloat16 for a bf16 export). The shards are memory-mapped: nothing
    is read until indexed, and only the rows asked for are copied out (tensors torch may write)."""

    def __init__(self, directory: Path, index: dict):
        import pyarrow as pa

        self.directory, self.index = directory, index
        self.latent_shape = tuple(index["latents"]["shape"])
        self.max_length = int(index["corpus"]["max_length"])
        self.bfloat16 = index["latents"]["dtype"] == "bfloat16"
        self._tables = []
        for shard in index["shards"]:
            path = directory / shard["file"]
            try:
                size = path.stat().st_size
            except OSError as error:
                raise ExportError(f"{path}: shard missing ({os_reason(error)})") from None
            if size != shard["bytes"]:
                raise ExportError(f"{path}: {size} bytes, the index says {shard['bytes']} (damaged)")
            self._tables.append(pa.ipc.open_stream(pa.memory_map(str(path))).read_all())
        self._starts = np.asarray([s["first"] for s in index["shards"]] + [index["num_samples"]], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.index["num_samples"])

    @property
    def mean(self) -> torch.Tensor:
        return torch.tensor(self.index["statistics"]["mean"], dtype=torch.float32)

    @property
    def std(self) -> torch.Tensor:
        return torch.tensor(self.index["statistics"]["std"], dtype=torch.float32)

    def _rows(self, table, rows: np.ndarray) -> dict[str, np.ndarray]:
        consecutive = len(rows) > 0 and bool((np.diff(rows) == 1).all())
        picked = table.slice(int(rows[0]), len(rows)) if consecutive else table.take(rows)
        length, width = self.latent_shape
        latents = picked.column("latents").combine_chunks().flatten().flatten().to_numpy(zero_copy_only=False)
        mask = picked.column("attention_mask").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        return {
            "latents": latents.reshape(len(rows), length, width),
            "attention_mask": mask.reshape(len(rows), self.max_length),
            "index": picked.column("index").to_numpy(),
            "num_tokens": picked.column("num_tokens").to_numpy(),
            "truncated": picked.column("truncated").to_numpy(zero_copy_only=False),
        }

    def __getitem__(self, item) -> dict[str, torch.Tensor]:
        if isinstance(item, (int, np.integer)):
            position = int(item) + (len(self) if item < 0 else 0)
            if not 0 <= position < len(self):
                raise IndexError(f"sample {item} outside a latent dataset of {len(self)}")
            return {key: value[0] for key, value in self[[position]].items()}
        positions = np.arange(len(self))[item] if isinstance(item, slice) else np.asarray(item, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= len(self)):
            raise IndexError(f"sample index outside a latent dataset of {len(self)}")
        shards = np.searchsorted(self._starts, positions, side="right") - 1
        parts = []
        for shard in np.unique(shards):
            chosen = np.nonzero(shards == shard)[0]
            parts.append((chosen, self._rows(self._tables[shard], positions[chosen] - self._starts[shard])))
        if not parts:  # nothing asked for: empty columns of the right shapes
            parts.append((positions, self._rows(self._tables[0], positions)))
        columns = {}
        for key in ("latents", "attention_mask", "index", "num_tokens", "truncated"):
            if len(parts) == 1:
                values = parts[0][1][key]  # the positions of one shard, in the order asked for
            else:
                values = np.empty((len(positions), *parts[0][1][key].shape[1:]), dtype=parts[0][1][key].dtype)
                for chosen, part in parts:
                    values[chosen] = part[key]
            columns[key] = values
        latents = torch.from_numpy(np.array(columns["latents"]))
        if self.bfloat16:
            latents = latents.view(torch.int16).view(torch.bfloat16)
        return {
            "latents": latents,
            "attention_mask": torch.from_numpy(np.array(columns["attention_mask"]).astype(np.int64)),
            "index": torch.from_numpy(np.array(columns["index"])),
            "num_tokens": torch.from_numpy(np.array(columns["num_tokens"]).astype(np.int64)),
            "truncated": torch.from_numpy(np.array(columns["truncated"]).astype(bool)),
        }


def open_latents(directory: str | Path) -> LatentDataset:
    """The latent dataset an export wrote into ``directory``, memory-mapped (ExportError, one line,
    if it is not a complete export)."""
    directory = Path(directory)
    path = directory / INDEX_FILE
    if not path.is_file():
        raise ExportError(f"{directory}: not a complete latent export (no {INDEX_FILE})")
    index = _read_json(path)
    if index.get("format") != FORMAT or index.get("version") not in READABLE_VERSIONS:
        raise ExportError(
            f"{path}: not a {FORMAT} index of version {' or '.join(map(str, READABLE_VERSIONS))} (format "
            f"{index.get('format')}, version {index.get('version')})"
        )
    return LatentDataset(directory, index)


def index_summary(index: dict) -> str:
    """One line about an export: samples, shape, dtype, shards."""
    shape = "x".join(str(n) for n in index["latents"]["shape"])
    return (
        f"{index['num_samples']:,} samples of {shape} {index['latents']['dtype']} latents "
        f"in {len(index['shards'])} shards"
    )
