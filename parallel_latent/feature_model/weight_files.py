"""A pretrained decoder's files checked like a checkpoint's, before a job is accepted: where its
directory is (a local one, a converted package or GGUF file, a hub name in the Hugging Face cache,
or a hub that cannot be reached, said at once), that no link leads out of it, and that every weight
file is whole (a safetensors header that parses, its tensors' byte ranges covering the file, a
torch zip whose entries pass their CRCs) and holds finite values. transformers would otherwise
meet a truncated file as a ``SafetensorError`` on every rank after the run directory was made, and
garbage weights as a loss that turns NaN ten steps in.
"""

from __future__ import annotations

import functools
import math
import zipfile
from pathlib import Path

import torch
import xxhash
from safetensors import SafetensorError, safe_open

from parallel_latent.config import ConfigError
from parallel_latent.files import JSONProblem, link_problem, load_json_file, parse_json

from .hub import cached_snapshot_or_reachable
from .packaged import local_decoder

__all__ = ["check_decoder_files", "decoder_files_digest", "weight_files_problem"]

# Bytes per element of each safetensors dtype.
ITEM_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


def _decoder_directory(name_or_path: str, where: str) -> Path | None:
    """The local directory of the decoder ``name_or_path`` names, or None (a hub name not yet cached)."""
    directory = Path(local_decoder(name_or_path, where))
    return directory if directory.is_dir() else cached_snapshot_or_reachable(str(name_or_path), where)


def check_decoder_files(name_or_path: str) -> None:
    """ConfigError (one line starting with the key) when the decoder ``name_or_path`` names cannot
    be had or its files are not whole. A hub name the hub would still have to send is left to the
    ranks' download once the hub answers."""
    where = f"feature_model.name_or_path={name_or_path}"
    directory = _decoder_directory(name_or_path, where)
    if directory is not None and (problem := weight_files_problem(directory)) is not None:
        raise ConfigError(f"{where}: {problem}")


def decoder_files_digest(name_or_path: str) -> str:
    """The content of the decoder's config.json and weight files (the feature cache's key: two
    directories holding the same weights share a cache, a file changed in place does not)."""
    where = f"feature_model.name_or_path={name_or_path}"
    directory = _decoder_directory(name_or_path, where)
    if directory is None:
        raise ConfigError(f"{where}: its weight files are not in the local cache")
    weights = _weight_files(directory)
    if isinstance(weights, str):
        raise ConfigError(f"{where}: {weights}")
    paths = [directory / "config.json", *weights]
    return _digest_of(tuple((p.name, str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in paths))


@functools.lru_cache(maxsize=8)
def _digest_of(files: tuple) -> str:
    """(name, path, size, mtime) of each file -> the digest of their names and contents (read once
    per process for an unchanged file)."""
    digest = xxhash.xxh3_128()
    for name, path, _, _ in files:
        digest.update(f"{name};".encode())
        with open(path, "rb") as handle:
            while block := handle.read(8 << 20):
                digest.update(block)
    return digest.hexdigest()


def weight_files_problem(directory: Path) -> str | None:
    """What is wrong with the weight files of the decoder directory ``directory`` (one file and
    what is wrong with it), or None. Reads every weight once."""
    if (link := link_problem(directory, "the model's directory")) is not None:
        return link
    if (directory / "config.json").is_file():
        try:
            load_json_file(directory / "config.json")  # bounded before transformers reads it
        except JSONProblem as problem:
            return str(problem)
    weights = _weight_files(directory)
    if isinstance(weights, str):
        return weights
    for path in weights:
        problem = _safetensors_problem(path) if path.suffix == ".safetensors" else _torch_file_problem(path)
        if problem is not None:
            return f"{path}: {problem}"
    return None


def _weight_files(directory: Path) -> list[Path] | str:
    """The weight files transformers would read from ``directory`` (an index's shards, or the one
    file), or what is missing."""
    for single, index in (
        ("model.safetensors", "model.safetensors.index.json"),
        ("pytorch_model.bin", "pytorch_model.bin.index.json"),
    ):
        if (directory / index).is_file():
            try:
                weight_map = load_json_file(directory / index)["weight_map"]
                names = sorted(set(weight_map.values()))
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
                return f"{directory / index}: not an index of weight files (no 'weight_map' object)"
            if not all(isinstance(n, str) and n and "/" not in n and n not in (".", "..") for n in names):
                return f"{directory / index}: names a file outside the directory"
            missing = [n for n in names if not (directory / n).is_file()]
            return (
                f"{directory / missing[0]}: missing (its index names it)" if missing else [directory / n for n in names]
            )
        if (directory / single).is_file():
            return [directory / single]
    return f"{directory}: no weight files (model.safetensors, its index, or pytorch_model.bin)"


def _safetensors_problem(path: Path) -> str | None:
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            return f"{size} bytes: truncated (no safetensors header)"
        length = int.from_bytes(prefix, "little")
        if 8 + length > size:
            return f"its header claims {length} bytes of a {size}-byte file: truncated or not safetensors"
        try:
            header = parse_json(handle.read(length))
        except (UnicodeDecodeError, ValueError):
            return "its safetensors header is not JSON: damaged or not safetensors"
    if not isinstance(header, dict):
        return "its safetensors header is not an object"
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = entry["data_offsets"]
            expected = math.prod(entry["shape"]) * ITEM_BYTES[entry["dtype"]]
        except (KeyError, TypeError, ValueError):
            return f"tensor {name!r}: its header entry is not a dtype, shape and byte range"
        if not (isinstance(begin, int) and isinstance(stop, int) and 0 <= begin <= stop and stop - begin == expected):
            return f"tensor {name!r}: bytes {begin}..{stop} do not hold its {entry['dtype']} {entry['shape']}"
        end = max(end, stop)
    if 8 + length + end != size:
        return f"{size} bytes, its header's tensors end at byte {8 + length + end}: truncated or damaged"
    try:
        with safe_open(str(path), framework="pt") as weights:
            for name in weights.keys():  # noqa: SIM118 (safe_open is no mapping)
                if (problem := _not_finite(name, weights.get_tensor(name))) is not None:
                    return problem
    except SafetensorError as error:
        return f"does not read ({error})"
    return None


def _torch_file_problem(path: Path) -> str | None:
    if not zipfile.is_zipfile(path):
        return "not a whole torch file (no zip directory at its end)"
    with zipfile.ZipFile(path) as archive:
        if (bad := archive.testzip()) is not None:
            return f"its entry {bad} fails its CRC"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # a pickle that needs more than tensors is refused, never run
        return f"does not load with weights_only=True ({type(error).__name__})"
    if not isinstance(state, dict):
        return "not a state dict"
    for name, tensor in state.items():
        if isinstance(tensor, torch.Tensor) and (problem := _not_finite(name, tensor)) is not None:
            return problem
    return None


def _not_finite(name: str, tensor: torch.Tensor) -> str | None:
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        return f"tensor {name!r} holds {bad} NaN or infinite values (damaged weights)"
    return None
