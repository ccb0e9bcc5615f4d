"""Where samples come from: naming a source (a file, a directory, a saved dataset, a hub dataset, a
prepared copy), the cheap checks done on every start, and loading it with Hugging Face ``datasets``
for preparation.

Every problem is a :class:`DataError` whose message is one line naming the path (and ``file:line``
for JSONL).  :func:`read_samples` is the small in-memory reader (all samples as a list of strings):
what ``evaluate --data`` uses, and the reference the prepared pipeline is tested against.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parallel_latent.data.prepared import is_prepared_copy
from parallel_latent.errors import DataError, first_line, os_reason
from parallel_latent.files import JSONProblem, parse_json

__all__ = [
    "HUB_PREFIX",
    "DataError",
    "Source",
    "batch_samples",
    "bundled_corpus_path",
    "check_files",
    "diagnose",
    "list_data_files",
    "load_source_datasets",
    "read_samples",
    "read_split",
    "record_samples",
    "resolve_source",
    "samples_per_file",
]

HUB_PREFIX = "hf:"
FORMAT_SUFFIXES = {
    "text": (".txt",),
    "jsonl": (".jsonl",),
    "parquet": (".parquet",),
    "csv": (".csv",),
}
SNIFF_BYTES = 8192
COUNT_BATCH = 10_000
STREAM_CHUNK_BYTES = 1 << 20


def bundled_corpus_path() -> Path:
    """The corpus shipped with the package (see ``corpus/SOURCE.md``)."""
    return Path(__file__).resolve().parents[1] / "corpus" / "austen_pride_and_prejudice.txt"


# --------------------------------------------------------------------------- #
# Naming a source.
# --------------------------------------------------------------------------- #


def file_format(path: Path, requested: str = "auto") -> str:
    """``requested`` unless ``auto``; then by suffix, and plain text for any other suffix."""
    if requested != "auto":
        return requested
    suffix = path.suffix.lower()
    return next((fmt for fmt, suffixes in FORMAT_SUFFIXES.items() if suffix in suffixes), "text")


def _suffixes(format: str) -> tuple[str, ...]:
    if format == "auto":
        return tuple(s for suffixes in FORMAT_SUFFIXES.values() for s in suffixes)
    return FORMAT_SUFFIXES[format]


def list_data_files(path: str | Path, format: str = "auto") -> list[Path]:
    """The files a data path stands for: the file itself, or for a directory all data files below it
    (``*.txt``, ``*.jsonl``, ``*.parquet``, ``*.csv``; only one kind if ``format`` says so), in sorted
    order. Empty files in a directory hold no samples and are left out."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: data path does not exist")
    if not path.is_dir():
        return [path]
    suffixes = _suffixes(format)
    files = sorted(
        candidate
        for candidate in path.rglob("*")
        if candidate.suffix.lower() in suffixes and candidate.is_file() and candidate.stat().st_size > 0
    )
    if not files:
        patterns = ", ".join(f"*{suffix}" for suffix in suffixes)
        patterns = " or ".join(patterns.rsplit(", ", 1))
        raise DataError(f"{path}: directory contains no {patterns} files")
    return files


def is_saved_dataset(path: Path) -> bool:
    """A directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


@dataclass(frozen=True)
class Source:
    """A resolved ``data.path``.

    ``kind``: ``files`` (text/JSONL/parquet/CSV files; ``files`` holds (path, format) pairs in
    order), ``saved`` (a ``save_to_disk`` directory), ``hub`` (``hf:NAME[:CONFIG]``) or ``prepared``
    (a prepared copy used as it is).
    """

    kind: str
    location: str  # as the user named it, for messages
    files: tuple[tuple[str, str], ...] = ()
    hub_name: str = ""
    hub_config: str | None = None

    @property
    def slug(self) -> str:
        """A short readable name for the cache directory."""
        if self.kind == "hub":
            raw = self.hub_name + (f"-{self.hub_config}" if self.hub_config else "")
        else:
            raw = Path(self.location).name
            for suffixes in FORMAT_SUFFIXES.values():
                for suffix in suffixes:
                    raw = raw.removesuffix(suffix)
        cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in raw).strip("._") or "corpus"
        return cleaned[:40]

    def identity(self) -> dict[str, Any]:
        """What identifies the source's content, cheaply: every file's absolute path, size and
        modification time (no content hash: this runs on every start, on every rank)."""
        if self.kind == "hub":
            return {"kind": "hub", "name": self.hub_name, "config": self.hub_config}
        entries = []
        for path, fmt in self.files:
            try:
                stat = os.stat(path)
            except OSError as error:
                raise DataError(f"{path}: cannot read file: {os_reason(error)}") from None
            entries.append([path, fmt, stat.st_size, stat.st_mtime_ns])
        return {"kind": self.kind, "files": entries}


def resolve_source(path: str, format: str = "auto") -> Source:
    """``data.path`` as a :class:`Source` ("" = the bundled corpus). Checks what is cheap: existence,
    kinds, readability and non-empty files; the contents are checked when they are prepared."""
    if path.startswith(HUB_PREFIX):
        name, _, config = path[len(HUB_PREFIX) :].partition(":")
        if not name:
            raise DataError(f"{path}: expected hf:NAME or hf:NAME:CONFIG (a Hugging Face hub dataset)")
        return Source("hub", path, hub_name=name, hub_config=config or None)
    root = Path(path) if path else bundled_corpus_path()
    if not root.exists():
        raise DataError(f"{root}: data path does not exist")
    if root.is_dir():
        if is_prepared_copy(root):
            return Source("prepared", str(root), files=_all_files(root, "prepared"))
        if is_saved_dataset(root):
            return Source("saved", str(root), files=_all_files(root, "arrow"))
    files = []
    for data_file in list_data_files(root, format):
        if not os.access(data_file, os.R_OK):
            raise DataError(f"{data_file}: cannot read file: Permission denied")
        if data_file.stat().st_size == 0:
            raise DataError(f"{data_file}: file is empty")
        files.append((str(data_file.resolve()), file_format(data_file, format)))
    return Source("files", str(root), files=tuple(files))


def _all_files(root: Path, fmt: str) -> tuple[tuple[str, str], ...]:
    return tuple((str(p.resolve()), fmt) for p in sorted(root.rglob("*")) if p.is_file())


# --------------------------------------------------------------------------- #
# Content checks (done when preparing; cheap: the first 8 KB, or parquet's magic bytes).
# --------------------------------------------------------------------------- #


def _sniff(path: str, fmt: str) -> None:
    try:
        with open(path, "rb") as handle:
            head = handle.read(SNIFF_BYTES)
            tail = b""
            if fmt == "parquet" and os.fstat(handle.fileno()).st_size >= 8:
                handle.seek(-4, os.SEEK_END)
                tail = handle.read(4)
    except OSError as error:
        raise DataError(f"{path}: cannot read file: {os_reason(error)}") from None
    if fmt == "parquet":
        if head[:4] != b"PAR1" or tail != b"PAR1":
            raise DataError(
                f"{path}: not a parquet file (no PAR1 magic bytes at both ends; truncated or another format)"
            )
        return
    nul = head.find(b"\0")
    if nul >= 0:
        raise DataError(f"{path}: binary data (NUL byte at offset {nul}), not UTF-8 text")


def check_files(source: Source) -> None:
    """The content checks that are cheap enough to run before loading."""
    if source.kind == "files":
        for path, fmt in source.files:
            _sniff(path, fmt)


def _first_bad_utf8(path: str) -> int | None:
    """Byte offset of the first invalid UTF-8 sequence, streaming (for error messages only)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as error:
                return offset + error.start
            offset += len(chunk)
        pending = len(decoder.getstate()[0])  # an incomplete sequence at the very end
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            return offset - pending
    return None


# --------------------------------------------------------------------------- #
# The in-memory reader (small corpora, evaluation files; the reference for the pipeline).
# --------------------------------------------------------------------------- #


def _read_text(path: Path) -> str:
    try:
        data = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 text (bad byte at offset {error.start})") from None
    except OSError as error:
        raise DataError(f"{path}: cannot read file: {os_reason(error)}") from None
    nul = data.find("\0")
    if nul >= 0:
        raise DataError(f"{path}: binary data (NUL byte at offset {len(data[:nul].encode())}), not UTF-8 text")
    return data


def split_text(text: str, sample_unit: str) -> list[str]:
    """Samples of a text: stripped non-empty lines, or blank-line-separated paragraphs whose lines
    are stripped and joined with spaces. ``str.splitlines`` boundaries (also \\r, \\v, \\f, \\x85,
    \\u2028, ...) separate lines."""
    lines = text.splitlines()
    if sample_unit == "line":
        return [line.strip() for line in lines if line.strip()]
    paragraphs, current = [], []
    for line in lines + [""]:  # the sentinel closes the last paragraph
        if line.strip():
            current.append(line.strip())
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    return paragraphs


def _jsonl_samples(path: Path, text_field: str) -> list[str]:
    samples = []
    for line_number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_number}"
        try:
            record = parse_json(line)
        except JSONProblem as problem:
            raise DataError(f"{where}: {problem}") from None
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if text_field not in record:
            raise DataError(f"{where}: missing text field {text_field!r}")
        text = record[text_field]
        if not isinstance(text, str):
            raise DataError(f"{where}: text field {text_field!r} is {type(text).__name__}, not a string")
        if text.strip():
            samples.append(text.strip())
    return samples


def read_samples(
    path: str | Path = "",
    format: str = "auto",
    text_field: str = "text",
    sample_unit: str = "line",
    split: str = "train",
) -> list[str]:
    """All non-empty samples (stripped strings) of a data path, in file order, in memory.

    Text and JSONL files are read by plain Python; parquet, CSV, saved and hub datasets through
    ``datasets``."""
    source = resolve_source(str(path), format)
    if source.kind == "prepared":
        raise DataError(f"{source.location}: a prepared copy holds token ids, not texts; name its source instead")
    root = source.location if str(path) else str(bundled_corpus_path())
    samples: list[str] = []
    if source.kind == "files" and all(fmt in ("text", "jsonl") for _, fmt in source.files):
        for data_file, fmt in source.files:
            if fmt == "jsonl":
                samples.extend(_jsonl_samples(Path(data_file), text_field))
            else:
                samples.extend(split_text(_read_text(Path(data_file)), sample_unit))
    else:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="parallel-latent-read-") as work:
            for dataset, unit in load_source_datasets(source, text_field, sample_unit, split, Path(work)):
                for batch in dataset.iter(batch_size=10_000):
                    for text in batch["text"]:
                        samples.extend(record_samples(text, unit))
    if not samples:
        raise DataError(f"{root}: corpus is empty (no non-empty samples)")
    return samples


# Line boundaries of str.splitlines other than "\n" (which the text loader already split on).
_OTHER_LINE_BREAKS = re.compile("[\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


def record_samples(text: str | None, unit: str) -> list[str]:
    """The samples of one row of a loaded dataset (see :func:`load_source_datasets`)."""
    if text is None:
        return []
    if unit == "record":
        stripped = text.strip()
        return [stripped] if stripped else []
    if unit == "line":
        return [part.strip() for part in text.splitlines() if part.strip()]
    return split_text(text, "paragraph")


def batch_samples(texts: list[str | None], unit: str) -> list[str]:
    """The samples of a batch of rows, in order: what :func:`record_samples` gives row by row, with
    one fast path for the common batch of plain lines."""
    if unit != "paragraph" and None not in texts and not _OTHER_LINE_BREAKS.search("\n".join(texts)):
        stripped = [text.strip() for text in texts]
        return [text for text in stripped if text]
    return [sample for text in texts for sample in record_samples(text, unit)]


# --------------------------------------------------------------------------- #
# Loading with Hugging Face datasets.
# --------------------------------------------------------------------------- #


def _quiet_datasets() -> Any:
    import datasets

    datasets.disable_progress_bars()
    # Their error logs repeat what our one-line DataError says better (with the file and line).
    datasets.utils.logging.set_verbosity(logging.CRITICAL)
    with contextlib.suppress(ImportError, AttributeError):
        import huggingface_hub

        huggingface_hub.utils.logging.set_verbosity(logging.CRITICAL)
    return datasets


def _first_line(error: BaseException) -> str:
    """The error's type and first line (a library's error: its type says whose)."""
    line = first_line(error)
    return line if line == type(error).__name__ else f"{type(error).__name__}: {line}"


def _text_column(dataset: Any, text_field: str, where: str) -> Any:
    """``dataset`` reduced to one string column named ``text``."""
    if text_field not in dataset.column_names:
        columns = ", ".join(dataset.column_names) or "none"
        raise DataError(f"{where}: no column {text_field!r} (columns: {columns}); set data.text_field")
    feature = dataset.features[text_field]
    dtype = getattr(feature, "dtype", None)
    if dtype not in ("string", "large_string"):
        raise DataError(f"{where}: column {text_field!r} holds {dtype or type(feature).__name__} values, not text")
    dataset = dataset.select_columns([text_field])
    return dataset.rename_column(text_field, "text") if text_field != "text" else dataset


def _root_cause(error: BaseException) -> BaseException:
    """The loaders wrap the real problem (DatasetGenerationError from ArrowInvalid, ...)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def diagnose(files: list[tuple[str, str]], text_field: str, error: BaseException | None) -> DataError:
    """A precise one-line error for files that failed to load or tokenise (the loaders' own errors
    name no file): the first file with invalid UTF-8 or, for JSONL, the first bad line; else the
    loader's message with the file (or the first of the files)."""
    for path, fmt in files:
        if fmt in ("text", "jsonl", "csv"):
            bad = _first_bad_utf8(path)
            if bad is not None:
                return DataError(f"{path}: not UTF-8 text (bad byte at offset {bad})")
        if fmt == "jsonl":
            _jsonl_samples(Path(path), text_field)  # raises the file:line error
    first, fmt = files[0]
    where = first if len(files) == 1 else f"{first} (or another of {len(files)} files)"
    detail = f": {_first_line(_root_cause(error))}" if error is not None else ""
    return DataError(f"{where}: cannot read as {fmt}{detail}")


def _csv_header(path: str) -> list[str]:
    with open(path, encoding="utf-8-sig", newline="") as handle:
        return next(csv.reader(handle), [])


def _load_file_group(
    files: list[str], fmt: str, text_field: str, sample_unit: str, work: Path, streaming: bool = False
) -> tuple[Any, str]:
    """Files of one format as one dataset (see :func:`load_source_datasets`); ``streaming``: an
    ``IterableDataset`` that reads the files as it is iterated, with the same builder and options
    (what :func:`samples_per_file` counts; not for JSONL, whose record checks need the loaded table)."""
    datasets = _quiet_datasets()
    cache = str(work / "hf-cache")
    options: dict[str, Any] = {}
    column = text_field
    if fmt == "text":
        # The text builder names its features only once it has read a file (never, streaming).
        features = datasets.Features({"text": datasets.Value("string")})
        options, column, unit = {"sample_by": sample_unit, "features": features}, "text", sample_unit
        if streaming:
            # The builder reads a chunk of text at a time (lines and paragraphs are completed across
            # chunks, so the rows do not depend on its size); its 10 MB default held some 120 MB of
            # strings and Arrow while a file was counted.
            options["chunksize"] = STREAM_CHUNK_BYTES
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        for path in files:
            try:
                names = pq.read_schema(path).names
            except Exception as error:  # pyarrow raises several types for a broken footer
                raise DataError(f"{path}: cannot read as parquet: {_first_line(error)}") from None
            if text_field not in names:
                raise DataError(f"{path}: no column {text_field!r} (columns: {', '.join(names)}); set data.text_field")
        options, unit = {"columns": [text_field]}, "record"
    elif fmt == "csv":
        for path in files:
            try:
                header = _csv_header(path)
            except UnicodeDecodeError:
                raise diagnose([(path, fmt)], text_field, None) from None
            except (OSError, csv.Error) as error:
                raise DataError(f"{path}: cannot read as CSV: {_first_line(error)}") from None
            if text_field not in header:
                raise DataError(f"{path}: no column {text_field!r} (columns: {', '.join(header)}); set data.text_field")
        # Every cell as written: no NaN for empty cells or for texts such as "NA", "null" or "None".
        options = {
            "usecols": [text_field],
            "na_filter": False,
            "features": datasets.Features({text_field: datasets.Value("string")}),
        }
        unit = "record"
    else:
        unit = "record"
    builder = "json" if fmt == "jsonl" else fmt
    try:
        dataset = datasets.load_dataset(
            builder, data_files=files, split="train", cache_dir=cache, streaming=streaming, **options
        )
    except DataError:
        raise
    except Exception as error:  # the builders raise many types; all mean "this input is bad"
        raise diagnose([(path, fmt) for path in files], text_field, error) from None
    where = files[0] if len(files) == 1 else f"{Path(files[0]).parent} ({fmt} files)"
    if fmt == "jsonl":
        feature = dataset.features.get(text_field)
        bad_type = getattr(feature, "dtype", None) not in ("string", "large_string")
        if text_field not in dataset.column_names or bad_type or dataset.data.column(text_field).null_count:
            # A record without the field, or a non-string value: name the file and line.
            for path in files:
                _jsonl_samples(Path(path), text_field)
    return _text_column(dataset, column, where), unit


def load_source_datasets(
    source: Source, text_field: str, sample_unit: str, split: str, work: Path
) -> list[tuple[Any, str]]:
    """The source as ``datasets.Dataset`` pieces, in order, each with one string column ``text`` and
    the unit its rows hold: ``line`` / ``paragraph`` (rows of a text file, to be split further) or
    ``record`` (one sample per row). Local files are converted under ``work``."""
    datasets = _quiet_datasets()
    if source.kind == "files":
        check_files(source)
        groups: list[tuple[str, list[str]]] = []
        for path, fmt in source.files:  # consecutive files of one format load together, in order
            if groups and groups[-1][0] == fmt:
                groups[-1][1].append(path)
            else:
                groups.append((fmt, [path]))
        return [_load_file_group(files, fmt, text_field, sample_unit, work) for fmt, files in groups]
    if source.kind == "saved":
        try:
            loaded = datasets.load_from_disk(source.location)
        except Exception as error:
            raise DataError(f"{source.location}: cannot load the saved dataset: {_first_line(error)}") from None
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DataError(f"{source.location}: no split {split!r} (splits: {', '.join(loaded)}); set data.split")
            loaded = loaded[split]
        return [(_text_column(loaded, text_field, source.location), "record")]
    if source.kind == "hub":
        try:
            loaded = datasets.load_dataset(source.hub_name, source.hub_config, split=split)
        except Exception as error:
            raise DataError(
                f"{source.location}: cannot load split {split!r} from the Hugging Face hub "
                f"(offline, or no such dataset?): {_first_line(error)}"
            ) from None
        return [(_text_column(loaded, text_field, source.location), "record")]
    raise DataError(f"{source.location}: a prepared copy cannot be prepared again")


def read_split(source: Source, split: str) -> str | None:
    """The split a saved or hub dataset is read from: ``split``, or None for a saved ``Dataset``
    (not a ``DatasetDict``: it has no splits, and ``data.split`` is not used)."""
    if source.kind == "saved" and not (Path(source.location) / "dataset_dict.json").is_file():
        return None
    return split


def _count_samples(dataset: Any, unit: str) -> int:
    return sum(len(batch_samples(batch["text"], unit)) for batch in dataset.iter(batch_size=COUNT_BATCH))


def _count_jsonl(path: str, text_field: str) -> int:
    count = 0
    with open(path, encoding="utf-8", newline="") as handle:
        for line in handle:
            if line.strip():
                record = parse_json(line)
                text = record.get(text_field) if isinstance(record, dict) else None
                count += len(record_samples(text, "record")) if isinstance(text, str) else 0
    return count


def samples_per_file(
    source: Source, text_field: str = "text", sample_unit: str = "line", split: str = "train"
) -> list[int] | None:
    """How many samples each of a source's files holds, in order; for a saved or hub dataset one
    count, of the whole split it is read from (:func:`read_split`). Each file is read as the
    preparation reads it (the same ``datasets`` builder and options, streaming; JSONL line by line)
    and its rows cut into samples by :func:`batch_samples`, a batch at a time: memory does not grow
    with the files. None for a prepared copy, or where the source cannot be read that way now."""
    if source.kind == "prepared":
        return None
    import tempfile

    try:
        with tempfile.TemporaryDirectory(prefix="parallel-latent-count-") as work:
            if source.kind in ("saved", "hub"):
                pieces = load_source_datasets(source, text_field, sample_unit, split, Path(work))
                return [sum(_count_samples(dataset, unit) for dataset, unit in pieces)]
            counts = []
            for path, fmt in source.files:
                if fmt == "jsonl":
                    counts.append(_count_jsonl(path, text_field))
                    continue
                dataset, unit = _load_file_group([path], fmt, text_field, sample_unit, Path(work), streaming=True)
                counts.append(_count_samples(dataset, unit))
            return counts
    except Exception:  # the readers raise many types; each means the source is not as it was prepared
        return None
