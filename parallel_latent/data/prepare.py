"""Preparing a corpus once: tokenise it with Hugging Face ``datasets`` into a prepared copy in the
cache, fingerprinted, written under a temporary name and published by rename; and opening it from
every rank of a job, with one preparer per file system.

The cache (``data.cache_dir``; "" = ``$PARALLEL_LATENT_DATA_CACHE``, else
``~/.cache/parallel-latent/data``) holds one directory per fingerprint, ``<name>-<fingerprint>``.
The fingerprint covers everything the rows depend on: the source's identity (each file's absolute
path, size and modification time; a hub dataset's name, config and split), the tokenizer (a hash
of its serialisation), ``model.max_length``, the sample unit, the text field and the format. A
change in any of them names another directory: a stale copy is never read. The held-out split is
not part of the copy (it is computed at training time from the number of samples), so changing
``data.eval_fraction`` or ``data.max_samples`` reuses the copy.

Who prepares: in a job, the ranks first check (cheaply) whether the copy exists. If not, the cache
directory is probed with :func:`~parallel_latent.coordination.directory_is_shared`: on one shared
file system global rank 0 prepares and the others wait; on node-local disks local rank 0 of every
node prepares its node's copy. A file lock (``.lock-<fingerprint>``) serialises preparers that the
job does not know about (``parallel-latent prepare`` run by hand, a second job). A preparer killed
midway leaves only its ``.tmp-*`` directory, which the next preparer removes.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import json
import math
import os
import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parallel_latent import coordination, files
from parallel_latent.data.prepared import FORMAT_VERSION, META, PREPARED_MARKER, PreparedDataset
from parallel_latent.data.sources import (
    Source,
    batch_samples,
    diagnose,
    load_source_datasets,
    resolve_source,
)
from parallel_latent.data.tokenize import RowEncoder, token_dtype, tokenizer_identity
from parallel_latent.errors import DataError, first_line, os_reason

__all__ = [
    "CACHE_ENV",
    "LOG_NAME",
    "PrepareSpec",
    "default_cache_dir",
    "describe",
    "make_spec",
    "open_for_training",
    "open_prepared",
    "prepare",
]

CACHE_ENV = "PARALLEL_LATENT_DATA_CACHE"
LOG_NAME = "prepare-log.jsonl"
TMP_PREFIX = ".tmp-"
LOCK_PREFIX = ".lock-"
MAP_BATCH = 2048
# One process tokenises with the tokenizer's own threads, which leave its Python share (about a
# sixth of the work) serial; worker processes (spawned, single-threaded each) pay a process start,
# their imports and a cold tokenizer cache each. Measured on 2 cores, one process is faster;
# workers pay off on larger machines, for corpora of at least this many rows per worker.
ROWS_PER_WORKER = 100_000
MIN_CPUS_FOR_WORKERS = 8
MAX_WORKERS = 16
WRITE_ROWS = 1 << 16


def default_cache_dir(cache_dir: str = "") -> Path:
    """``data.cache_dir``, else ``$PARALLEL_LATENT_DATA_CACHE``, else ``~/.cache/parallel-latent/data``."""
    chosen = cache_dir or os.environ.get(CACHE_ENV, "") or str(Path("~/.cache/parallel-latent/data"))
    return Path(chosen).expanduser().absolute()


@dataclass
class PrepareSpec:
    """What to prepare and where: everything fingerprinted, plus the tokenizer itself."""

    source: Source
    tokenizer: Any
    max_length: int
    text_field: str
    sample_unit: str
    split: str
    num_workers: int
    cache_dir: Path
    record: dict[str, Any]  # what the fingerprint is computed from
    fingerprint: str

    @property
    def target(self) -> Path:
        return self.cache_dir / f"{self.source.slug}-{self.fingerprint}"


def make_spec(cfg: Any, tokenizer: Any) -> PrepareSpec:
    """The preparation ``cfg`` asks for (cheap: stats the source files, hashes the tokenizer)."""
    data = cfg.data
    source = resolve_source(data.path, data.format)
    identity = tokenizer_identity(tokenizer)
    record = {
        "format": PREPARED_MARKER,
        "version": FORMAT_VERSION,
        "source": source.identity(),
        "split": data.split if source.kind in ("hub", "saved") else None,
        "data_format": data.format,
        "text_field": data.text_field,
        "sample_unit": data.sample_unit,
        "tokenizer": identity,
        "max_length": cfg.model.max_length,
    }
    fingerprint = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:20]
    return PrepareSpec(
        source=source,
        tokenizer=tokenizer,
        max_length=cfg.model.max_length,
        text_field=data.text_field,
        sample_unit=data.sample_unit,
        split=data.split,
        num_workers=data.num_workers,
        cache_dir=default_cache_dir(data.cache_dir),
        record=record,
        fingerprint=fingerprint,
    )


# --------------------------------------------------------------------------- #
# Opening.
# --------------------------------------------------------------------------- #


def open_prepared(path: Path, spec: PrepareSpec, fingerprint: str | None = None) -> PreparedDataset:
    """The prepared copy at ``path``, checked to fit ``spec``: the fingerprint (when opened from the
    cache), or the tokenizer and length (when ``data.path`` names a prepared copy directly)."""
    data = PreparedDataset(path)
    if fingerprint is not None and data.fingerprint != fingerprint:
        raise DataError(
            f"{path}: prepared copy holds fingerprint {data.fingerprint}, expected {fingerprint}; "
            "delete the directory to prepare again"
        )
    if data.max_length != spec.max_length:
        raise DataError(
            f"{path}: prepared copy has rows of {data.max_length} tokens but model.max_length={spec.max_length}"
        )
    made_with = data.meta.get("record", {}).get("tokenizer", {}).get("sha256")
    if made_with != spec.record["tokenizer"]["sha256"]:
        raise DataError(f"{path}: prepared copy was made with another tokenizer than tokenizer.name_or_path gives")
    return data


def _open_if_present(spec: PrepareSpec) -> PreparedDataset | None:
    """The copy for ``spec`` if it is published; DataError if something unusable sits there."""
    if spec.source.kind == "prepared":
        return open_prepared(Path(spec.source.location), spec)
    if not spec.target.exists():
        return None
    return open_prepared(spec.target, spec, spec.fingerprint)


# --------------------------------------------------------------------------- #
# Preparing (one process).
# --------------------------------------------------------------------------- #


def _ensure_writable(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DataError(
            f"{directory}: cannot create the data cache directory ({os_reason(error)}); "
            f"set data.cache_dir or {CACHE_ENV}"
        ) from None
    if not directory.is_dir() or not os.access(directory, os.W_OK | os.X_OK):
        raise DataError(f"{directory}: data cache directory is not writable; set data.cache_dir or {CACHE_ENV}")


@contextlib.contextmanager
def _locked(directory: Path, fingerprint: str) -> Iterator[None]:
    """An exclusive lock per fingerprint (:class:`parallel_latent.files.ExclusiveLock`: an flock, else
    a renewed lease), held while this process prepares; the others wait for it."""
    lock = files.ExclusiveLock(directory / f"{LOCK_PREFIX}{fingerprint}")
    try:
        lock.acquire(math.inf)
    except OSError as error:
        raise DataError(f"{directory}: cannot write in the data cache directory ({os_reason(error)})") from None
    try:
        yield
    finally:
        lock.release()


def _temporary_name(fingerprint: str) -> str:
    host = socket.gethostname().replace("-", "_")
    return f"{TMP_PREFIX}{fingerprint}-{host}-{os.getpid()}-{os.urandom(4).hex()}"


def _remove_stale_temporaries(directory: Path, fingerprint: str) -> None:
    """Leftovers of preparers that died: with the lock held, every ``.tmp-<fingerprint>-*`` is one."""
    for leftover in directory.glob(f"{TMP_PREFIX}{fingerprint}-*"):
        files.discard(leftover)


def _tokenize_batch(batch: dict[str, list], encoder: RowEncoder, unit: str) -> dict[str, np.ndarray]:
    texts = batch_samples(batch["text"], unit)
    ids, lengths, truncated = encoder(texts)
    kept = lengths > 0  # a sample without any token is dropped, as tokenize_samples does
    return {
        "input_ids": ids[kept],
        "length": lengths[kept].astype(np.uint32),
        "truncated": truncated[kept],
    }


def _workers(configured: int, rows: int) -> int:
    if configured:
        return configured
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if cpus < MIN_CPUS_FOR_WORKERS:
        return 1
    return max(1, min(cpus, MAX_WORKERS, rows // ROWS_PER_WORKER))


class _ArrayWriter:
    """Appends rows to a .npy file whose final shape is known, hashing what it writes. Plain writes,
    not a memmap: dirty pages of a mapping would count in this process's resident memory."""

    def __init__(self, path: Path, dtype: np.dtype, shape: tuple[int, ...], digest):
        self.path, self.dtype, self.digest = path, np.dtype(dtype), digest
        self.handle = open(path, "wb")  # noqa: SIM115 (closed in close())
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": shape}
        np.lib.format.write_array_header_1_0(self.handle, header)

    def write(self, values: np.ndarray) -> None:
        data = np.ascontiguousarray(values, dtype=self.dtype).tobytes()
        self.digest.update(data)
        self.handle.write(data)

    def close(self) -> None:  # (made durable when the copy is published)
        self.handle.close()


def _build(spec: PrepareSpec, tmp: Path, progress: bool) -> dict[str, Any]:
    """Tokenise the source into ``tmp`` (the arrays, then meta.json); return the meta. Three stages,
    each timed: load the source, tokenise it (``datasets.map``), write the arrays."""
    started = time.perf_counter()
    work = tmp / "work"
    work.mkdir()
    dtype = token_dtype(len(spec.tokenizer))
    pieces = load_source_datasets(spec.source, spec.text_field, spec.sample_unit, spec.split, work)
    loaded = time.perf_counter()
    tokenized = _tokenize(spec, pieces, dtype, work, progress)
    tokenized_at = time.perf_counter()
    counts = _write_arrays(spec, tokenized, dtype, tmp)
    del tokenized, pieces
    shutil.rmtree(work, ignore_errors=True)
    meta = {
        "format": PREPARED_MARKER,
        "version": FORMAT_VERSION,
        "fingerprint": spec.fingerprint,
        "record": spec.record,
        "source": spec.source.location,
        "max_length": spec.max_length,
        "dtype": dtype.name,
        "vocab_size": len(spec.tokenizer),
        "pad_token_id": spec.tokenizer.pad_token_id,
        **counts,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "seconds": round(time.perf_counter() - started, 3),
        "phases": {
            "load": round(loaded - started, 3),
            "tokenize": round(tokenized_at - loaded, 3),
            "write": round(time.perf_counter() - tokenized_at, 3),
        },
    }
    (tmp / META).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    return meta


def _tokenize(spec: PrepareSpec, pieces: list, dtype: np.dtype, work: Path, progress: bool) -> list:
    """Each loaded piece tokenised into fixed-length rows (Arrow files under ``work``)."""
    import datasets

    encoder = RowEncoder(spec.tokenizer, spec.max_length, spec.tokenizer.pad_token_id, dtype)
    features = datasets.Features(
        {
            # datasets >= 4 names fixed-length lists List; Sequence is the older name of the same.
            "input_ids": getattr(datasets, "List", datasets.Sequence)(
                datasets.Value(dtype.name), length=spec.max_length
            ),
            "length": datasets.Value("uint32"),
            "truncated": datasets.Value("bool"),
        }
    )
    tokenized = []
    for index, (dataset, unit) in enumerate(pieces):
        job = _MapJob(encoder, unit, features, work / f"tokenized-{index}", f"{spec.fingerprint}-{index}")
        try:
            tokenized.append(_map_piece(dataset, job, _workers(spec.num_workers, len(dataset)), progress))
        except DataError:
            raise
        except ValueError as error:  # text that cannot be decoded reaches Python only here
            if spec.source.kind == "files":
                raise diagnose(list(spec.source.files), spec.text_field, error) from None
            raise DataError(f"{spec.source.location}: {first_line(error)}") from None
    return tokenized


@dataclass(frozen=True)
class _MapJob:
    """What tokenising one piece (or one shard of it) needs; picklable, for worker processes."""

    encoder: RowEncoder
    unit: str
    features: Any
    stem: Path  # of the Arrow file(s) written
    fingerprint: str


def _map_piece(dataset: Any, job: _MapJob, workers: int, progress: bool) -> Any:
    """One piece tokenised in this process, or in ``workers`` contiguous shards by spawned worker
    processes. Spawned, never forked: the caller is often a training rank whose threads (the
    process group's, the allocator's, the compiler's) may hold a lock at the moment of a fork, and
    a forked worker then waits on it forever (``datasets.map(num_proc=...)`` forks)."""
    if workers <= 1:
        return _map_shard(dataset, job, 0, progress)
    import concurrent.futures
    import multiprocessing

    import datasets

    shards = [dataset.shard(workers, rank, contiguous=True) for rank in range(workers)]
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=spawn, initializer=_one_thread) as pool:
        futures = [
            pool.submit(_map_shard, shard, job, rank, progress and rank == 0) for rank, shard in enumerate(shards)
        ]
        return datasets.concatenate_datasets([future.result() for future in futures])


def _one_thread() -> None:
    """A worker's tokenizer without threads of its own: the workers are the parallelism."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _map_shard(dataset: Any, job: _MapJob, rank: int, progress: bool) -> Any:
    import datasets

    if progress:  # the tokenising bars (one per piece; shard 0's when in workers); loading stays quiet
        datasets.enable_progress_bars()
    else:
        datasets.disable_progress_bars()
    return dataset.map(
        _tokenize_batch,
        batched=True,
        batch_size=MAP_BATCH,
        remove_columns=dataset.column_names,
        fn_kwargs={"encoder": job.encoder, "unit": job.unit},
        features=job.features,
        cache_file_name=f"{job.stem}-{rank:05d}.arrow",
        new_fingerprint=f"{job.fingerprint}-{rank}",
        load_from_cache_file=False,
        desc="tokenizing",
    )


def _write_arrays(spec: PrepareSpec, tokenized: list, dtype: np.dtype, tmp: Path) -> dict[str, Any]:
    """The token rows, lengths and truncation flags as .npy files in ``tmp``; the counts, the
    content digest and the file sizes for meta.json."""
    num_samples = sum(len(piece) for piece in tokenized)
    if num_samples == 0:
        raise DataError(f"{spec.source.location}: corpus is empty (no non-empty samples)")
    digest = hashlib.sha256()
    length_dtype = token_dtype(spec.max_length + 1)
    writers = {
        "input_ids": _ArrayWriter(tmp / "input_ids.npy", dtype, (num_samples, spec.max_length), digest),
        "lengths": _ArrayWriter(tmp / "lengths.npy", length_dtype, (num_samples,), digest),
        "truncated": _ArrayWriter(tmp / "truncated.npy", np.dtype(bool), (num_samples,), digest),
    }
    num_tokens = num_truncated = 0
    for piece in tokenized:
        for batch in piece.data.table.to_batches(max_chunksize=WRITE_ROWS):
            ids = batch.column("input_ids").flatten().to_numpy(zero_copy_only=False)
            lengths = batch.column("length").to_numpy(zero_copy_only=False)
            truncated = batch.column("truncated").to_numpy(zero_copy_only=False)
            writers["input_ids"].write(ids.reshape(-1, spec.max_length))
            writers["lengths"].write(lengths)
            writers["truncated"].write(truncated)
            num_tokens += int(lengths.sum())
            num_truncated += int(truncated.sum())
    for writer in writers.values():
        writer.close()
    return {
        "num_samples": num_samples,
        "length_dtype": length_dtype.name,
        "num_tokens": num_tokens,
        "num_truncated": num_truncated,
        "content_sha256": digest.hexdigest(),
        "files": {f"{name}.npy": (tmp / f"{name}.npy").stat().st_size for name in writers},
    }


def _publish(stage: files.Staged) -> None:
    """The staged copy made durable and renamed to its target (:meth:`parallel_latent.files.Staged.publish`)."""
    try:
        stage.publish()
    except OSError as error:
        if error.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise DataError(f"{stage.final}: cannot publish the prepared copy ({os_reason(error)})") from None
        # Published meanwhile by a preparer that did not hold the lock (its lease had expired).


def _log(spec: PrepareSpec, meta: dict[str, Any]) -> None:
    """One line per preparation in the cache's log: who prepared what, when, how long it took."""
    entry = {
        "time": meta["created"],
        "host": meta["host"],
        "pid": os.getpid(),
        "rank": os.environ.get("RANK"),
        "fingerprint": spec.fingerprint,
        "path": str(spec.target),
        "source": spec.source.location,
        "num_samples": meta["num_samples"],
        "seconds": meta["seconds"],
    }
    with contextlib.suppress(OSError), open(spec.cache_dir / LOG_NAME, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry) + "\n")


def prepare(spec: PrepareSpec, progress: bool = False) -> tuple[PreparedDataset, bool]:
    """The prepared copy for ``spec``, preparing it unless a valid one is published: (copy, whether
    this call prepared it). One process; safe against concurrent preparers (lock, rename)."""
    found = _open_if_present(spec)
    if found is not None:
        return found, False
    directory = spec.cache_dir
    _ensure_writable(directory)
    with _locked(directory, spec.fingerprint):
        found = _open_if_present(spec)  # prepared by whoever held the lock before us
        if found is not None:
            return found, False
        _remove_stale_temporaries(directory, spec.fingerprint)
        with files.Staged(spec.target, directory / _temporary_name(spec.fingerprint)) as stage:
            meta = _build(spec, stage.path, progress)
            _publish(stage)
        _log(spec, meta)
    return open_prepared(spec.target, spec, spec.fingerprint), True


# --------------------------------------------------------------------------- #
# Opening from every rank of a job.
# --------------------------------------------------------------------------- #


def _agreed(function, *args):
    """``function(*args)`` on every rank; if it raised a DataError on any rank, all raise it."""
    return coordination.checked_by_all(function, *args, errors=DataError)


def open_for_training(cfg: Any, tokenizer: Any, announce: bool = True) -> PreparedDataset:
    """The prepared copy of ``cfg.data`` on every rank, preparing it first where it is missing
    (collective when a process group is up; a plain call in one process). ``announce``: the
    preparer says on stdout what it prepares."""
    spec = _agreed(make_spec, cfg, tokenizer)
    data = _agreed(_open_if_present, spec)
    if not coordination.all_ranks_agree(data is not None):
        _agreed(_ensure_writable, spec.cache_dir)
        shared = coordination.directory_is_shared(spec.cache_dir)
        if shared:
            # One file system: every rank reads what global rank 0 prepares (the nodes' own
            # fingerprints could differ if each node holds a copy of the corpus).
            fingerprint, target = coordination.broadcast_value((spec.fingerprint, str(spec.target)))
        else:
            fingerprint, target = spec.fingerprint, str(spec.target)
        preparer = coordination.is_main() if shared else coordination.is_local_main()
        failure = None
        if preparer:
            try:
                # stdout: stderr is kept for the one-line error should the preparation fail.
                if announce and not spec.target.exists():
                    print(f"preparing {spec.source.location} into {spec.target} ...", flush=True)
                prepared, created = prepare(spec)
                if created and announce:
                    print(f"prepared in {prepared.meta.get('seconds', 0.0):.1f} s: {describe(prepared)}", flush=True)
            except Exception as caught:  # the others must not wait forever for this rank
                failure = caught
        coordination.fail_together(failure, DataError)
        data = _agreed(open_prepared, Path(target), spec, fingerprint)
    reference = coordination.broadcast_value(data.content_digest)
    if not coordination.all_ranks_agree(data.content_digest == reference):
        raise DataError(
            f"{data.path}: the prepared copies of the nodes differ (content digest); the nodes' corpora "
            "differ: put the corpus or data.cache_dir on a shared file system"
        )
    return data


def describe(data: PreparedDataset) -> str:
    meta = data.meta
    return (
        f"{data.path}: {data.num_samples:,} samples of {data.max_length} tokens, "
        f"{data.num_truncated:,} truncated, fingerprint {meta['fingerprint']}"
    )
