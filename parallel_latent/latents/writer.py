"""Writing shards: a background thread per tensor-parallel group (its first rank's) that turns the
batches the model encodes into Arrow shards, so the disk works while the model encodes. A shard is
staged under ``DIR/.export/``, recorded (bytes, XXH3-128 checksum, statistics), made durable and
renamed to its final name: a reader never finds half a shard.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from parallel_latent import files
from parallel_latent.errors import os_reason

from .format import (
    PAUSE_IN_SHARD_ENV,
    PAUSE_MARKER,
    RECORDS_DIR,
    TMP_PREFIX,
    WORK_DIR,
    ExportWriteError,
    features,
    shard_name,
)

__all__ = ["Moments", "ShardWriter"]

# Batches handed to the writer thread ahead of it: the model never waits for the disk unless the
# disk is slower than the model, and at most this many batches are held in memory.
WRITE_AHEAD = 4


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
class Moments:
    """count, mean and sum of squared deviations per feature (Chan et al.'s pairwise update), in
    float64 and in a fixed order: the same bits whoever computes them."""

    count: int
    mean: np.ndarray
    m2: np.ndarray

    @classmethod
    def of(cls, vectors: np.ndarray) -> Moments:
        values = vectors.astype(np.float64)
        mean = values.mean(axis=0) if len(values) else np.zeros(values.shape[1])
        return cls(len(values), mean, ((values - mean) ** 2).sum(axis=0))

    def merged(self, other: Moments) -> Moments:
        count = self.count + other.count
        if not other.count:
            return self
        if not self.count:
            return other
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.count / count)
        m2 = self.m2 + other.m2 + delta**2 * (self.count * other.count / count)
        return Moments(count, mean, m2)

    def to_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean.tolist(), "m2": self.m2.tolist()}

    @classmethod
    def from_dict(cls, record: dict) -> Moments:
        return cls(int(record["count"]), np.asarray(record["mean"], np.float64), np.asarray(record["m2"], np.float64))

    def statistics(self) -> dict:
        """The index's ``statistics``: the count, and the per-feature mean and (population) std."""
        return {
            "over": "every latent vector at a real token (every position if the latents are not one per token)",
            "count": self.count,
            "mean": self.mean.tolist(),
            "std": np.sqrt(self.m2 / max(self.count, 1)).tolist(),
        }


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
        self.moments: Moments | None = None
        self.latent_shape: tuple[int, int] | None = None

    def write(self, latents: np.ndarray, mask: np.ndarray, rows: np.ndarray, lengths: np.ndarray, truncated) -> None:
        pa = self.pa
        batch, length, width = latents.shape
        if self.stream is None:
            self.latent_shape = (length, width)
            storage = "float32" if latents.dtype == np.float32 else "uint16"
            self.schema = features(self.latent_shape, storage, self.writer.max_length).arrow_schema
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
        moments = Moments.of(vectors)
        self.moments = moments if self.moments is None else self.moments.merged(moments)

    def publish(self) -> None:
        """Recorded, then made durable and renamed to its final name (the rename is what a reader sees)."""
        if self.written != self.count:
            raise RuntimeError(f"shard {self.index}: {self.written} rows written, {self.count} expected")
        self.stream.close()
        self.file.flush()
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
        files.publish(self.staging, self.writer.out / self.name)

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
        self.staging.unlink(missing_ok=True)


def _as_float32(latents: np.ndarray) -> np.ndarray:
    """float32 values of stored latents (bfloat16 bit patterns widened: the high half of a float32)."""
    if latents.dtype == np.float32:
        return latents
    return (latents.astype(np.uint32) << 16).view(np.float32)
