"""``parallel-latent export``: the portable weights of any checkpoint, offline, in one process.

A training checkpoint saved with ``checkpoint.export_portable`` already holds them (``model/``,
copied); one saved without gets them from its universal state (converted from DeepSpeed's files
into a temporary directory if needed, so the checkpoint itself is left as it is): trained weights
are the fp32 masters cast to the model's dtype, the rest are stored as they were.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .errors import CheckpointError
from .portable import (
    MANIFEST_NAME,
    MODEL_PREFIX,
    Entry,
    Placement,
    PortableCheckpoint,
    assemble_manifest,
    fsync_directory,
    write_json_atomic,
    write_rank_file,
)
from .reshard import FROZEN, MASTER, convert_to_universal
from .safetensors_io import dtype_from_name


def _copy_tree_into_place(source: Path, output: Path) -> Path:
    staging = output.with_name(f".{output.name}.partial")
    if staging.exists():
        shutil.rmtree(staging)
    shutil.copytree(source, staging)
    os.rename(staging, output)
    fsync_directory(output.parent)
    return output


def _model_from_universal(universal_dir: Path, table: dict, output: Path, step: int | None) -> Path:
    universal = PortableCheckpoint(universal_dir)
    tp_size = universal.manifest["tp_size"]
    staging = output.with_name(f".{output.name}.partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    parts, first_rank_entries = [], None
    for tp_rank in range(tp_size):
        entries = []
        for name, spec in table.items():
            place = Placement(spec["partition_dim"], tuple(spec["local_shape"]), tuple(spec["full_shape"]))
            dtype = dtype_from_name(spec["dtype"])
            key = f"{MASTER}/{name}" if spec["trainable"] else f"{FROZEN}/{name}"
            entries.append(
                Entry(name, dtype, place, lambda k=key, p=place, r=tp_rank, d=dtype: universal.read_block(k, p, r, d))
            )
        parts.append(
            write_rank_file(staging, entries, prefix=MODEL_PREFIX, tp_rank=tp_rank, tp_size=tp_size, is_writer=True)
        )
        first_rank_entries = first_rank_entries or entries
    fields = {
        k: v
        for k, v in universal.manifest.items()
        if k
        not in (
            "format",
            "format_version",
            "tp_size",
            "files",
            "tensors",
            "aliases",
            "optimizer",
            "source_layout",
            "converted_from",
        )
    }
    fields.update(contents="model", step=step)
    aliases = {a.removeprefix(f"{FROZEN}/"): t.removeprefix(f"{FROZEN}/") for a, t in universal.aliases.items()}
    write_json_atomic(staging / MANIFEST_NAME, assemble_manifest(first_rank_entries, parts, tp_size, fields, aliases))
    os.rename(staging, output)
    fsync_directory(output.parent)
    return output


def export_portable(source: str | Path, output: str | Path) -> Path:
    """Write the portable weights of ``source`` (a portable directory, a training checkpoint, or
    a checkpoints directory's ``latest``) to the new directory ``output``."""
    from .training import INFO_FILE, PORTABLE_DIR, UNIVERSAL_DIR, read_info, resolve_checkpoint

    source, output = Path(source), Path(output)
    if output.exists():
        raise CheckpointError(f"{output}: already exists; not overwriting")
    if (source / MANIFEST_NAME).is_file():
        PortableCheckpoint(source)  # validate before copying
        return _copy_tree_into_place(source, output)
    step_dir = resolve_checkpoint(source)
    if (step_dir / PORTABLE_DIR / MANIFEST_NAME).is_file():
        return _copy_tree_into_place(step_dir / PORTABLE_DIR, output)
    info = read_info(step_dir)
    table = info.get("tensors")
    if not table:
        raise CheckpointError(f"{step_dir / INFO_FILE}: no tensor table; cannot export offline")
    if (step_dir / UNIVERSAL_DIR / MANIFEST_NAME).is_file():
        return _model_from_universal(step_dir / UNIVERSAL_DIR, table, output, info["step"])
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}.universal-") as scratch:
        universal = convert_to_universal(step_dir, Path(scratch) / "universal")
        return _model_from_universal(universal, table, output, info["step"])


__all__ = ["export_portable"]
