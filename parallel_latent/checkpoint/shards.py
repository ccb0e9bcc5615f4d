"""Tensors stored as shards of their full, unpadded selves: one safetensors file per TP rank plus
a manifest, readable at any TP degree.

For every tensor the manifest records its *full* shape (the unpadded vocabulary for the head), its
dtype, its partition dim (null = replicated, stored once, in rank 0's file) and its shards: which
file, which range ``[offset, offset + length)`` of the full tensor's partition dim, the key it has
in that file (``key``; absent: the tensor's name), and the XXH3-128 checksum of the shard's bytes.
A rank holds one range of a tensor, or, split with a partition stride s (GPT-2's q, k and v side by
side), s ranges, stored as s shards under keys of their own. Reading at TP=m re-cuts those ranges
for each new rank, in whichever layout it holds the tensor; nothing here unpickles anything.
Versions 1 (SHA-256 checksums: a tenth of the speed) and 2 (no ``key``: one range per rank) are
read too.
The writer takes abstract entries, not a module: the model weights (:mod:`.portable`) and the
universal optimizer state (:mod:`.universal`) are both stored this way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from parallel_latent.files import inside, link_problem
from parallel_latent.parallel.utils import group_rank, group_size, partition_ranges
from parallel_latent.zero.params import gathered, is_zero3, local_shape

from .layout import MANIFEST_NAME, CheckpointError, read_json, write_json

FORMAT = "parallel-latent-portable"
# The newest version this code reads and writes. 3: a shard's ``key`` (a v2 reader would look a strided
# shard up by the tensor's name); a manifest without one says 2, so older readers still take it.
FORMAT_VERSION = 3
# A shard's checksum, by the key its record names it with: XXH3-128 detects damage as well as a
# cryptographic hash at tens of GB/s (nothing here needs to resist a forger); version 1 used SHA-256.
CHECKSUM_KEY = "xxh3_128"
# What the writer fills in; the rest of a manifest are the caller's fields.
WRITER_KEYS = ("format", "format_version", "tp_size", "files", "tensors", "aliases")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint manifest")
    return dtype


def tp_size_and_rank(model: nn.Module, tp_group=None) -> tuple[int, int]:
    """In the tensor-parallel group given, else in the model's own, else alone."""
    group = tp_group if tp_group is not None else getattr(model, "tp_group", None)
    return group_size(group), group_rank(group)


@dataclass(frozen=True)
class Placement:
    """This TP rank's tensor as a block of the full, unpadded tensor."""

    partition_dim: int | None  # None: replicated on every TP rank
    local_shape: tuple[int, ...]
    full_shape: tuple[int, ...]
    partition_stride: int = 1

    @classmethod
    def from_spec(cls, spec: dict) -> Placement:
        # Tables written before strides were stored have none: every split was contiguous.
        stride = spec.get("partition_stride", 1)
        return cls(spec["partition_dim"], tuple(spec["local_shape"]), tuple(spec["full_shape"]), stride)

    @classmethod
    def whole(cls, info: dict) -> Placement:
        """A tensor of a manifest (``info``) held whole, as at TP=1."""
        return cls(info["partition_dim"], tuple(info["shape"]), tuple(info["shape"]))

    def spec(self) -> dict:
        return {
            "partition_dim": self.partition_dim,
            "local_shape": self.local_shape,
            "full_shape": self.full_shape,
            "partition_stride": self.partition_stride,
        }

    def rank_ranges(self, tp_rank: int) -> list[tuple[int, int, int]]:
        """The ranges ``[start, stop)`` of the full partition dim that ``tp_rank`` holds real data
        for, each with where it starts in the rank's tensor: one, or one per part of a strided
        split. Rows past the full size are padding (the vocabulary head), neither saved nor read."""
        dim = self.partition_dim
        return partition_ranges(self.full_shape[dim], self.local_shape[dim], tp_rank, self.partition_stride)


def placement_of(tensor: torch.Tensor, tp_size: int, name: str = "") -> Placement:
    """From the tensor-parallel flags that the parallel layers set on ``tensor``."""
    shape = local_shape(tensor)
    if not getattr(tensor, "tensor_model_parallel", False):
        return Placement(None, shape, shape)
    dim = tensor.partition_dim % len(shape)
    padded = shape[dim] * tp_size
    valid = getattr(tensor, "partition_valid_size", None) or padded  # the vocabulary head: its unpadded rows
    if valid > padded:
        raise CheckpointError(f"{name}: partition_valid_size={valid} exceeds the padded size {padded}")
    stride = getattr(tensor, "partition_stride", 1)
    if stride != 1 and valid != padded:
        raise CheckpointError(f"{name}: partition_stride={stride} with a padded partition dim is not supported")
    if shape[dim] % stride:
        raise CheckpointError(f"{name}: partition_stride={stride} does not divide its {shape[dim]} local rows")
    return Placement(dim, shape, (*shape[:dim], valid, *shape[dim + 1 :]), stride)


def module_tensors(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The module's state (parameters with their flags, persistent buffers) by name, and the names
    that alias another entry (tied weights are stored once)."""
    tensors, aliases, seen = {}, {}, {}
    for name, tensor in module.state_dict(keep_vars=True).items():  # never None: state_dict skips those
        if id(tensor) in seen:
            aliases[name] = seen[id(tensor)]
        else:
            seen[id(tensor)] = name
            tensors[name] = tensor
    return tensors, aliases


def whole_copy(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's whole tensor: itself (read before anything changes it), or under ZeRO-3 a copy
    gathered over DP (collective)."""
    if not is_zero3(tensor):
        return tensor.detach()
    with gathered([tensor]):
        return tensor.detach().to("cpu", copy=True)


@dataclass
class Entry:
    """One tensor to store: its name, dtype, placement at this TP degree, and how to get this
    rank's whole tensor (called on every rank in the same order, so it may be collective)."""

    name: str
    dtype: torch.dtype
    placement: Placement
    value: Callable[[], torch.Tensor]


def checksum(tensor: torch.Tensor, kind: str = CHECKSUM_KEY) -> str:
    """The hex digest of a tensor's bytes: ``xxh3_128``, or ``sha256`` (format version 1)."""
    data = memoryview(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
    if kind == "sha256":
        return hashlib.sha256(data).hexdigest()
    return xxhash.xxh3_128_hexdigest(data)


Shards = dict[str, list[tuple[torch.Tensor, dict]]]  # by tensor name: its pieces in a rank file, with their records


def rank_shards(entries: list[Entry], tp_rank: int) -> Shards:
    """What TP rank ``tp_rank`` stores of ``entries`` (its ranges, padding cut; on rank 0 the
    replicated tensors), each piece with its shard record: a strided tensor's ranges under keys of
    their own, as one file holds them all. Calls every ``value``, in order."""
    shards = {}
    for entry in entries:
        value, place = entry.value(), entry.placement
        if tuple(value.shape) != place.local_shape:
            raise CheckpointError(
                f"{entry.name}: value of shape {list(value.shape)}, expected {list(place.local_shape)}"
            )
        if place.partition_dim is None:
            if tp_rank == 0:
                shards[entry.name] = [(value.to(entry.dtype), {})]
            continue
        pieces = []
        for start, stop, local in place.rank_ranges(tp_rank):
            if stop > start:
                piece = value.narrow(place.partition_dim, local, stop - start).to(entry.dtype).contiguous()
                cut = {"offset": start, "length": stop - start}
                if place.partition_stride != 1:
                    cut["key"] = f"{entry.name}[{start}:{stop}]"
                pieces.append((piece, cut))
        if pieces:
            shards[entry.name] = pieces
    return shards


def rank_file_name(prefix: str, tp_rank: int, tp_size: int) -> str:
    return f"{prefix}-tp{tp_rank:02d}-of-{tp_size:02d}.safetensors"


def write_rank_file(directory: Path, shards: Shards, file_name: str, tp_rank: int, tp_size: int):
    """Write one rank's shards into one safetensors file. Returns (the shard records of each tensor
    by its name, the file's record by file name)."""
    directory.mkdir(exist_ok=True)
    tensors = {cut.get("key", name): tensor for name, pieces in shards.items() for tensor, cut in pieces}
    # "format" is the framework in safetensors' convention (transformers checks it); ours is "writer".
    metadata = {"format": "pt", "writer": FORMAT, "tp_rank": str(tp_rank), "tp_size": str(tp_size)}
    save_file(tensors, directory / file_name, metadata)
    records = {
        name: [{"file": file_name, CHECKSUM_KEY: checksum(tensor), **cut} for tensor, cut in pieces]
        for name, pieces in shards.items()
    }
    return records, {file_name: {"bytes": (directory / file_name).stat().st_size, "tp_rank": tp_rank}}


def assemble_manifest(entries: list[Entry], parts: list[tuple[dict, dict]], tp_size: int, fields: dict, aliases: dict):
    """The manifest from every TP rank's (shard records, file record)."""
    tensors = {}
    for e in entries:
        records = sorted((r for rank, _ in parts for r in rank.get(e.name, [])), key=lambda r: r.get("offset", 0))
        shape, dim = list(e.placement.full_shape), e.placement.partition_dim
        tensors[e.name] = {"shape": shape, "dtype": dtype_name(e.dtype), "partition_dim": dim, "shards": records}
    files = dict(sorted(item for _, file_records in parts for item in file_records.items()))
    keyed = any("key" in record for info in tensors.values() for record in info["shards"])
    head = {"format": FORMAT, "format_version": FORMAT_VERSION if keyed else 2, "tp_size": tp_size}
    return {**head, **fields, "files": files, "tensors": tensors, "aliases": aliases}


def write_all_ranks(directory: Path, entries_by_rank: list[list[Entry]], prefix: str, fields: dict, aliases: dict):
    """One process writing the files of every TP rank and the manifest (offline conversions)."""
    tp_size = len(entries_by_rank)
    parts = [
        write_rank_file(directory, rank_shards(entries, r), rank_file_name(prefix, r, tp_size), r, tp_size)
        for r, entries in enumerate(entries_by_rank)
    ]
    write_json(directory / MANIFEST_NAME, assemble_manifest(entries_by_rank[0], parts, tp_size, fields, aliases))


def _count(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _tensor_problem(info: Any, files: dict) -> str | None:
    """What is wrong with one tensor's record in a manifest (the keys its readers use), or None."""
    if not isinstance(info, dict):
        return "not an object"
    shape, dim, shards = info.get("shape"), info.get("partition_dim"), info.get("shards")
    if not (isinstance(shape, list) and all(_count(n) for n in shape)):
        return "'shape' must be a list of sizes"
    if not (isinstance(info.get("dtype"), str) and isinstance(getattr(torch, info["dtype"], None), torch.dtype)):
        return f"'dtype' {info.get('dtype')!r} is not a torch dtype"
    if not (dim is None or (_count(dim) and dim < len(shape))):
        return f"'partition_dim' {dim!r} is not a dimension of its shape {shape}"
    if not (isinstance(shards, list) and shards and all(isinstance(shard, dict) for shard in shards)):
        return "'shards' must be a list of objects"
    for shard in shards:
        if not isinstance(shard.get("file"), str) or shard["file"] not in files:
            return f"a shard's 'file' {shard.get('file')!r} is not one of the manifest's files"
        if not any(isinstance(shard.get(kind), str) for kind in (CHECKSUM_KEY, "sha256")):
            return "a shard has no checksum"
        if "key" in shard and not isinstance(shard["key"], str):
            return "a shard's 'key' must be a string"
        offset, length = shard.get("offset"), shard.get("length")
        if dim is not None and not (_count(offset) and _count(length) and offset + length <= shape[dim]):
            return f"a shard's rows ({shard.get('offset')!r} + {shard.get('length')!r}) are not inside {shape[dim]}"
    return None


def manifest_problem(manifest: Any) -> str | None:
    """What is wrong with the structure of a manifest (the keys and types every reader here uses),
    naming the key, or None: a damaged or hand-edited manifest is refused in one line, not met by a
    KeyError halfway through a load."""
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, not an object"
    files, tensors, aliases = manifest.get("files"), manifest.get("tensors"), manifest.get("aliases", {})
    if not (isinstance(files, dict) and all(isinstance(v, dict) and _count(v.get("bytes")) for v in files.values())):
        return "'files' must map each file name to an object with its 'bytes'"
    if not _count(manifest.get("tp_size"), 1):
        return f"'tp_size' {manifest.get('tp_size')!r} is not a TP degree"
    if not isinstance(tensors, dict):
        return "'tensors' must be an object"
    for name, info in tensors.items():
        if (problem := _tensor_problem(info, files)) is not None:
            return f"tensor {name!r}: {problem}"
    if not (isinstance(aliases, dict) and all(isinstance(v, str) and v in tensors for v in aliases.values())):
        return "'aliases' must map names to tensors of the manifest"
    return None


class PortableCheckpoint:
    """A directory of shards with its manifest checked against its files (existence, sizes,
    headers); tensors are checked against their checksums as they are read."""

    def __init__(self, directory: str | Path, verify_checksums: bool = True):
        self.directory = Path(directory)
        self.verify_checksums = verify_checksums
        manifest_path = self.directory / MANIFEST_NAME
        if not manifest_path.is_file():
            raise CheckpointError(f"{self.directory}: not a portable checkpoint ({MANIFEST_NAME} missing)")
        self.manifest = read_json(manifest_path, "manifest")
        if not isinstance(self.manifest, dict) or self.manifest.get("format") != FORMAT:
            raise CheckpointError(f"{manifest_path}: not a {FORMAT} manifest")
        if not _count(version := self.manifest.get("format_version", 0)):
            raise CheckpointError(f"{manifest_path}: 'format_version' {version!r} is not a version number; not read")
        if version > FORMAT_VERSION:
            raise CheckpointError(
                f"{manifest_path}: format v{version} is newer than this code reads (v{FORMAT_VERSION})"
            )
        if (problem := manifest_problem(self.manifest)) is not None:
            raise CheckpointError(f"{manifest_path}: {problem}; not read")
        self.tensors: dict[str, dict] = self.manifest["tensors"]
        self.aliases: dict[str, str] = self.manifest.get("aliases", {})
        self._files: dict[str, tuple[Any, set[str]]] = {}  # open file, its tensor names
        shard_files = {shard["file"] for info in self.tensors.values() for shard in info.get("shards", [])}
        for name in sorted(set(self.manifest["files"]) | shard_files):
            try:
                inside(self.directory, name, MANIFEST_NAME)
            except ValueError as error:
                raise CheckpointError(str(error)) from None
        if (link := link_problem(self.directory, "the checkpoint's directory")) is not None:
            raise CheckpointError(f"{link}; not read")
        for name, info in self.manifest["files"].items():
            if not (path := self.directory / name).is_file():
                raise CheckpointError(f"{path}: shard file missing")
            if (size := path.stat().st_size) != info["bytes"]:
                raise CheckpointError(f"{path}: {size} bytes, the manifest says {info['bytes']} (a truncated file?)")

    def open_files(self) -> None:
        """Open every shard file now (reads may then come from several threads)."""
        for file_name in self.manifest["files"]:
            self._file(file_name)

    def _file(self, name: str):
        if name not in self._files:
            try:
                handle = safe_open(str(self.directory / name), framework="pt")
            except SafetensorError as error:
                raise CheckpointError(f"{self.directory / name}: truncated or damaged file ({error})") from None
            self._files[name] = handle, set(handle.keys())
        return self._files[name]

    def _read_shard(self, name: str, shard: dict) -> torch.Tensor:
        return self._read_parts(name, shard)[0]

    def _read_parts(
        self, name: str, shard: dict, dim: int = 0, spans: list[tuple[int, int]] | None = None
    ) -> list[torch.Tensor]:
        """The parts ``[lo, hi)`` along ``dim`` of a shard (``spans``; None: the whole shard). With
        checksums on, the whole shard is read and checked once (a checksum covers the whole shard);
        otherwise only the parts are read."""
        key = shard.get("key", name)
        (handle, names), where = self._file(shard["file"]), self.directory / shard["file"]
        if key not in names:
            raise CheckpointError(f"{where}: tensor {key!r} missing from shard")
        info = self.tensors[name]
        want = list(info["shape"])
        if info["partition_dim"] is not None and "length" in shard:
            want[info["partition_dim"]] = shard["length"]
        if not self.verify_checksums and spans is not None:
            value = handle.get_slice(key)
            if list(value.get_shape()) != want:
                raise CheckpointError(f"{where}: tensor {key!r} is {value.get_shape()}, the manifest says {want}")
        else:
            value = handle.get_tensor(key)
            if self.verify_checksums:
                kind = CHECKSUM_KEY if CHECKSUM_KEY in shard else "sha256"
                if checksum(value, kind) != shard[kind]:
                    raise CheckpointError(f"{where}: checksum mismatch for tensor {key!r} (the file is corrupted)")
            if list(value.shape) != want:
                raise CheckpointError(f"{where}: tensor {key!r} is {list(value.shape)}, the manifest says {want}")
        if spans is None:
            return [value]
        return [value[(slice(None),) * dim + (slice(lo, hi),)] for lo, hi in spans]

    def check_shape(self, name: str, placement: Placement) -> None:
        """Refuse a model tensor that the checkpoint holds at another full shape."""
        saved, wanted = self.tensors[name]["shape"], list(placement.full_shape)
        if saved != wanted:
            raise CheckpointError(
                f"{self.directory}: tensor {name!r} is {saved} in the checkpoint but {wanted} in the model "
                "(a different model size?)"
            )

    def read_full(self, name: str) -> torch.Tensor:
        """The whole (unpadded) tensor, assembled from its shards."""
        if name not in self.tensors:
            raise CheckpointError(f"{self.directory}: no tensor {name!r}")
        return self.read_block(name, Placement.whole(self.tensors[name]), 0)

    def read_block(
        self, name: str, placement: Placement, tp_rank: int, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """This rank's tensor at a (possibly different) TP degree: each of its ranges of the partition
        dim (one, or one per part of a strided split) cut from whichever shards overlap it, padding
        rows zero. A tensor split in one layout may be whole in the other (a frozen decoder sharded
        over the TP group or replicated on every rank): one the checkpoint holds whole is one shard
        covering the whole dim, one the model holds whole is assembled from every shard."""
        info = self.tensors[name]
        dtype = dtype or dtype_from_name(info["dtype"])
        dim, saved_dim = placement.partition_dim, info["partition_dim"]
        if saved_dim is None and dim is None:
            return self._read_shard(name, info["shards"][0]).to(dtype)
        if dim is None:
            placement, dim, tp_rank = Placement.whole(info), saved_dim, 0
        elif saved_dim is not None and dim != saved_dim:
            raise CheckpointError(
                f"{self.directory}: tensor {name!r} is split along dim {saved_dim} in the checkpoint but {dim} "
                "in the model"
            )
        saved = info["shards"]
        if saved_dim is None:
            saved = [{**saved[0], "offset": 0, "length": info["shape"][dim]}]
        ranges = placement.rank_ranges(tp_rank)
        block = torch.zeros(placement.local_shape, dtype=dtype)
        covered = 0
        for shard in saved:
            first, end = shard["offset"], shard["offset"] + shard["length"]
            cuts = []  # each range's overlap with this shard: [lo, hi) of the full dim, where it goes in the block
            for start, stop, local in ranges:
                lo, hi = max(start, first), min(stop, end)
                if hi > lo:
                    cuts.append((lo, hi, local + lo - start))
            if not cuts:
                continue
            parts = self._read_parts(name, shard, dim, [(lo - first, hi - first) for lo, hi, _ in cuts])
            for (lo, hi, at), part in zip(cuts, parts, strict=True):
                block.narrow(dim, at, hi - lo).copy_(part)
                covered += hi - lo
        if covered != sum(stop - start for start, stop, _ in ranges):
            spans = ", ".join(f"[{start}, {stop})" for start, stop, _ in ranges)
            raise CheckpointError(f"{self.directory}: shards of {name!r} do not cover rows {spans}")
        return block
