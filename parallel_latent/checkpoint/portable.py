"""The portable checkpoint: a model's weights as shards (:mod:`.shards`) that load at any TP degree.

Layout of a portable directory::

    manifest.json                      # format, TP degree, the model's record, tokenizer facts, every tensor
    model-tp00-of-04.safetensors       # what TP rank 0 holds (padding stripped), replicated tensors
    model-tp01-of-04.safetensors       # ... TP rank 1's slices only

What the manifest says about the architecture is the model's own account of itself
(``model.checkpoint_record(**record_keywords)``, the keywords being what its saver measured of it);
on loading, the model says whether a record fits it
(``model.checkpoint_mismatch(record)``). This package knows no particular model.
"""

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallel_latent.coordination import all_gather_value
from parallel_latent.parallel.state import get_dp_rank
from parallel_latent.zero.params import write_param

from . import layout, shards
from .background import HostCopies
from .layout import CheckpointError, CheckpointSaveError

MODEL_PREFIX = "model"
PART_PREFIX = ".part-tp"  # a rank's shard records, until the manifest that gathers them is written
CONSOLIDATED_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# What a consolidated directory's config.json repeats from the manifest.
CONFIG_KEYS = ("model_class", "model_config", "feature_model_config", "feature_model_architecture")
CONFIG_KEYS += ("tokenizer", "config", "step", "latent_stats")


def plain(value: Any) -> Any:
    """Dataclasses, tuples and dicts as JSON-ready dicts and lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def model_record(model: nn.Module, record_keywords: dict | None = None) -> dict:
    """What ``model`` says about itself (``checkpoint_record``, given ``record_keywords``: what its
    saver measured of it, e.g. the trainer's latent statistics), if anything."""
    describe = getattr(model, "checkpoint_record", None)
    return plain(describe(**(record_keywords or {}))) if describe is not None else {}


def check_model_record(record: dict, model: nn.Module, where: Path | str) -> None:
    """One line naming what differs when ``record`` (a manifest, or a training checkpoint's state)
    was made for a model other than ``model``."""
    if problem := getattr(model, "checkpoint_mismatch", lambda record: None)(record):
        raise CheckpointError(f"{where}: config mismatch: {problem}")


@dataclass
class PortableCapture:
    """This rank's share of a model's portable weights, taken off the model now: its TP shards (its
    own copies with ``copy``, so training may go on), and what the manifest says beside them."""

    directory: Path
    entries: list[shards.Entry]
    own: shards.Shards
    file_name: str
    tp_rank: int
    tp_size: int
    fields: dict
    aliases: dict[str, str]

    @property
    def writes(self) -> bool:
        """The ranks of DP rank 0 write, one file per TP rank."""
        return get_dp_rank() == 0

    def write_file(self) -> tuple[dict, dict]:
        """This rank's shard file; its (shard records, file record)."""
        return shards.write_rank_file(self.directory, self.own, self.file_name, self.tp_rank, self.tp_size)

    def manifest(self, parts: list[tuple[dict, dict]]) -> dict:
        return shards.assemble_manifest(self.entries, parts, self.tp_size, self.fields, self.aliases)

    def part_record_path(self, tp_rank: int) -> Path:
        return self.directory / f"{PART_PREFIX}{tp_rank:02d}.json"

    def write_file_and_record(self) -> None:
        """This rank's file, and its records beside it for :meth:`write_manifest_from_records`."""
        records, file_record = self.write_file()
        layout.write_json(self.part_record_path(self.tp_rank), [records, file_record], indent=None)

    def write_manifest_from_records(self) -> None:
        """The manifest from every TP rank's records (one process, once they are all written)."""
        paths = [self.part_record_path(r) for r in range(self.tp_size)]
        parts = [tuple(layout.read_json(path, "shard records")) for path in paths]
        layout.write_json(self.directory / layout.MANIFEST_NAME, self.manifest(parts))
        for path in paths:
            path.unlink()


def capture_portable(
    model: nn.Module, directory: Path, cfg=None, tokenizer_facts: dict | None = None, tp_group=None, *, step=None,
    copies: HostCopies | None = None, record_keywords: dict | None = None,
) -> PortableCapture:  # fmt: skip
    """The portable weights of ``model`` for ``directory``, taken now (collective under ZeRO-3:
    every rank calls it, and whole tensors are gathered over DP); with ``copies``, into host memory
    training does not change; ``record_keywords``: see :func:`model_record`."""
    tp_size, tp_rank = shards.tp_size_and_rank(model, tp_group)
    tensors, aliases = shards.module_tensors(model)
    entries = [
        shards.Entry(n, t.dtype, shards.placement_of(t, tp_size, n), lambda t=t: shards.whole_copy(t))
        for n, t in tensors.items()
    ]
    fields = {
        "contents": "model",
        "step": step,
        **model_record(model, record_keywords),
        "tokenizer": plain(tokenizer_facts),
        "config": plain(cfg) if cfg is not None else None,
    }
    own = shards.rank_shards(entries, tp_rank)
    if copies is not None:
        own = {
            name: [(copies.copy(tensor, ("portable", cut.get("key", name))), cut) for tensor, cut in pieces]
            for name, pieces in own.items()
        }
    file_name = shards.rank_file_name(MODEL_PREFIX, tp_rank, tp_size)
    return PortableCapture(directory, entries, own, file_name, tp_rank, tp_size, fields, aliases)


def write_portable(
    model: nn.Module, directory: Path, cfg=None, tokenizer_facts: dict | None = None, tp_group=None, *, step=None,
    record_keywords: dict | None = None,
) -> list[str]:  # fmt: skip
    """Write the portable weights of ``model`` into ``directory``. Collective: the ranks of DP rank 0
    write one file per TP rank, and all meet once, over the control group, to collect the shard
    records. Returns the reasons of failed writes instead of raising, so that every rank stays on
    the same path: every rank learns of a failed shard file, only its writer of a failed manifest."""
    capture = capture_portable(
        model, directory, cfg, tokenizer_facts, tp_group, step=step, record_keywords=record_keywords
    )
    failures, parts = [], []
    if capture.writes:
        layout.attempt(failures, lambda: parts.append(capture.write_file()))
    reports = all_gather_value((failures, parts))
    failures = [failure for reported, _ in reports for failure in reported]
    if not failures and capture.writes and capture.tp_rank == 0:
        manifest = capture.manifest([part for _, rank_parts in reports for part in rank_parts])
        layout.attempt(failures, lambda: layout.write_json(directory / layout.MANIFEST_NAME, manifest))
    return failures


def save_portable(
    model: nn.Module, directory: str | Path, cfg=None, tokenizer_facts: dict | None = None, tp_group=None, *, step=None,
    record_keywords: dict | None = None,
) -> Path:  # fmt: skip
    """Export ``model`` as a portable checkpoint in the new ``directory`` (collective: every rank
    calls it; ``record_keywords``: see :func:`model_record`). A failed write raises
    :class:`CheckpointSaveError` on every rank, leaving nothing."""
    directory = Path(directory)
    if directory.exists():
        raise CheckpointError(f"{directory}: already exists; not overwriting a checkpoint")
    staging = layout.partial(directory)

    def write(failures: list[str]) -> None:
        failures += write_portable(
            model, staging, cfg, tokenizer_facts, tp_group, step=step, record_keywords=record_keywords
        )

    failure = layout.save_collectively(staging, write, lambda: layout.publish(staging, directory))
    if failure is not None:
        raise CheckpointSaveError(f"{directory}: not written: {failure}")
    return directory


def load_portable(directory: str | Path, model: nn.Module, tp_group=None, *, verify_checksums: bool = True) -> dict:
    """Load a portable checkpoint saved at any TP degree into ``model`` at its own TP degree (no
    collective: each rank reads its own ranges; also without a process group). Every check fails
    with one :class:`CheckpointError` line: the files, the model's record, the tensor names and
    full shapes, every shard's checksum. Returns the manifest."""
    checkpoint = shards.PortableCheckpoint(directory, verify_checksums)
    tp_size, tp_rank = shards.tp_size_and_rank(model, tp_group)
    check_model_record(checkpoint.manifest, model, checkpoint.directory)
    tensors, aliases = shards.module_tensors(model)
    names, saved = [*tensors, *aliases], set(checkpoint.tensors) | set(checkpoint.aliases)
    if missing := [n for n in names if n not in saved]:
        raise CheckpointError(
            f"{checkpoint.directory}: checkpoint lacks {len(missing)} tensor(s) of the model, e.g. {missing[0]!r}"
        )
    if extra := sorted(saved - set(names)):
        raise CheckpointError(
            f"{checkpoint.directory}: checkpoint has {len(extra)} tensor(s) the model lacks, e.g. {extra[0]!r}"
        )
    placements = {name: shards.placement_of(t, tp_size, name) for name, t in tensors.items()}
    for name, placement in placements.items():
        checkpoint.check_shape(checkpoint.aliases.get(name, name), placement)

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
    checkpoint = shards.PortableCheckpoint(layout.resolve_portable_dir(source), verify_checksums)
    output = Path(output)
    layout.require_empty_output(output)
    entries = [
        shards.Entry(
            n, shards.dtype_from_name(i["dtype"]), shards.Placement.whole(i), lambda n=n: checkpoint.read_full(n)
        )
        for n, i in checkpoint.tensors.items()
    ]
    fields = {k: v for k, v in checkpoint.manifest.items() if k not in shards.WRITER_KEYS}
    fields["consolidated_from"] = str(checkpoint.directory)
    with layout.staged(output) as staging:
        part = shards.write_rank_file(staging, shards.rank_shards(entries, 0), CONSOLIDATED_FILE, 0, 1)
        manifest = shards.assemble_manifest(entries, [part], 1, fields, checkpoint.aliases)
        layout.write_json(staging / CONFIG_FILE, {k: manifest.get(k) for k in CONFIG_KEYS})
        layout.write_json(staging / layout.MANIFEST_NAME, manifest)
    return output
