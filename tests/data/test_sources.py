"""Counting a source's samples per file (parallel_latent/data/sources.py, ``samples_per_file``):
the counts are the preparation's, so that row first_row + k of the prepared copy, first_row being
the samples of the files before, is the k-th sample of a file as the in-memory reader reads it."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from parallel_latent.data import make_spec, prepare
from parallel_latent.data.sources import read_samples, resolve_source, samples_per_file
from tests.helpers.data import assert_same_rows, data_config, reference_rows, tokenizer

# What the readers' rules are about: blank and whitespace-only lines between paragraphs, CRLF and a
# lone CR, the other str.splitlines boundaries; empty, missing and multi-line texts in records.
TEXT = b"one\ntwo\n\n\nthree\n  \nfour\r\nfive\r\n\r\nsix\xe2\x80\xa8\xe2\x80\xa8seven\rx\r\ry\n\n\n"
RECORD_TEXTS = ["a", None, "  ", "b\n\nc", "", " d ", "NA", "null"]


def write_files(root: Path) -> tuple[Path, dict]:
    """A directory of every file format, read in sorted path order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    top = root / "tree"
    top.mkdir()
    (top / "a.txt").write_bytes(TEXT)
    pq.write_table(pa.table({"id": range(8), "text": RECORD_TEXTS}), top / "b.parquet", row_group_size=3)
    with open(top / "c.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "text"])
        writer.writerows([i, text] for i, text in enumerate(RECORD_TEXTS))
        handle.write("\n")  # a blank line, which the CSV reader skips
        writer.writerow([9, "after the blank line"])
    records = [{"text": text} for text in RECORD_TEXTS if text is not None]  # (null is an error in JSONL)
    (top / "d.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    (top / "e.txt").write_bytes(TEXT.replace(b"\n", b"\r\n"))
    return top, {}


def write_saved(root: Path) -> tuple[Path, dict]:
    import datasets

    path = root / "saved"
    datasets.Dataset.from_dict({"n": range(8), "body": RECORD_TEXTS}).save_to_disk(str(path))
    return path, {"text_field": "body"}


def write_saved_dict(root: Path) -> tuple[Path, dict]:
    import datasets

    path = root / "saved_dict"
    whole = datasets.Dataset.from_dict({"text": RECORD_TEXTS})
    datasets.DatasetDict({"train": whole.select([0]), "validation": whole}).save_to_disk(str(path))
    return path, {"split": "validation"}


def hub(monkeypatch) -> tuple[str, dict]:
    """A hub dataset without the hub: ``datasets.load_dataset`` answers for it."""
    import datasets

    def load_dataset(name, config=None, split=None, **options):
        assert (name, config, split) == ("someone/corpus", "clean", "test"), (name, config, split)
        return datasets.Dataset.from_dict({"text": RECORD_TEXTS})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return "hf:someone/corpus:clean", {"split": "test"}


SOURCES = [
    ("files-by-line", write_files, {"sample_unit": "line"}),
    ("files-by-paragraph", write_files, {"sample_unit": "paragraph"}),
    ("saved", write_saved, {}),
    ("saved-dict", write_saved_dict, {}),
    ("hub", None, {}),
]


@pytest.mark.parametrize("write, unit", [s[1:] for s in SOURCES], ids=[s[0] for s in SOURCES])
def test_each_row_of_the_prepared_copy_is_its_files_kth_sample(write, unit, tmp_path, monkeypatch):
    path, options = hub(monkeypatch) if write is None else write(tmp_path)
    options = {**options, **unit}
    source = resolve_source(str(path))
    counts = samples_per_file(source, **options)
    if source.kind == "files":
        per_file = [read_samples(file, format=fmt, **options) for file, fmt in source.files]
    else:
        per_file = [read_samples(path, **options)]  # a saved or hub dataset: one part, all of it
    assert counts == [len(samples) for samples in per_file] and min(counts) > 0
    data, _ = prepare(make_spec(data_config(tmp_path / "cache", path=str(path), **options), tokenizer()))
    assert sum(counts) == len(data)
    located, first_row = [], 0
    for samples, count in zip(per_file, counts, strict=True):
        located += [samples[row - first_row] for row in range(first_row, first_row + count)]
        first_row += count
    assert_same_rows(data, reference_rows(located))


def test_a_source_that_cannot_be_read_as_prepared_has_no_counts(tmp_path):
    path, _ = write_files(tmp_path)
    source = resolve_source(str(path))
    assert samples_per_file(source) is not None
    (path / "c.csv").write_text("id,body\n1,x\n")  # the text column is gone
    assert samples_per_file(source) is None
    (path / "c.csv").unlink()
    assert samples_per_file(source) is None
    saved, _ = write_saved_dict(tmp_path)
    assert samples_per_file(resolve_source(str(saved)), split="no-such-split") is None


@pytest.mark.parametrize("unit", ["line", "paragraph"])
def test_text_counts_do_not_depend_on_the_chunks_the_file_is_streamed_in(unit, tmp_path, monkeypatch):
    """Counting streams a text file in chunks of STREAM_CHUNK_BYTES; a chunk boundary inside a CRLF,
    between the two newlines of a paragraph break or inside a UTF-8 character changes nothing."""
    from parallel_latent.data import sources

    path = tmp_path / "a.txt"
    path.write_bytes(TEXT + TEXT.replace(b"\n", b"\r\n"))
    expected = [len(read_samples(path, format="text", sample_unit=unit))]
    for chunk in (1, 2, 3, 5, 8, 13):
        monkeypatch.setattr(sources, "STREAM_CHUNK_BYTES", chunk)
        assert samples_per_file(resolve_source(str(path)), sample_unit=unit) == expected, chunk
