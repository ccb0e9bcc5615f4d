"""The latent dataset's format: the files of an export directory, its errors, and the index.

An export directory holds::

    DIR/data-00000-of-000NN.arrow   Arrow IPC stream files, one per shard of ``export.shard_size``
                                    rows; columns ``latents`` [T', d'] (float32, or bfloat16 stored as
                                    its 16-bit pattern in uint16), ``attention_mask`` [T] int8,
                                    ``index`` (the row in the prepared copy), ``num_tokens``, ``truncated``
    DIR/state.json, dataset_info.json
                                    what ``datasets.load_from_disk(DIR)`` reads (memory-mapped)
    DIR/latents.json                the index (:func:`index_record`): format version, model record,
                                    shapes, dtype, the export settings, the corpus (and the rows each
                                    source file gave), per-shard row ranges and XXH3-128 checksums, the
                                    latents' per-feature mean and std; no timestamps, so the whole
                                    directory is the same bytes whoever wrote it, in however many runs
    DIR/.export/                    the work files of an unfinished export (gone once it is complete)
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from parallel_latent.errors import BadInput, ExitStatus, first_line
from parallel_latent.files import load_json_file

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "INDEX_FILE",
    "READABLE_VERSIONS",
    "ExportError",
    "ExportWriteError",
    "datasets_files",
    "export_identity",
    "features",
    "index_record",
    "read_json",
    "shard_name",
]

FORMAT = "parallel-latent-latents"
# Version 2 checksums each shard with XXH3-128 (``xxh3_128``); version 1, also read, with SHA-256,
# which hashes some 2 GB/s on one core and would cap a GPU export of gpt2.yaml's latents (196 KB a
# sample) near 10k samples/s. The columns are the same.
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
# The prepared copy's rule, as the index states it: its rows are the source's non-empty samples, in order.
ROWS_RULE = (
    "row i is the i-th non-empty sample of the source (record.source: its files in that order, "
    "or a saved or hub dataset's split), cut to max_length tokens: a line or paragraph of a text file "
    "(record.sample_unit), the text_field of a JSONL, parquet or CSV record or of a dataset's row; files: "
    "the rows each part gave, row first_row + k its k-th sample (an entry per file; a saved or hub "
    "dataset: one, its location and split, every row), null if the source cannot be read now or its "
    "counts do not add up to the copy's rows (it changed since it was prepared)"
)


class ExportError(BadInput):
    """An export that cannot start: bad settings, an output directory holding something else, a
    checkpoint that is not an autoencoder (one line, exit status 2)."""


class ExportWriteError(RuntimeError):
    """A shard or the index could not be written (a full disk, an I/O error): every completed shard
    is intact and a rerun continues from them (one line, exit status 4, as a failed checkpoint save)."""

    exit_status = ExitStatus.SAVE_FAILED


def shard_name(index: int, count: int) -> str:
    return f"data-{index:05d}-of-{count:05d}.arrow"


def read_json(path: Path) -> dict:
    """An export record (the index, the run record), or ExportError (one line) if it cannot be read."""
    try:
        value = load_json_file(path)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ExportError(f"{path}: unreadable ({first_line(error)}); delete the export to start again") from None
    if not isinstance(value, dict):
        raise ExportError(f"{path}: not an export record; delete the export to start again")
    return value


def features(latent_shape: tuple[int, int], storage: str, max_length: int):
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


def export_identity(plan, data) -> dict:
    """What makes an export this one: the checkpoint, the corpus and the settings that shape the bytes."""
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


def index_record(plan, data, shards: list[dict], latent_shape: tuple, moments, files_of_rows) -> dict:
    """The index (``latents.json``) of a complete export of ``data`` by ``plan``: ``shards`` their
    records, ``moments`` the latents' merged statistics, ``files_of_rows`` the rows each source file gave."""
    bf16 = plan.export.precision == "bf16"
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "identity": export_identity(plan, data),
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
            "rows": ROWS_RULE,
            "max_length": data.max_length,
            "files": files_of_rows,
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
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "shards": shards,
        "statistics": moments.statistics(),
    }


def datasets_files(shards: list[dict], num_samples: int, latent_shape: tuple, storage: str, max_length: int):
    """(``state.json``, ``dataset_info.json``) of an export: what ``datasets.load_from_disk`` reads."""
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
        "description": f"{FORMAT}: latents of {num_samples} samples; see {INDEX_FILE}",
        "features": features(latent_shape, storage, max_length).to_dict(),
        "homepage": "",
        "license": "",
    }
    return state, info
