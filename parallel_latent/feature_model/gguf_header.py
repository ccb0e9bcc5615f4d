"""A GGUF file's header walked within bounds before anything converts it.

transformers' GGUF reader trusts the counts and lengths a file states: a file that holds the magic
and nothing sane ends in a ``struct.error`` or a reader that allocates what a length claims. This
walk reads the header (llama.cpp's layout: magic, version, tensor and metadata counts, the metadata
entries, the tensor records) and checks that every count and length fits in the file, so that such a
file is refused in one line naming it, before the line that says it is being converted.
"""

from __future__ import annotations

import struct
from pathlib import Path

__all__ = ["gguf_header_problem"]

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 8  # GGML_MAX_DIMS is 4; a little room, never millions
# Metadata value types (gguf.GGUFValueType): fixed widths, then string = 8, array = 9.
FIXED_WIDTHS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9


class _Malformed(Exception):
    pass


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def take(self, size: int) -> bytes:
        if size < 0 or self.at + size > len(self.data):
            raise _Malformed(f"a length of {size} bytes at offset {self.at} runs past the file's end")
        chunk = self.data[self.at : self.at + size]
        self.at += size
        return chunk

    def number(self, fmt: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def count(self, what: str, smallest: int) -> int:
        """A stated count of items at least ``smallest`` bytes each: it must fit in what is left."""
        value = self.number("Q")
        if value * smallest > len(self.data) - self.at:
            raise _Malformed(f"{what} {value} cannot fit in the file's {len(self.data)} bytes")
        return value

    def string(self) -> bytes:
        return self.take(self.count("a string of length", 1))

    def value(self, kind: int, depth: int = 0) -> None:
        if kind in FIXED_WIDTHS:
            self.take(FIXED_WIDTHS[kind])
        elif kind == STRING:
            self.string()
        elif kind == ARRAY and depth == 0:  # arrays of arrays do not occur in the format
            item = self.number("I")
            for _ in range(self.count("an array of length", FIXED_WIDTHS.get(item, 8))):
                self.value(item, depth + 1)
        else:
            raise _Malformed(f"metadata value type {kind} at offset {self.at} is not one GGUF defines")


def gguf_header_problem(path: Path, header_bytes: int = 64 << 20) -> str | None:
    """What is wrong with the GGUF header of ``path`` (one line, without the file's name), or None.
    Only the first ``header_bytes`` are read: a header (vocabulary included) is far smaller."""
    with open(path, "rb") as handle:
        data = handle.read(header_bytes)
    size = Path(path).stat().st_size
    reader = _Reader(data)
    try:
        if reader.take(4) != MAGIC:
            return "not a GGUF file (no GGUF magic at its start)"
        if (version := reader.number("I")) not in VERSIONS:
            return f"GGUF version {version}; versions {VERSIONS[0]}-{VERSIONS[-1]} are read"
        tensors = reader.number("Q")
        entries = reader.count("a metadata count of", 13)
        for _ in range(entries):
            reader.string()
            reader.value(reader.number("I"))
        if tensors * 24 > size:  # each record: a name, its dimensions, a type, an offset
            return f"a tensor count of {tensors} cannot fit in the file's {size} bytes"
        for _ in range(tensors):
            reader.string()
            if (dims := reader.number("I")) > MAX_DIMS:
                return f"a tensor of {dims} dimensions (at most {MAX_DIMS}): damaged"
            reader.take(8 * dims + 4 + 8)
    except _Malformed as problem:
        return f"its GGUF header is damaged: {problem}"
    except struct.error:  # (take() checks every length first; kept as the last word)
        return "its GGUF header is damaged: truncated"
    return None
