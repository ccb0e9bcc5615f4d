"""Build the bundled corpus from Debian's ``r-cran-janeaustenr`` package.

This script is NOT used at runtime; it documents (and reproduces) how
``austen_pride_and_prejudice.txt`` was made.  See ``SOURCE.md`` for provenance and license.

The Debian package stores the novels as R objects in a lazy-load database
(``data/Rdata.rdx`` index + ``data/Rdata.rdb`` blobs, both in R's XDR
serialization format).  R is not needed: a minimal reader for the few R types
that occur there is included below.

Usage (on a Debian/Ubuntu machine):

    apt-get download r-cran-janeaustenr
    dpkg-deb -x r-cran-janeaustenr_*_all.deb pkg
    python parallel_latent/corpus/build_corpus.py \
        pkg/usr/lib/R/site-library/janeaustenr prideprejudice \
        parallel_latent/corpus/austen_pride_and_prejudice.txt
"""

from __future__ import annotations

import argparse
import gzip
import re
import struct
import zlib
from pathlib import Path

# --------------------------------------------------------------------------- #
# Minimal reader for R's XDR serialization (format "X", versions 2 and 3).
# --------------------------------------------------------------------------- #

NILSXP, SYMSXP, LISTSXP, ENVSXP, LANGSXP = 0, 1, 2, 4, 6
CHARSXP, LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP = 9, 10, 13, 14, 16, 19
REFSXP, NILVALUE_SXP, GLOBALENV_SXP, EMPTYENV_SXP, BASEENV_SXP = 255, 254, 253, 242, 241

IS_OBJECT_BIT, HAS_ATTR_BIT, HAS_TAG_BIT = 1 << 8, 1 << 9, 1 << 10


class RReader:
    """Reads the subset of R objects found in janeaustenr's data: character,
    integer, logical, double vectors, lists and pairlists (attributes)."""

    def __init__(self, payload: bytes):
        self.buf = payload
        self.pos = 0
        self.refs: list[object] = []

    def _int(self) -> int:
        (value,) = struct.unpack_from(">i", self.buf, self.pos)
        self.pos += 4
        return value

    def _length(self) -> int:
        length = self._int()
        if length == -1:  # "long vector": two more ints
            upper, lower = self._int(), self._int()
            length = (upper << 32) + lower
        return length

    def read_header(self) -> None:
        if self.buf[:2] != b"X\n":
            raise ValueError("not an XDR R serialization")
        self.pos = 2
        version = self._int()
        self._int()  # writer R version
        self._int()  # minimal reader R version
        if version == 3:
            encoding_length = self._int()
            self.pos += encoding_length

    def read_item(self) -> object:
        flags = self._int()
        sexp_type = flags & 0xFF
        has_attr = bool(flags & HAS_ATTR_BIT)
        has_tag = bool(flags & HAS_TAG_BIT)

        if sexp_type in (NILVALUE_SXP, GLOBALENV_SXP, EMPTYENV_SXP, BASEENV_SXP):
            return None
        if sexp_type == REFSXP:
            index = flags >> 8
            if index == 0:
                index = self._int()
            return self.refs[index - 1]
        if sexp_type == SYMSXP:
            name = self.read_item()
            self.refs.append(name)
            return name
        if sexp_type in (LISTSXP, LANGSXP):
            attributes = self.read_item() if has_attr else None
            tag = self.read_item() if has_tag else None
            head = self.read_item()
            tail = self.read_item()
            del attributes
            pairs = [(tag, head)]
            if isinstance(tail, list):
                pairs.extend(tail)
            return pairs
        if sexp_type == CHARSXP:
            length = self._int()
            if length == -1:
                return None  # NA_character_
            text = self.buf[self.pos : self.pos + length].decode("utf-8", errors="replace")
            self.pos += length
            return text
        if sexp_type in (LGLSXP, INTSXP):
            length = self._length()
            values = list(struct.unpack_from(f">{length}i", self.buf, self.pos))
            self.pos += 4 * length
            result: object = values
        elif sexp_type == REALSXP:
            length = self._length()
            values = list(struct.unpack_from(f">{length}d", self.buf, self.pos))
            self.pos += 8 * length
            result = values
        elif sexp_type in (STRSXP, VECSXP):
            length = self._length()
            result = [self.read_item() for _ in range(length)]
        else:
            raise ValueError(f"unsupported R type {sexp_type} at byte {self.pos}")
        if has_attr:
            attributes = dict(self.read_item())
            if sexp_type == VECSXP and "names" in attributes:
                result = dict(zip(attributes["names"], result, strict=True))
        return result


def read_r_object(payload: bytes) -> object:
    reader = RReader(payload)
    reader.read_header()
    return reader.read_item()


def load_lazy_data(package_dir: Path, name: str) -> object:
    """Load one object from an R package's lazy-load data database."""
    index = read_r_object(gzip.decompress((package_dir / "data" / "Rdata.rdx").read_bytes()))
    offset, length = index["variables"][name]
    with open(package_dir / "data" / "Rdata.rdb", "rb") as blob_file:
        blob_file.seek(offset)
        blob = blob_file.read(length)
    # Each blob: 4-byte big-endian uncompressed size, then a zlib stream.
    return read_r_object(zlib.decompress(blob[4:]))


# --------------------------------------------------------------------------- #
# Gutenberg-style hard-wrapped text -> one sentence per line.
# --------------------------------------------------------------------------- #

MIN_WORDS, MAX_WORDS = 5, 40
# Titles that end in a period but do not end a sentence.
ABBREVIATIONS = ("Mr.", "Mrs.", "Dr.", "St.", "Messrs.", "Col.", "Capt.", "Esq.")
SENTENCE_END = re.compile(r"""(?<=[.!?])["']?\s+(?=["'(]?[A-Z])""")


def paragraphs(lines: list[str]) -> list[str]:
    """Rejoin hard-wrapped lines into paragraphs (separated by blank lines)."""
    result, current = [], []
    for line in lines:
        line = (line or "").strip()
        if line:
            current.append(line)
        elif current:
            result.append(" ".join(current))
            current = []
    if current:
        result.append(" ".join(current))
    return result


def split_sentences(paragraph: str) -> list[str]:
    sentences: list[str] = []
    start = 0
    for match in SENTENCE_END.finditer(paragraph):
        candidate = paragraph[start : match.start()].rstrip()
        # Keep the closing quote with its sentence.
        closing = paragraph[match.start() : match.end()].strip()
        if candidate.endswith(ABBREVIATIONS):
            continue
        sentences.append((candidate + closing).strip())
        start = match.end()
    tail = paragraph[start:].strip()
    if tail:
        sentences.append(tail)
    return sentences


def clean(sentence: str) -> str:
    sentence = sentence.replace("_", "")  # Gutenberg marks italics as _word_
    sentence = sentence.replace("--", " -- ")
    sentence = re.sub(r"\s+", " ", sentence).strip()
    # Speech that runs over several sentences is opened in the first of them and
    # closed in the last; add the missing mark so every sample stands on its own.
    quote_positions = [i for i, char in enumerate(sentence) if char == '"']
    if quote_positions:

        def is_opening(i: int) -> bool:
            return i == 0 or sentence[i - 1] in " ("

        opens_unclosed = is_opening(quote_positions[-1])
        closes_unopened = not is_opening(quote_positions[0])
        sentence = ('"' if closes_unopened else "") + sentence + ('"' if opens_unclosed else "")
    return sentence


def sentence_samples(lines: list[str]) -> list[str]:
    samples = []
    for paragraph in paragraphs(lines):
        if paragraph.isupper() or paragraph.startswith(("Chapter", "CHAPTER")):
            continue  # headings
        for sentence in split_sentences(paragraph):
            sentence = clean(sentence)
            # Whole sentences only (no clause fragments): Austen's long periods are
            # dropped rather than cut, so every sample reads as natural prose.
            if MIN_WORDS <= len(sentence.split()) <= MAX_WORDS:
                samples.append(sentence)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package_dir", type=Path, help="…/site-library/janeaustenr")
    parser.add_argument("novel", help="R object name, e.g. prideprejudice")
    parser.add_argument("output", type=Path)
    args = parser.parse_args()
    lines = load_lazy_data(args.package_dir, args.novel)
    samples = sentence_samples(lines)
    args.output.write_text("\n".join(samples) + "\n", encoding="utf-8")
    size = args.output.stat().st_size
    print(f"wrote {len(samples)} samples, {size} bytes to {args.output}")


if __name__ == "__main__":
    main()
