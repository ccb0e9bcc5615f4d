"""The feature cache: a frozen decoder's features of every sample, computed once and then read.

A frozen decoder's features are a pure function of a sample's tokens, so a run over the same corpus
and decoder needs them computed once, not once per epoch, seed and resume. The cache is a directory
named by its key, beside the prepared data by default (``<data cache>/features/<key>``)::

    index.json                 written last: the key's record, the shape, each shard's rows and checksum
    shard_00000.safetensors    rows [0, R) of the features, [R, T, width] fp32 (or bf16)
    shard_00000.json           that shard's sidecar: written once the shard is whole and renamed into place
    ...

The key covers everything that changes a feature: the decoder's weights (the content of its weight
files, or of a random build's tensors), its family and config, the hidden state, the dtype, the
prepared corpus (whose fingerprint covers the tokenizer and ``model.max_length``) and the rows. It
does not cover the layout (TP degree, replicate or shard), which changes features by rounding only:
a resume at another layout reads the same cache. Features are stored at real tokens only (zeros at
padding, which the encoder masks), so the rows a resize adds to the token table (the mask and pad
tokens, drawn per seed) do not enter the key unless a sample holds one of them as a real token.

Building is collective: the shards are dealt to the job's builders (every rank with a replicated
decoder; each data-parallel group with a sharded one, its TP rank 0 writing), each shard written
under a temporary name and renamed, then its sidecar; ``index.json`` last. A build killed at any
point leaves no index, and the next one keeps the shards whose sidecar and checksum hold. Opening
checks every shard's checksum (global rank 0, once per job): a damaged shard is said in one line and
built again, never read. Shards are memory-mapped: a rank's private memory does not grow with them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from parallel_latent import coordination, files
from parallel_latent.config import ConfigError
from parallel_latent.data import default_cache_dir
from parallel_latent.errors import DataError

__all__ = [
    "CACHE_FORMAT",
    "CacheSpec",
    "FeatureCache",
    "cache_spec",
    "cache_wanted",
    "job_cache",
    "job_spec",
    "open_or_build",
    "removed",
    "status",
]

CACHE_FORMAT = "parallel-latent-feature-cache"
VERSION = 1
INDEX = "index.json"
SHARD_BYTES = 256 << 20  # a shard's size at most, unless one row is larger: a few large files, never one per sample
MAX_HEADER_BYTES = 1 << 16
DTYPES = {"fp32": (np.dtype("<f4"), "F32"), "bf16": (np.dtype("<u2"), "BF16")}  # bf16 read as its bits
CHUNK = 8 << 20
BF16_NOTE = "; not exact: bf16 keeps 8 of the features' 24 significant bits"


def cache_wanted(feature_cfg: Any) -> bool:
    """Whether ``feature_model.cache`` asks for the cache: ``on``, or ``auto`` with a frozen pretrained decoder."""
    if feature_cfg.cache == "auto":
        return feature_cfg.frozen and feature_cfg.pretrained
    return feature_cfg.cache == "on"


def file_digest(path: Path) -> str:
    digest = xxhash.xxh3_128()
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """The content of named tensors, in name order (shapes and dtypes included)."""
    digest = xxhash.xxh3_128()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


@dataclass
class CacheSpec:
    """Which cache a job reads and where: its key and everything the key is computed from."""

    directory: Path
    key: str
    record: dict
    num_rows: int
    length: int
    width: int
    dtype: str  # "fp32" | "bf16"

    @property
    def row_bytes(self) -> int:
        return self.length * self.width * DTYPES[self.dtype][0].itemsize

    def shards(self, builders: int) -> list[range]:
        """The rows of each shard: at most SHARD_BYTES each, their count a multiple of ``builders``
        (so that every builder gets as many), as even as the rows allow."""
        count = max(1, -(-self.num_rows * self.row_bytes // SHARD_BYTES))
        count = min(max(self.num_rows, 1), -(-count // builders) * builders)
        per = -(-self.num_rows // count)
        return [range(start, min(start + per, self.num_rows)) for start in range(0, self.num_rows, per)]


def cache_spec(feature_cfg: Any, data_cache_dir: Path, weights_digest: str, decoder: dict, corpus: dict,
               num_rows: int, length: int, width: int, special_rows: str | None) -> CacheSpec:  # fmt: skip
    """The cache of these features. ``decoder``: the family, config and hidden state; ``corpus``: the
    prepared copy's fingerprint and content digest; ``special_rows``: the digest of the token-table
    rows of the added tokens, where a sample holds one of them as a real token (else None)."""
    record = {
        "format": CACHE_FORMAT, "version": VERSION, "weights": weights_digest, "decoder": decoder, "corpus": corpus,
        "rows": num_rows, "length": length, "width": width, "dtype": feature_cfg.cache_dtype,
        "special_rows": special_rows,
    }  # fmt: skip
    key = hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:20]
    root = Path(feature_cfg.cache_dir).expanduser().absolute() if feature_cfg.cache_dir else data_cache_dir / "features"
    return CacheSpec(root / key, key, record, num_rows, length, width, feature_cfg.cache_dtype)


# --------------------------------------------------------------------------- #
# The files.
# --------------------------------------------------------------------------- #


def _shard_name(index: int) -> str:
    return f"shard_{index:05d}.safetensors"


def _write_shard(path: Path, values: np.ndarray, dtype: str) -> str:
    """A safetensors file of one tensor, ``features``, written under a temporary name and renamed;
    returns its checksum. The header is padded so that the data starts 8-byte aligned."""
    header = {"features": {"dtype": DTYPES[dtype][1], "shape": list(values.shape), "data_offsets": [0, values.nbytes]}}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            handle.write(len(text).to_bytes(8, "little") + text)
            handle.write(np.ascontiguousarray(values).data)
        checksum = file_digest(temporary)
        files.publish(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return checksum


def _open_shard(path: Path, rows: int, length: int, width: int, dtype: str) -> np.memmap:
    """A read-only memory map of a shard's features, its header checked to be exactly as expected."""
    numpy_dtype, name = DTYPES[dtype]
    shape = [rows, length, width]
    try:
        with open(path, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            if not 0 < size <= MAX_HEADER_BYTES:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(handle.read(size))
        entry = header["features"]
        expected = {"dtype": name, "shape": shape, "data_offsets": [0, rows * length * width * numpy_dtype.itemsize]}
        if entry != expected or path.stat().st_size != 8 + size + expected["data_offsets"][1]:
            raise ValueError(f"holds {entry}, expected {expected}")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(
            f"{path}: feature cache shard is damaged ({error}); remove the cache to build it again"
        ) from None
    return np.memmap(path, dtype=numpy_dtype, mode="r", offset=8 + size, shape=tuple(shape))


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8")) if path.stat().st_size <= MAX_HEADER_BYTES * 16 else None
    except (OSError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _intact_shards(spec: CacheSpec, shards: list[range]) -> tuple[dict[int, str], list[str]]:
    """The shards on disk whose sidecar names this key and these rows and whose checksum holds
    (index -> checksum), and one line for each damaged one (removed, to be built again)."""
    intact, damaged = {}, []
    for index, rows in enumerate(shards):
        shard, sidecar = spec.directory / _shard_name(index), (spec.directory / _shard_name(index)).with_suffix(".json")
        if not sidecar.exists():
            shard.unlink(missing_ok=True)  # never finished: built again
            continue
        record = _read_json(sidecar)
        expected = {"key": spec.key, "rows": [rows.start, rows.stop]}
        problem = None
        if record is None or {k: record.get(k) for k in expected} != expected:
            problem = f"its sidecar {sidecar.name} does not describe rows {rows.start}-{rows.stop} of this cache"
        elif not shard.is_file():
            problem = "it is missing"
        elif file_digest(shard) != record.get("xxh3"):
            problem = "its checksum does not match its sidecar"
        if problem is None:
            intact[index] = record["xxh3"]
        else:
            damaged.append(f"{shard}: feature cache shard is damaged ({problem}): building it again")
            shard.unlink(missing_ok=True)
            sidecar.unlink(missing_ok=True)
    return intact, damaged


class FeatureCache:
    """A complete cache, memory-mapped: :meth:`rows` gives the features of sample rows."""

    def __init__(self, spec: CacheSpec):
        self.spec = spec
        index = _read_json(spec.directory / INDEX)
        if index is None or index.get("key") != spec.key:
            raise DataError(f"{spec.directory / INDEX}: not the index of feature cache {spec.key}")
        try:
            self.shards = [range(int(a), int(b)) for a, b in index["shards"]]
            self.per = len(self.shards[0])
            expected = [range(a, min(a + self.per, spec.num_rows)) for a in range(0, spec.num_rows, self.per)]
        except (KeyError, TypeError, ValueError, IndexError):
            expected, self.shards = None, []
        if not self.shards or self.shards != expected:
            raise DataError(f"{spec.directory / INDEX}: its shards do not cover the cache's {spec.num_rows} rows")
        self.maps = [
            _open_shard(spec.directory / _shard_name(i), len(r), spec.length, spec.width, spec.dtype)
            for i, r in enumerate(self.shards)
        ]

    @property
    def nbytes(self) -> int:
        return self.spec.num_rows * self.spec.row_bytes

    def rows(self, rows: np.ndarray) -> torch.Tensor:
        """[B, T, width] float32 features of the sample rows ``rows`` (copied out of the maps)."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.spec.num_rows):
            raise IndexError(f"sample row outside the feature cache's [0, {self.spec.num_rows})")
        out = np.empty((rows.size, self.spec.length, self.spec.width), dtype=DTYPES[self.spec.dtype][0])
        shard, offset = np.divmod(rows, self.per)
        for index in np.unique(shard):
            where = shard == index
            out[where] = self.maps[index][offset[where]]
        if self.spec.dtype == "bf16":  # the high half of a float32's bits
            return torch.from_numpy(out.astype(np.int32) << 16).view(torch.float32)
        return torch.from_numpy(out)


# --------------------------------------------------------------------------- #
# Building.
# --------------------------------------------------------------------------- #


@dataclass
class Builders:
    """How the job shares a build: ``count`` builders, this rank's (``mine``), and whether it writes."""

    count: int
    mine: int
    writes: bool


def _encode(compute, data, rows: range, dtype: str, batch_size: int, bar) -> np.ndarray:
    """The features of ``rows`` of the prepared copy ``data``, zeros at padding, in the cache's dtype."""
    parts = []
    for start in range(rows.start, rows.stop, batch_size):
        batch = data.rows(np.arange(start, min(start + batch_size, rows.stop)))
        with torch.no_grad():
            features = compute(batch["input_ids"], batch["attention_mask"]).float().cpu()
        features = features.masked_fill(batch["attention_mask"].unsqueeze(-1) == 0, 0.0)
        if dtype == "bf16":
            features = features.to(torch.bfloat16).view(torch.int16)
        parts.append(features.numpy())
        if bar is not None:
            bar.update(features.shape[0])
    out = np.concatenate(parts)
    return out.view(DTYPES[dtype][0]) if dtype == "bf16" else out


def _plan(spec: CacheSpec, shards: list[range]) -> tuple[list[int], dict[int, str]]:
    """Rank 0: which shards must be built, and the checksums of those kept. Checks free disk space."""
    if (index := _read_json(spec.directory / INDEX)) is not None and index.get("key") != spec.key:
        raise DataError(f"{spec.directory / INDEX}: belongs to another feature cache; remove {spec.directory}")
    spec.directory.mkdir(parents=True, exist_ok=True)
    intact, damaged = _intact_shards(spec, shards)
    for line in damaged:
        print(line, flush=True)
    if damaged:
        (spec.directory / INDEX).unlink(missing_ok=True)
    missing = [i for i in range(len(shards)) if i not in intact]
    needed = sum(len(shards[i]) for i in missing) * spec.row_bytes
    free = shutil.disk_usage(spec.directory).free
    if needed > free:
        raise DataError(
            f"{spec.directory}: the feature cache needs {needed / 2**20:,.0f} MiB and {free / 2**20:,.0f} MiB are "
            "free; set feature_model.cache_dir to a larger disk, or feature_model.cache=off"
        )
    return missing, intact


def open_or_build(spec: CacheSpec, data, compute, builders: Builders, batch_size: int, announce: bool = True):
    """The complete cache of ``spec`` on every rank (collective), built first where it is not:
    ``compute(input_ids, attention_mask)`` gives a batch's features (on this rank's decoder)."""
    shards = spec.shards(builders.count)
    plan = coordination.decided_by_main(_plan, spec, shards, errors=DataError)
    missing, intact = plan
    if missing:
        started = time.perf_counter()
        mine = [i for i in missing if i % builders.count == builders.mine]
        total = sum(len(shards[i]) for i in mine)
        if announce and coordination.is_main():
            size = sum(len(shards[i]) for i in missing) * spec.row_bytes
            print(
                f"building the feature cache ({len(missing)} of {len(shards)} shards, {size / 2**20:,.1f} MiB, "
                f"{spec.dtype}{BF16_NOTE if spec.dtype == 'bf16' else ''}) "
                f"into {spec.directory} ...",
                flush=True,
            )
        bar = None
        if announce and coordination.is_main():
            from tqdm import tqdm

            bar = tqdm(total=total, desc="feature cache", unit="sample", dynamic_ncols=True)
        failure, written = None, {}
        try:
            for index in mine:
                values = _encode(compute, data, shards[index], spec.dtype, batch_size, bar)
                if builders.writes:
                    shard = spec.directory / _shard_name(index)
                    written[index] = _write_shard(shard, values, spec.dtype)
                    rows = shards[index]
                    files.replace_file(
                        shard.with_suffix(".json"),
                        json.dumps({"key": spec.key, "rows": [rows.start, rows.stop], "xxh3": written[index]}),
                    )
        except Exception as error:  # the others must not wait for this rank
            failure = error
        finally:
            if bar is not None:
                bar.close()
        coordination.fail_together(failure, DataError)
        for part in coordination.all_gather_value(written):
            intact.update(part)
        if coordination.is_main():
            index = {"format": CACHE_FORMAT, "key": spec.key, "record": spec.record,
                     "shards": [[r.start, r.stop] for r in shards],
                     "checksums": [intact[i] for i in range(len(shards))]}  # fmt: skip
            files.replace_file(spec.directory / INDEX, json.dumps(index, indent=1))
            if announce:
                print(
                    f"feature cache built in {time.perf_counter() - started:.1f} s: {spec.num_rows:,} samples, "
                    f"{spec.num_rows * spec.row_bytes / 2**20:,.1f} MiB",
                    flush=True,
                )
        coordination.barrier()
    elif announce and coordination.is_main():
        print(f"feature cache: {spec.directory} ({spec.num_rows * spec.row_bytes / 2**20:,.1f} MiB)", flush=True)
    return coordination.checked_by_all(FeatureCache, spec, errors=DataError)


def removed(directory: Path) -> bool:
    """Remove a cache directory (``parallel-latent feature-cache remove``); False if there was none."""
    if not directory.is_dir():
        return False
    shutil.rmtree(directory)
    return True


# --------------------------------------------------------------------------- #
# A training job's cache.
# --------------------------------------------------------------------------- #


def _holds_tokens(data, num_rows: int, ids: list[int]) -> bool:
    """Whether any of the first ``num_rows`` samples holds one of ``ids`` as a real token."""
    tokens = np.asarray(data.input_ids[:num_rows])
    real = np.arange(data.max_length) < np.asarray(data.lengths[:num_rows])[:, None]
    return bool(np.isin(tokens[real], ids).any())


def job_spec(cfg: Any, feature_model, data, num_rows: int) -> CacheSpec:
    """The cache a job over ``data`` (a prepared copy, its first ``num_rows`` samples) reads with this
    feature model: computed on rank 0 (it reads the decoder's weight files whole), said to all."""

    def compute() -> CacheSpec:
        special = [cfg.model.mask_token_id, cfg.model.pad_token_id]
        special_rows = None
        if feature_model.source is not None and _holds_tokens(data, num_rows, special):
            special_rows = tensors_digest({str(i): feature_model.token_table[i] for i in special})
        config = {k: v for k, v in feature_model.decoder_config.to_dict().items() if not k.startswith("_")}
        config.pop("transformers_version", None)
        # computed_in: a bf16 run's decoder computes its features in bf16.
        decoder = {"family": feature_model.family.name, "config": config, "hidden_state": feature_model.hidden_state,
                   "sink_token_id": feature_model.sink_token_id,
                   "computed_in": str(feature_model.token_table.dtype)}  # fmt: skip
        corpus = {"fingerprint": data.fingerprint, "content": data.content_digest}
        return cache_spec(
            cfg.feature_model, default_cache_dir(cfg.data.cache_dir), feature_model.weights_digest(), decoder, corpus,
            num_rows, data.max_length, feature_model.width, special_rows,
        )  # fmt: skip

    return coordination.decided_by_main(compute, errors=(ConfigError, DataError))


def job_cache(
    cfg: Any, feature_model, data, num_rows: int, state=None, device="cpu", announce: bool = True
) -> FeatureCache:
    """The feature cache of a training job (collective), built by its ranks where it is not complete:
    with a replicated decoder every rank encodes its share, with a sharded one each data-parallel
    group (its TP rank 0 writing). ``state``: the job's ParallelState, None in one process."""
    spec = job_spec(cfg, feature_model, data, num_rows)
    if state is None:
        builders = Builders(1, 0, True)
    elif feature_model.sharded:
        builders = Builders(state.dp_size, state.dp_rank, state.tp_rank == 0)
    else:
        builders = Builders(state.world_size, state.rank, True)
    if state is not None and state.world_size > 1:
        if coordination.is_main():
            spec.directory.parent.mkdir(parents=True, exist_ok=True)
        coordination.barrier()
        if not coordination.directory_is_shared(spec.directory.parent):
            raise DataError(
                f"{spec.directory.parent}: the feature cache is not one directory for all ranks; set "
                "feature_model.cache_dir (or data.cache_dir) to a file system every node shares"
            )

    def compute(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return feature_model(input_ids.to(device), attention_mask.to(device))

    return open_or_build(spec, data, compute, builders, 4 * cfg.training.micro_batch_size, announce)


def status(spec: CacheSpec) -> str:
    """One line on the cache of ``spec``: complete, partly built (shards published), or absent."""
    size = spec.num_rows * spec.row_bytes / 2**20
    what = f"{spec.num_rows:,} samples x {spec.length} tokens x {spec.width} features, {spec.dtype}, {size:,.1f} MiB"
    if (index := _read_json(spec.directory / INDEX)) is not None and index.get("key") == spec.key:
        return f"{spec.directory}: complete ({len(index.get('shards', []))} shards; {what})"
    published = len(list(spec.directory.glob("shard_*.json"))) if spec.directory.is_dir() else 0
    if published:
        return f"{spec.directory}: partly built ({published} shards published; {what}); training continues it"
    return f"{spec.directory}: not built ({what})"
