"""The portable checkpoint: a model's weights as shards (:mod:`.shards`) that load at any TP degree.

Layout of a portable directory::

    manifest.json                      # format, TP degree, the model's record, tokenizer facts, every tensor
    model-tp00-of-04.safetensors       # what TP rank 0 holds (padding stripped), replicated tensors
    model-tp01-of-04.safetensors       # ... TP rank 1's slices only

What the manifest says about the architecture is the model's own account of itself
(``model.checkpoint_record()``); on loading, the model says whether a record fits it
(``model.checkpoint_mismatch(record)``). This package knows no particular model.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from parallel_latent.coordination import all_gather_value
from parallel_latent.parallel.state import get_dp_rank
from parallel_latent.parallel.utils import group_rank, group_size

from .layout import (
    MANIFEST_NAME,
    CheckpointError,
    CheckpointSaveError,
    attempt,
    partial,
    publish,
    require_empty_output,
    resolve_portable_dir,
    save_collectively,
    staged,
    write_json,
)
from .shards import (
    Entry,
    PortableCheckpoint,
    assemble_manifest,
    module_tensors,
    placement_of,
    rank_shards,
    sha256,
    tp_group_of,
    whole_copy,
    write_rank_file,
)
from .zero_access import write_param

MODEL_PREFIX = "model"
CONSOLIDATED_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# What a consolidated directory's config.json repeats from the manifest (with tokenizer, config, step).
RECORD_KEYS = ("model_class", "model_config", "feature_model_config", "feature_model_architecture")


def plain(value: Any) -> Any:
    """Dataclasses, tuples and dicts as JSON-ready dicts and lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def check_model_record(record: dict, model: nn.Module, where: Path | str) -> None:
    """One line naming what differs when ``record`` (a manifest, or a training checkpoint's state)
    was made for a model other than ``model``."""
    mismatch = getattr(model, "checkpoint_mismatch", None)
    problem = mismatch(record) if mismatch is not None else None
    if problem:
        raise CheckpointError(f"{where}: config mismatch: {problem}")


def write_portable(
    model: nn.Module, directory: Path, cfg=None, tokenizer_facts: dict | None = None, tp_group=None, *, step=None
) -> list[str]:
    """Write the portable weights of ``model`` into ``directory``. Collective: the ranks of DP rank 0
    write one file per TP rank, and all meet once, over the control group, to collect the shard
    records. Returns the reasons of failed writes instead of raising, so that every rank stays on
    the same path: every rank learns of a failed shard file, only its writer of a failed manifest."""
    tp_group = tp_group_of(model, tp_group)
    tp_size, tp_rank = group_size(tp_group), group_rank(tp_group)
    tensors, aliases = module_tensors(model)
    entries = [Entry(n, t.dtype, placement_of(t, tp_size, n), lambda t=t: whole_copy(t)) for n, t in tensors.items()]
    describe = getattr(model, "checkpoint_record", None)  # what the model says about itself, if anything
    fields = {
        "contents": "model",
        "step": step,
        **(plain(describe()) if describe is not None else {}),
        "tokenizer": plain(tokenizer_facts),
        "config": plain(cfg) if cfg is not None else None,
    }
    shards = rank_shards(entries, tp_rank)
    failures, parts = [], []
    if get_dp_rank() == 0:
        attempt(failures, lambda: parts.append(write_rank_file(directory, shards, MODEL_PREFIX, tp_rank, tp_size)))
    reports = all_gather_value((failures, parts))
    failures = [failure for reported, _ in reports for failure in reported]
    if not failures and get_dp_rank() == 0 and tp_rank == 0:
        manifest = assemble_manifest(
            entries, [part for _, written in reports for part in written], tp_size, fields, aliases
        )
        attempt(failures, lambda: write_json(directory / MANIFEST_NAME, manifest))
    return failures


def save_portable(
    model: nn.Module, directory: str | Path, cfg=None, tokenizer_facts: dict | None = None, tp_group=None, *, step=None
) -> Path:
    """Export ``model`` as a portable checkpoint in the new ``directory`` (collective: every rank
    calls it). A failed write raises :class:`CheckpointSaveError` on every rank, leaving nothing."""
    directory = Path(directory)
    if directory.exists():
        raise CheckpointError(f"{directory}: already exists; not overwriting a checkpoint")
    staging = partial(directory)

    def write(failures: list[str]) -> None:
        failures += write_portable(model, staging, cfg, tokenizer_facts, tp_group, step=step)

    failure = save_collectively(staging, write, lambda: publish(staging, directory))
    if failure is not None:
        raise CheckpointSaveError(f"{directory}: not written: {failure}")
    return directory


def load_portable(directory: str | Path, model: nn.Module, tp_group=None, *, verify_checksums: bool = True) -> dict:
    """Load a portable checkpoint saved at any TP degree into ``model`` at its own TP degree (no
    collective: each rank reads its own ranges; also without a process group). Every check fails
    with one :class:`CheckpointError` line: the files, the model's record, the tensor names and
    full shapes, every shard's checksum. Returns the manifest."""
    checkpoint = PortableCheckpoint(directory, verify_checksums)
    tp_group = tp_group_of(model, tp_group)
    tp_size, tp_rank = group_size(tp_group), group_rank(tp_group)
    check_model_record(checkpoint.manifest, model, checkpoint.directory)
    tensors, aliases = module_tensors(model)
    saved_names = set(checkpoint.tensors) | set(checkpoint.aliases)
    missing = [n for n in list(tensors) + list(aliases) if n not in saved_names]
    if missing:
        raise CheckpointError(
            f"{checkpoint.directory}: checkpoint lacks {len(missing)} tensor(s) of the model, "
            f"e.g. {missing[0]!r} (a different model?)"
        )
    unexpected = sorted(saved_names - set(tensors) - set(aliases))
    if unexpected:
        raise CheckpointError(
            f"{checkpoint.directory}: checkpoint has {len(unexpected)} tensor(s) the model "
            f"lacks, e.g. {unexpected[0]!r} (a different model?)"
        )
    placements = {name: placement_of(t, tp_size, name) for name, t in tensors.items()}
    for name, placement in placements.items():
        saved_shape = checkpoint.tensors[checkpoint.aliases.get(name, name)]["shape"]
        if list(placement.full_shape) != saved_shape:
            raise CheckpointError(
                f"{checkpoint.directory}: tensor {name!r} is {saved_shape} in the checkpoint but "
                f"{list(placement.full_shape)} in the model (a different model size?)"
            )

    def read(name: str) -> torch.Tensor:
        return checkpoint.read_block(checkpoint.aliases.get(name, name), placements[name], tp_rank, tensors[name].dtype)

    checkpoint.open_files()  # before the threads: each file opened once
    # Reading and checksumming release the GIL: a few threads overlap them (in order, as consumed).
    with torch.no_grad(), ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        for name, block in zip(tensors, pool.map(read, tensors), strict=True):
            write_param(tensors[name], block)
    return checkpoint.manifest


def consolidate(source: str | Path, output: str | Path, *, verify_checksums: bool = True) -> Path:
    """Gather a portable checkpoint (or a training checkpoint's ``model/``) into ``output``:
    ``model.safetensors`` (full, unpadded tensors), ``config.json`` (the model's record, tokenizer
    facts) and a TP=1 ``manifest.json``, so that it is itself a portable checkpoint."""
    checkpoint = PortableCheckpoint(resolve_portable_dir(source), verify_checksums)
    output = Path(output)
    require_empty_output(output)
    full = {name: checkpoint.read_full(name).contiguous() for name in checkpoint.tensors}
    tensors = {}
    for name, value in full.items():
        info = dict(checkpoint.tensors[name])
        shard = {"file": CONSOLIDATED_FILE, "sha256": sha256(value)}
        if info["partition_dim"] is not None:
            shard.update(offset=0, length=info["shape"][info["partition_dim"]])
        tensors[name] = {**info, "shards": [shard]}
    with staged(output) as staging:
        save_file(full, staging / CONSOLIDATED_FILE, {"format": "pt"})
        manifest = {k: v for k, v in checkpoint.manifest.items() if k not in ("files", "tensors", "aliases")}
        manifest.update(
            tp_size=1,
            files={CONSOLIDATED_FILE: {"bytes": (staging / CONSOLIDATED_FILE).stat().st_size, "tp_rank": 0}},
            tensors=tensors,
            aliases=checkpoint.aliases,
            consolidated_from=str(checkpoint.directory),
        )
        write_json(staging / CONFIG_FILE, {k: manifest.get(k) for k in (*RECORD_KEYS, "tokenizer", "config", "step")})
        write_json(staging / MANIFEST_NAME, manifest)
    return output
