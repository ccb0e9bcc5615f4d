"""The portable sharded checkpoint: one safetensors file per tensor-parallel rank plus manifest.json.

Layout of a portable directory::

    manifest.json                      # format, TP degree, configs, tokenizer facts, every tensor
    model-tp00-of-04.safetensors       # what TP rank 0 holds (padding stripped), replicated tensors
    model-tp01-of-04.safetensors       # ... TP rank 1's slices only
    ...

For every tensor the manifest records its *full* shape (the unpadded vocabulary for the head), its
dtype, its partition dim (null = replicated, stored once, in rank 0's file) and its shards: which
file, which range ``[offset, offset + length)`` of the partition dim, and the sha256 of the shard's
bytes. Loading at TP=m re-cuts those ranges for each new rank, so any TP degree can read any other;
nothing on this path unpickles anything.

The same machinery stores the universal optimizer state of :mod:`.reshard` (fp32 master weights and
Adam moments per parameter), which is why the writer takes abstract entries, not a module.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallel_latent.parallel.state import get_dp_rank
from parallel_latent.parallel.utils import group_rank, group_size

from .errors import CheckpointError
from .safetensors_io import SafetensorsFile, SafetensorsWriter, dtype_from_name, dtype_name
from .zero_access import gathered, local_shape, write_param

FORMAT = "parallel-latent-portable"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
MODEL_PREFIX = "model"
# Model config keys that do not change the weights: a checkpoint loads whatever they are set to.
RUNTIME_ONLY_MODEL_KEYS = frozenset({"dropout", "activation_checkpointing", "init_std"})
# Model config keys added after checkpoints were already written, with the value that the code
# behaved as before the key existed: such a checkpoint means that value, not today's default.
MODEL_KEYS_ADDED_LATER = {"head": "normal"}


def saved_model_config(manifest: dict) -> dict:
    """The manifest's model config, with the keys it predates filled in (see MODEL_KEYS_ADDED_LATER)."""
    saved = manifest.get("model_config") or {}
    return {**MODEL_KEYS_ADDED_LATER, **saved} if saved else saved


# --------------------------------------------------------------------------- #
# Where each rank's tensor sits in the full tensor.
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Placement:
    """This TP rank's tensor as a block of the full, unpadded tensor."""

    partition_dim: int | None  # None: replicated on every TP rank
    local_shape: tuple[int, ...]
    full_shape: tuple[int, ...]

    def rank_range(self, tp_rank: int) -> tuple[int, int]:
        """The slice ``[start, stop)`` of the partition dim that ``tp_rank`` holds real data for.

        Rows past the full size are padding (the vocabulary head): they are neither saved nor read.
        """
        dim = self.partition_dim
        per_rank = self.local_shape[dim]
        start = min(tp_rank * per_rank, self.full_shape[dim])
        return start, min(start + per_rank, self.full_shape[dim])


def placement_of(tensor: torch.Tensor, tp_size: int, name: str = "") -> Placement:
    """Read the tensor-parallel flags (``tensor_model_parallel``, ``partition_dim``,
    ``partition_stride``, ``partition_valid_size``) that the parallel layers set."""
    shape = local_shape(tensor)
    if not getattr(tensor, "tensor_model_parallel", False):
        return Placement(None, shape, shape)
    stride = getattr(tensor, "partition_stride", 1)
    if stride != 1:
        raise CheckpointError(f"{name}: partition_stride={stride} (interleaved shards) is not supported")
    dim = tensor.partition_dim % len(shape)
    full = list(shape)
    full[dim] = shape[dim] * tp_size
    valid = getattr(tensor, "partition_valid_size", None)
    if valid is not None:
        if valid > full[dim]:
            raise CheckpointError(f"{name}: partition_valid_size={valid} exceeds the padded size {full[dim]}")
        full[dim] = valid
    return Placement(dim, shape, tuple(full))


@dataclass
class Entry:
    """One tensor to store: its name, dtype, placement at this TP degree, and how to get this
    rank's whole tensor (called on every rank in the same order, so it may be collective)."""

    name: str
    dtype: torch.dtype
    placement: Placement
    value: Callable[[], torch.Tensor]


def module_tensors(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The module's state (parameters with their flags, persistent buffers) by name, and the names
    that alias another entry (tied weights are stored once)."""
    tensors, aliases, seen = {}, {}, {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if tensor is None:
            continue
        if id(tensor) in seen:
            aliases[name] = seen[id(tensor)]
            continue
        seen[id(tensor)] = name
        tensors[name] = tensor
    return tensors, aliases


def module_entries(module: nn.Module, tp_size: int) -> tuple[list[Entry], dict[str, str]]:
    tensors, aliases = module_tensors(module)
    entries = []
    for name, tensor in tensors.items():

        def value(tensor=tensor):
            if not hasattr(tensor, "ds_id"):
                return tensor.detach()  # written before anything can change it: no copy
            with gathered([tensor]):  # ZeRO-3: whole only inside the block, so copy it out
                return tensor.detach().to("cpu", copy=True)

        entries.append(Entry(name, tensor.dtype, placement_of(tensor, tp_size, name), value))
    return entries, aliases


# --------------------------------------------------------------------------- #
# Writing.
# --------------------------------------------------------------------------- #


def shard_file_name(prefix: str, tp_rank: int, tp_size: int) -> str:
    return f"{prefix}-tp{tp_rank:02d}-of-{tp_size:02d}.safetensors"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _is_global_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def fsync_directory(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (the data is already fsynced)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to a temporary file, fsync it, then os.replace: readers see the old or the new."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1, sort_keys=False)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    fsync_directory(path.parent)


def write_rank_file(
    directory: Path, entries: list[Entry], *, prefix: str, tp_rank: int, tp_size: int, is_writer: bool
) -> tuple[dict[str, dict], dict[str, dict]]:
    """Write what TP rank ``tp_rank`` stores of ``entries`` (its slices, padding stripped, and the
    replicated tensors on rank 0) into one safetensors file. Every entry's ``value`` is called, in
    order, also when ``is_writer`` is false (it may be a collective). Returns this rank's shard
    records by tensor name and its file's record."""
    file_name = shard_file_name(prefix, tp_rank, tp_size)
    stored: dict[str, tuple[int, int, tuple[int, ...]]] = {}  # name -> (start, stop, stored shape)
    for entry in entries:
        place = entry.placement
        if place.partition_dim is None:
            if tp_rank == 0:
                stored[entry.name] = (0, 0, place.local_shape)
            continue
        start, stop = place.rank_range(tp_rank)
        if stop > start:
            shape = list(place.local_shape)
            shape[place.partition_dim] = stop - start
            stored[entry.name] = (start, stop, tuple(shape))
    writer = None
    if is_writer:
        specs = [(e.name, e.dtype, stored[e.name][2]) for e in entries if e.name in stored]
        writer = SafetensorsWriter(
            directory / file_name, specs, {"format": FORMAT, "tp_rank": str(tp_rank), "tp_size": str(tp_size)}
        )
    records: dict[str, dict] = {}
    try:
        for entry in entries:
            value = entry.value()
            if writer is None or entry.name not in stored:
                continue
            if tuple(value.shape) != entry.placement.local_shape:
                raise CheckpointError(
                    f"{entry.name}: value of shape {list(value.shape)}, expected {list(entry.placement.local_shape)}"
                )
            start, stop, _ = stored[entry.name]
            dim = entry.placement.partition_dim
            shard = value if dim is None else value.narrow(dim, 0, stop - start)
            record = {"file": file_name, "sha256": writer.write(entry.name, shard.to(entry.dtype))}
            if dim is not None:
                record.update(offset=start, length=stop - start)
            records[entry.name] = record
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if writer is None:
        return records, {}
    writer.close()
    return records, {file_name: {"bytes": (directory / file_name).stat().st_size, "tp_rank": tp_rank}}


def assemble_manifest(
    entries: list[Entry],
    parts: list[tuple[dict, dict]],
    tp_size: int,
    manifest_fields: dict[str, Any],
    aliases: dict[str, str] | None = None,
) -> dict:
    """The manifest from every TP rank's (records, file record)."""
    all_files: dict[str, dict] = {}
    shards: dict[str, list[dict]] = {e.name: [] for e in entries}
    for part_records, part_files in parts:
        all_files.update(part_files)
        for name, record in part_records.items():
            shards[name].append(record)
    tensors = {}
    for entry in entries:
        tensors[entry.name] = {
            "shape": list(entry.placement.full_shape),
            "dtype": dtype_name(entry.dtype),
            "partition_dim": entry.placement.partition_dim,
            "shards": sorted(shards[entry.name], key=lambda r: r.get("offset", 0)),
        }
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tp_size": tp_size,
        **manifest_fields,
        "files": dict(sorted(all_files.items())),
        "tensors": tensors,
        "aliases": aliases or {},
    }


def write_sharded(
    directory: Path,
    entries: list[Entry],
    *,
    prefix: str,
    tp_group,
    is_writer: bool,
    manifest_fields: dict[str, Any],
    aliases: dict[str, str] | None = None,
) -> dict | None:
    """Write this rank's shard into the existing ``directory``, then (TP rank 0 of the writers) the
    manifest. Collective: every rank calls it with the same entries in the same order. Returns the
    manifest on the rank that wrote it."""
    tp_size, tp_rank = group_size(tp_group), group_rank(tp_group)
    part = write_rank_file(directory, entries, prefix=prefix, tp_rank=tp_rank, tp_size=tp_size, is_writer=is_writer)
    # Rank 0 of the TP group learns every rank's shard records (checksums) to write the manifest.
    parts = [part]
    if tp_size > 1:
        parts = [None] * tp_size
        dist.all_gather_object(parts, part, group=tp_group)
    if not (is_writer and tp_rank == 0):
        return None
    manifest = assemble_manifest(entries, parts, tp_size, manifest_fields, aliases)
    write_json_atomic(directory / MANIFEST_NAME, manifest)
    return manifest


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def model_manifest_fields(
    model: nn.Module, cfg=None, tokenizer_facts: dict | None = None, step: int | None = None, extra: dict | None = None
) -> dict[str, Any]:
    """What a manifest says about the model beyond its tensors (all optional, model-agnostic)."""
    model_cfg = getattr(cfg, "model", None) or getattr(model, "model_cfg", None)
    feature_cfg = getattr(cfg, "feature_model", None) or getattr(model, "feature_cfg", None)
    fields = {
        "contents": "model",
        "step": step,
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "model_config": _plain(model_cfg),
        "feature_model_config": _plain(feature_cfg),
        "feature_model_architecture": feature_architecture(model),
        "tokenizer": _plain(tokenizer_facts),
        "config": _plain(cfg) if cfg is not None else None,
    }
    if extra:
        fields["extra"] = _plain(extra)
    return fields


def feature_architecture(model: nn.Module) -> dict | None:
    """The GPT-2 shape actually held (also when it came from a hub name), so an inference load can
    rebuild it from its config and fill in the checkpoint's weights without the hub."""
    gpt2 = getattr(getattr(model, "feature_model", None), "gpt2", None)
    config = getattr(gpt2, "config", None)
    if config is None or not hasattr(gpt2, "h"):
        return None
    from parallel_latent.model.features import HIDDEN_STATE_INDEX

    # The held GPT-2 was cut to its first n_layer - 2 blocks; record the uncut depth it came from.
    return {
        "n_layer": len(gpt2.h) - 1 - HIDDEN_STATE_INDEX,
        "n_head": config.n_head,
        "n_embd": config.n_embd,
        "n_positions": config.n_positions,
    }


def _prepare_directory(directory: Path) -> Path:
    """Staging directory next to ``directory`` (rank 0 creates it, stale leftovers removed)."""
    staging = directory.with_name(f".{directory.name}.partial")
    if _is_global_rank0():
        if staging.exists():
            shutil.rmtree(staging)  # a save that died half-way; never a published checkpoint
        staging.mkdir(parents=True)
    _barrier()
    return staging


def save_portable(
    model: nn.Module,
    directory: str | Path,
    cfg=None,
    tokenizer_facts: dict | None = None,
    tp_group=None,
    *,
    step: int | None = None,
    extra: dict | None = None,
    is_writer: bool | None = None,
) -> Path:
    """Export ``model`` as a portable checkpoint in ``directory`` (which must not exist yet).

    Collective when a process group exists: every rank calls it. The ranks of data-parallel rank 0
    write (one file per TP rank); the others only take part in ZeRO-3 gathers. Written under a
    ``.<name>.partial`` staging name and renamed into place once complete.
    """
    directory = Path(directory)
    if tp_group is None:
        tp_group = getattr(model, "tp_group", None)
    if directory.exists():
        raise CheckpointError(f"{directory}: already exists; not overwriting a checkpoint")
    staging = _prepare_directory(directory)
    entries, aliases = module_entries(model, group_size(tp_group))
    writer = get_dp_rank() == 0 if is_writer is None else is_writer
    manifest = write_sharded(
        staging,
        entries,
        prefix=MODEL_PREFIX,
        tp_group=tp_group,
        is_writer=writer,
        manifest_fields=model_manifest_fields(model, cfg, tokenizer_facts, step, extra),
        aliases=aliases,
    )
    if manifest is not None:
        fsync_directory(staging)
        os.rename(staging, directory)
        fsync_directory(directory.parent)
    _barrier()
    return directory


# --------------------------------------------------------------------------- #
# Reading.
# --------------------------------------------------------------------------- #


class PortableCheckpoint:
    """A portable directory with its manifest checked against its files (existence, sizes, headers)."""

    def __init__(self, directory: str | Path, verify_checksums: bool = True):
        self.directory = Path(directory)
        self.verify_checksums = verify_checksums
        manifest_path = self.directory / MANIFEST_NAME
        try:
            self.manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise CheckpointError(f"{self.directory}: not a portable checkpoint ({MANIFEST_NAME} missing)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CheckpointError(f"{manifest_path}: unreadable manifest ({error})") from None
        if self.manifest.get("format") != FORMAT:
            raise CheckpointError(f"{manifest_path}: not a {FORMAT} manifest")
        if self.manifest.get("format_version", 0) > FORMAT_VERSION:
            raise CheckpointError(
                f"{manifest_path}: format version {self.manifest['format_version']} is newer "
                f"than this code reads ({FORMAT_VERSION})"
            )
        self.tensors: dict[str, dict] = self.manifest["tensors"]
        self.aliases: dict[str, str] = self.manifest.get("aliases", {})
        self._files: dict[str, SafetensorsFile] = {}
        for file_name, info in self.manifest["files"].items():
            path = self.directory / file_name
            if not path.is_file():
                raise CheckpointError(f"{path}: shard file missing")
            size = path.stat().st_size
            if size != info["bytes"]:
                raise CheckpointError(
                    f"{path}: {size} bytes, the manifest says {info['bytes']} (truncated or replaced file)"
                )

    def file(self, name: str) -> SafetensorsFile:
        if name not in self._files:
            self._files[name] = SafetensorsFile(self.directory / name)
        return self._files[name]

    def _read_shard(self, name: str, shard: dict) -> torch.Tensor:
        return self.file(shard["file"]).read(name, shard["sha256"] if self.verify_checksums else None)

    def read_full(self, name: str) -> torch.Tensor:
        """The whole (unpadded) tensor, assembled from its shards."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.directory}: no tensor {name!r}")
        dim = info["partition_dim"]
        if dim is None:
            return self._read_shard(name, info["shards"][0])
        parts = [self._read_shard(name, shard) for shard in info["shards"]]
        full = torch.cat(parts, dim=dim) if parts else torch.empty(0)
        if list(full.shape) != info["shape"]:
            raise CheckpointError(
                f"{self.directory}: shards of {name!r} cover {list(full.shape)}, not the full shape {info['shape']}"
            )
        return full

    def read_block(
        self,
        name: str,
        placement: Placement,
        tp_rank: int,
        dtype: torch.dtype | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This rank's tensor at a (possibly different) TP degree: its range of the partition dim cut
        from whichever shards overlap it, padding rows zero. Reads into ``out`` when given."""
        info = self.tensors[name]
        stored_dtype = dtype_from_name(info["dtype"])
        dim = placement.partition_dim
        if dim is None:
            shard = info["shards"][0]
            if out is not None and out.dtype == stored_dtype and out.is_contiguous() and out.device.type == "cpu":
                self.file(shard["file"]).read_into(name, out, shard["sha256"] if self.verify_checksums else None)
                return out
            value = self._read_shard(name, shard).to(dtype or stored_dtype)
            return value if out is None else out.copy_(value)
        start, stop = placement.rank_range(tp_rank)
        shards = info["shards"]
        # Same TP degree and no padding: the shard is exactly this rank's tensor; read it in place.
        exact = [s for s in shards if s["offset"] == start and s["length"] == stop - start]
        if (
            exact
            and out is not None
            and stop - start == placement.local_shape[dim]
            and out.dtype == stored_dtype
            and out.is_contiguous()
            and out.device.type == "cpu"
        ):
            self.file(exact[0]["file"]).read_into(name, out, exact[0]["sha256"] if self.verify_checksums else None)
            return out
        block = torch.zeros(placement.local_shape, dtype=dtype or stored_dtype)
        covered = 0
        for shard in shards:
            lo, hi = max(start, shard["offset"]), min(stop, shard["offset"] + shard["length"])
            if hi <= lo:
                continue
            data = self._read_shard(name, shard)
            block.narrow(dim, lo - start, hi - lo).copy_(data.narrow(dim, lo - shard["offset"], hi - lo))
            covered += hi - lo
        if covered != stop - start:
            raise CheckpointError(f"{self.directory}: shards of {name!r} do not cover rows [{start}, {stop})")
        if out is not None:
            out.copy_(block)
            return out
        return block


def check_model_config(checkpoint: PortableCheckpoint, model: nn.Module) -> None:
    """Fail with the first differing key when the checkpoint was made for another model config."""
    compare_model_configs(checkpoint.manifest, model, checkpoint.directory)


def compare_model_configs(record: dict, model: nn.Module, where: Path | str) -> None:
    """``record`` holds the model config a checkpoint was made for (a manifest, or a training
    checkpoint's state): one line naming the first key that differs from ``model``'s."""
    saved = saved_model_config(record)
    current = getattr(model, "model_cfg", None)
    if not saved or current is None:
        return
    current = _plain(current)
    for key in sorted(set(saved) | set(current)):
        if key in RUNTIME_ONLY_MODEL_KEYS:
            continue
        if saved.get(key) != current.get(key):
            raise CheckpointError(
                f"{where}: config mismatch: model.{key} is {saved.get(key)!r} in "
                f"the checkpoint but {current.get(key)!r} in the model"
            )


def load_portable(
    directory: str | Path, model: nn.Module, tp_group=None, *, strict: bool = True, verify_checksums: bool = True
) -> dict:
    """Load a portable checkpoint saved at any TP degree into ``model`` at its own TP degree.

    Needs no collective (each rank reads its own ranges), so it also runs in a single process
    without a process group. Checks, each failing with one :class:`CheckpointError` line: manifest
    present and readable, every shard file present with the recorded size, the model config, the
    set of tensor names (``strict``), every full shape, every shard checksum. Returns the manifest.
    """
    checkpoint = PortableCheckpoint(directory, verify_checksums)
    if tp_group is None:
        tp_group = getattr(model, "tp_group", None)
    tp_size, tp_rank = group_size(tp_group), group_rank(tp_group)
    check_model_config(checkpoint, model)
    tensors, aliases = module_tensors(model)
    saved_names = set(checkpoint.tensors) | set(checkpoint.aliases)
    missing = [n for n in list(tensors) + list(aliases) if n not in saved_names]
    if missing:
        raise CheckpointError(
            f"{checkpoint.directory}: checkpoint lacks {len(missing)} tensor(s) of the model, "
            f"e.g. {missing[0]!r} (a different model?)"
        )
    if strict:
        unexpected = sorted(saved_names - set(tensors) - set(aliases))
        if unexpected:
            raise CheckpointError(
                f"{checkpoint.directory}: checkpoint has {len(unexpected)} tensor(s) the model "
                f"lacks, e.g. {unexpected[0]!r} (a different model?)"
            )
    placements = {name: placement_of(t, tp_size, name) for name, t in tensors.items()}
    for name, placement in placements.items():
        saved_name = checkpoint.aliases.get(name, name)
        saved_shape = checkpoint.tensors[saved_name]["shape"]
        if list(placement.full_shape) != saved_shape:
            raise CheckpointError(
                f"{checkpoint.directory}: tensor {name!r} is {saved_shape} in the checkpoint but "
                f"{list(placement.full_shape)} in the model (a different model size?)"
            )
    with torch.no_grad():
        for name, tensor in tensors.items():
            saved_name = checkpoint.aliases.get(name, name)
            placement = placements[name]
            if hasattr(tensor, "ds_id"):  # ZeRO-3: assemble the whole tensor, keep this rank's partition
                write_param(tensor, checkpoint.read_block(saved_name, placement, tp_rank, tensor.dtype))
            elif tensor.device.type == "cpu" and tensor.is_contiguous():
                checkpoint.read_block(saved_name, placement, tp_rank, tensor.dtype, out=tensor.data)
            else:
                tensor.data.copy_(checkpoint.read_block(saved_name, placement, tp_rank, tensor.dtype))
    return checkpoint.manifest


# --------------------------------------------------------------------------- #
# Consolidation and inference loading.
# --------------------------------------------------------------------------- #


CONSOLIDATED_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def consolidate(source: str | Path, output: str | Path, *, verify_checksums: bool = True) -> Path:
    """Gather a portable checkpoint (or a training checkpoint's ``model/``) into one safetensors file.

    ``output`` gets ``model.safetensors`` (full, unpadded tensors; loads with
    ``safetensors.torch.load_file``), ``config.json`` (configs and tokenizer facts) and a TP=1
    ``manifest.json``, so it is itself a portable checkpoint that loads at any TP degree.
    """
    from .describe import resolve_portable_dir

    checkpoint = PortableCheckpoint(resolve_portable_dir(source), verify_checksums)
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise CheckpointError(f"{output}: exists and is a file; give a new or empty directory")
    if output.exists() and any(output.iterdir()):
        raise CheckpointError(f"{output}: exists and is not empty; not overwriting")
    staging = output.with_name(f".{output.name}.partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    names = list(checkpoint.tensors)
    specs = [(n, dtype_from_name(checkpoint.tensors[n]["dtype"]), tuple(checkpoint.tensors[n]["shape"])) for n in names]
    writer = SafetensorsWriter(staging / CONSOLIDATED_FILE, specs, {"format": "pt"})
    tensors = {}
    try:
        for name in names:
            digest = writer.write(name, checkpoint.read_full(name))
            info = dict(checkpoint.tensors[name])
            shard = {"file": CONSOLIDATED_FILE, "sha256": digest}
            if info["partition_dim"] is not None:
                shard.update(offset=0, length=info["shape"][info["partition_dim"]])
            info["shards"] = [shard]
            tensors[name] = info
    except BaseException:
        writer.abort()
        raise
    writer.close()
    manifest = {k: v for k, v in checkpoint.manifest.items() if k not in ("files", "tensors", "aliases")}
    manifest.update(
        tp_size=1,
        files={CONSOLIDATED_FILE: {"bytes": (staging / CONSOLIDATED_FILE).stat().st_size, "tp_rank": 0}},
        tensors=tensors,
        aliases=checkpoint.aliases,
        consolidated_from=str(checkpoint.directory),
    )
    config = {
        k: manifest.get(k)
        for k in (
            "model_class",
            "model_config",
            "feature_model_config",
            "feature_model_architecture",
            "tokenizer",
            "config",
            "step",
        )
    }
    write_json_atomic(staging / CONFIG_FILE, config)
    write_json_atomic(staging / MANIFEST_NAME, manifest)
    if output.exists():
        output.rmdir()  # empty, checked above
    os.rename(staging, output)
    fsync_directory(output.parent)
    return output


def load_autoencoder(path: str | Path, tp_group=None, *, verify_checksums: bool = True):
    """Build a ``LatentAutoencoder`` from a checkpoint's manifest and load its weights.

    ``path``: a portable directory, a consolidated directory or a training checkpoint (its
    ``model/``). With ``tp_group=None`` it runs in a single process without any process group. The
    GPT-2 is rebuilt from the recorded architecture (no hub access) and filled from the checkpoint.
    """
    import logging

    from parallel_latent.config import FeatureModelConfig, ModelConfig, build_dataclass
    from parallel_latent.model import LatentAutoencoder

    from .describe import resolve_portable_dir

    directory = resolve_portable_dir(path)
    manifest = PortableCheckpoint(directory, verify_checksums=False).manifest
    if not manifest.get("model_config") or not manifest.get("feature_model_config"):
        raise CheckpointError(f"{directory}: the manifest has no model config; not a LatentAutoencoder checkpoint")
    source = f"{directory / MANIFEST_NAME}"
    model_cfg = build_dataclass(ModelConfig, saved_model_config(manifest), source, "model_config")
    feature_cfg = build_dataclass(FeatureModelConfig, manifest["feature_model_config"], source, "feature_model_config")
    architecture = manifest.get("feature_model_architecture")
    if architecture:
        # Random GPT-2 of the recorded shape: every weight is overwritten by the checkpoint's.
        feature_cfg = dataclasses.replace(feature_cfg, pretrained=False, **architecture)
    seed = ((manifest.get("config") or {}).get("training") or {}).get("seed", 1234)
    features_logger = logging.getLogger("parallel_latent.model.features")
    previous_level = features_logger.level
    features_logger.setLevel(logging.ERROR)  # its "RANDOM features" warning does not apply here
    try:
        model = LatentAutoencoder(model_cfg, feature_cfg, tp_group=tp_group, seed=seed)
    finally:
        features_logger.setLevel(previous_level)
    load_portable(directory, model, tp_group, verify_checksums=verify_checksums)
    model.eval()
    return model
