"""Reading and writing the safetensors format directly: no pickle, one copy, checksums on the way.

The format is an 8-byte little-endian header length, a JSON header (per tensor: dtype, shape and
byte offsets into the data section; optional ``__metadata__`` of strings), then the raw bytes.
Writing it ourselves lets us hash each tensor's bytes while they are in cache and fsync the file;
reading it ourselves lets a tensor land straight in the destination parameter's memory (one copy
from the page cache instead of file -> temporary tensor -> parameter) and lets a truncated file be
named as such instead of surfacing as a parse error. Files written here load with the
``safetensors`` library, and files written by it load here.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CheckpointError

DTYPE_TO_NAME = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
NAME_TO_DTYPE = {name: dtype for dtype, name in DTYPE_TO_NAME.items()}
# A header this large is not a checkpoint header but a damaged length field.
MAX_HEADER_BYTES = 256 * 1024 * 1024
# Large reads go in pieces so a multi-GB tensor does not need one multi-GB syscall.
READ_CHUNK = 64 * 1024 * 1024
# Below this, handing a hash to another thread costs more than it saves.
PARALLEL_HASH_BYTES = 1024 * 1024


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the spelling manifests use)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint manifest")
    return dtype


def _byte_view(tensor: torch.Tensor):
    """The bytes of a contiguous CPU tensor as a writable numpy array (any dtype, bf16 included)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def tensor_sha256(tensor: torch.Tensor) -> str:
    tensor = tensor.detach().contiguous().cpu()
    return (
        hashlib.sha256(memoryview(_byte_view(tensor))).hexdigest() if tensor.numel() else hashlib.sha256().hexdigest()
    )


class SafetensorsWriter:
    """Stream tensors into a safetensors file whose header is fixed up front from their specs.

    Only one tensor needs to be in memory at a time (a ZeRO-3 parameter is gathered, written and
    released); each tensor's sha256 is taken from the bytes as they are written.
    """

    def __init__(
        self,
        path: str | Path,
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ):
        header: dict[str, object] = {}
        offset = 0
        self._expected: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        for name, dtype, shape in specs:
            if dtype not in DTYPE_TO_NAME:
                raise CheckpointError(f"{name}: dtype {dtype} cannot be stored in safetensors")
            numel = 1
            for n in shape:
                numel *= n
            size = numel * dtype.itemsize
            header[name] = {
                "dtype": DTYPE_TO_NAME[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            self._expected.append((name, dtype, tuple(shape)))
            offset += size
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        header_bytes = json.dumps(header, separators=(",", ":")).encode()
        # The data section starts 8-byte aligned, as the reference implementation writes it.
        header_bytes += b" " * (-len(header_bytes) % 8)
        self.path = Path(path)
        self._handle = open(self.path, "wb")  # noqa: SIM115 (closed by close() or abort())
        self._handle.write(struct.pack("<Q", len(header_bytes)))
        self._handle.write(header_bytes)
        self._next = 0
        self.checksums: dict[str, str] = {}
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256")

    def write(self, name: str, tensor: torch.Tensor) -> str:
        """Append the next tensor (in spec order); returns its sha256."""
        expected_name, dtype, shape = self._expected[self._next]
        tensor = tensor.detach()
        if name != expected_name or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"{self.path}: expected {expected_name} {dtype_name(dtype)}{list(shape)}, "
                f"got {name} {dtype_name(tensor.dtype)}{list(tensor.shape)}"
            )
        digest = hashlib.sha256()
        if tensor.numel():
            data = memoryview(_byte_view(tensor.contiguous().cpu()))
            # Hash on a second thread while this one writes: both release the GIL on large buffers.
            hashing = self._hasher.submit(digest.update, data) if data.nbytes >= PARALLEL_HASH_BYTES else None
            if hashing is None:
                digest.update(data)
            self._handle.write(data)
            if hashing is not None:
                hashing.result()
        self.checksums[name] = digest.hexdigest()
        self._next += 1
        return self.checksums[name]

    def close(self) -> dict[str, str]:
        if self._next != len(self._expected):
            self.abort()
            raise CheckpointError(f"{self.path}: {len(self._expected) - self._next} tensors were never written")
        self._hasher.shutdown()
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        return self.checksums

    def abort(self) -> None:
        self._hasher.shutdown()
        self._handle.close()


def write_safetensors(
    path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> dict[str, str]:
    """Write ``tensors`` (in the given order) to ``path``, fsync it, and return each tensor's sha256."""
    writer = SafetensorsWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], metadata)
    try:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


@dataclass(frozen=True)
class StoredTensor:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """The header of one safetensors file, validated against the file's size, and its tensors."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as handle:
                prefix = handle.read(8)
                if len(prefix) < 8:
                    raise CheckpointError(f"{self.path}: truncated file ({size} bytes, no header)")
                (header_len,) = struct.unpack("<Q", prefix)
                if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                    raise CheckpointError(
                        f"{self.path}: truncated or damaged file (header of {header_len} bytes, file of {size} bytes)"
                    )
                header = json.loads(handle.read(header_len))
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: shard file missing") from None
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise CheckpointError(f"{self.path}: damaged safetensors header") from None
        self.size = size
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        data_start = 8 + header_len
        self.tensors: dict[str, StoredTensor] = {}
        for name, info in header.items():
            try:
                dtype = NAME_TO_DTYPE[info["dtype"]]
                shape = tuple(int(n) for n in info["shape"])
                begin, end = (data_start + int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path}: damaged header entry for tensor {name!r}") from None
            numel = 1
            for n in shape:
                numel *= n
            if end - begin != numel * dtype.itemsize:
                raise CheckpointError(f"{self.path}: tensor {name!r}: byte range does not match its shape")
            if end > size:
                raise CheckpointError(f"{self.path}: truncated file ({size} bytes; tensor {name!r} ends at byte {end})")
            self.tensors[name] = StoredTensor(dtype, shape, begin, end)

    def read_into(self, name: str, out: torch.Tensor, expected_sha256: str | None = None) -> None:
        """Fill the contiguous CPU tensor ``out`` with tensor ``name``; verify its checksum if given."""
        stored = self.tensors.get(name)
        if stored is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} missing from shard")
        if tuple(out.shape) != stored.shape or out.dtype != stored.dtype:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} is {dtype_name(stored.dtype)}{list(stored.shape)}, "
                f"expected {dtype_name(out.dtype)}{list(out.shape)}"
            )
        if stored.nbytes == 0:
            return
        buffer = memoryview(_byte_view(out))
        with open(self.path, "rb", buffering=0) as handle:
            handle.seek(stored.begin)
            done = 0
            while done < stored.nbytes:
                got = handle.readinto(buffer[done : done + READ_CHUNK])
                if not got:
                    raise CheckpointError(f"{self.path}: truncated file while reading tensor {name!r}")
                done += got
        if expected_sha256 is not None and hashlib.sha256(buffer).hexdigest() != expected_sha256:
            raise CheckpointError(f"{self.path}: checksum mismatch for tensor {name!r} (the file is corrupted)")

    def read(self, name: str, expected_sha256: str | None = None) -> torch.Tensor:
        stored = self.tensors.get(name)
        if stored is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} missing from shard")
        out = torch.empty(stored.shape, dtype=stored.dtype)
        self.read_into(name, out, expected_sha256)
        return out
