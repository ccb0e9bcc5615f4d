"""Preparing a corpus: every source format gives the rows the in-memory reader gives, the cache is
keyed on what produced a copy, a damaged or foreign copy is refused (never overwritten), bad input
is one line naming the path, and a rank's memory does not grow with the corpus."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from parallel_latent import cli
from parallel_latent.data import DataError, ShardedBatchSampler, build_datasets, get_batch, make_spec, prepare
from parallel_latent.data.prepare import LOG_NAME
from parallel_latent.data.prepared import PREPARED_MARKER, PreparedDataset
from parallel_latent.data.sources import read_samples
from parallel_latent.data.tokenize import tokenizer_identity
from parallel_latent.errors import ExitStatus
from tests.helpers.data import assert_same_rows, data_config, reference_rows, tokenizer
from tests.helpers.trainer_runs import REPO, TINY_CONFIG, rank_env

# Lines that exercise the reader's rules: stripping, blank lines, CRLF, the other str.splitlines
# boundaries, texts that CSV readers like to turn into NaN, quoting, a sample longer than T.
RAW_LINES = [
    "It is a truth universally acknowledged.",
    "  second line, indented  ",
    "",
    "third\u2028fourth",
    "fifth\x0csixth",
    "NA",
    "null",
    'a, "quoted" one',
    " ".join(["word"] * 20),
    "caf\u00e9 \u2014 na\u00efve",
]
SAMPLES = [s for line in RAW_LINES for s in (p.strip() for p in line.splitlines()) if s]


def prepared(cache: Path, **data):
    return prepare(make_spec(data_config(cache, **data), tokenizer()))


def preparations(cache: Path) -> list[dict]:
    log = cache / LOG_NAME
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


# --------------------------------------------------------------------------- #
# Every source format round-trips the samples of the text reader.
# --------------------------------------------------------------------------- #


def write_text(root: Path) -> tuple[Path, dict]:
    path = root / "corpus.txt"
    path.write_bytes("\r\n".join(RAW_LINES).encode() + b"\n")
    return path, {}


def write_jsonl(root: Path) -> tuple[Path, dict]:
    path = root / "corpus.jsonl"
    path.write_text("\n".join(json.dumps({"id": i, "body": s}) for i, s in enumerate(SAMPLES)) + "\n\n")
    return path, {"text_field": "body"}


def write_parquet(root: Path) -> tuple[Path, dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = root / "corpus.parquet"
    table = pa.table({"id": list(range(len(SAMPLES))), "text": SAMPLES})
    pq.write_table(table, path, row_group_size=3)  # several row groups
    return path, {}


def write_csv(root: Path) -> tuple[Path, dict]:
    path = root / "corpus.csv"
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "sentence"])
        writer.writerows([i, s] for i, s in enumerate(SAMPLES))
    return path, {"text_field": "sentence"}


def write_directory(root: Path) -> tuple[Path, dict]:
    """Every format in one tree, read in sorted path order; other files and empty ones left out."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    top = root / "tree"
    (top / "b").mkdir(parents=True)
    (top / "a.txt").write_text("\n".join(SAMPLES[:3]) + "\n")
    (top / "b" / "c.jsonl").write_text("\n".join(json.dumps({"text": s}) for s in SAMPLES[3:5]) + "\n")
    pq.write_table(pa.table({"text": SAMPLES[5:7]}), top / "b" / "d.parquet")
    with open(top / "e.csv", "w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([["text"]] + [[s] for s in SAMPLES[7:]])
    (top / "f.txt").write_text("")
    (top / "notes.md").write_text("not a sample\n")
    return top, {}


def write_saved(root: Path) -> tuple[Path, dict]:
    import datasets

    path = root / "saved"
    datasets.Dataset.from_dict({"text": SAMPLES, "n": list(range(len(SAMPLES)))}).save_to_disk(str(path))
    return path, {}


def write_saved_dict(root: Path) -> tuple[Path, dict]:
    import datasets

    path = root / "saved_dict"
    whole = datasets.Dataset.from_dict({"text": SAMPLES})
    datasets.DatasetDict({"train": whole.select([0]), "validation": whole}).save_to_disk(str(path))
    return path, {"split": "validation"}


WRITERS = [write_text, write_jsonl, write_parquet, write_csv, write_directory, write_saved, write_saved_dict]


@pytest.mark.parametrize("write", WRITERS, ids=lambda w: w.__name__.removeprefix("write_"))
def test_every_format_round_trips_the_text_readers_samples(write, tmp_path):
    path, options = write(tmp_path)
    assert read_samples(path, **options) == SAMPLES
    data, created = prepared(tmp_path / "cache", path=str(path), **options)
    assert created and len(data) == len(SAMPLES)
    assert_same_rows(data, reference_rows(SAMPLES))
    assert data.num_truncated == 1 and data.meta["dtype"] == "uint16"


def test_paragraphs_and_several_workers(tmp_path, monkeypatch):
    """Workers are spawned, never forked (a fork of a process whose other threads hold a lock can
    wait forever: ``os.fork`` raises here); their shards join in the corpus's order."""

    def no_fork():
        raise AssertionError("a tokenizing worker was forked")

    monkeypatch.setattr(os, "fork", no_fork)
    text = "one\ntwo\n\n\nthree\n  \nfour\nfive\n\n\n\n" + "\n\n".join(f"para {i}\nline" for i in range(300))
    path = tmp_path / "paragraphs.txt"
    path.write_text(text)
    expected = read_samples(path, sample_unit="paragraph")
    assert expected[:3] == ["one two", "three", "four five"] and len(expected) == 303
    data, _ = prepared(tmp_path / "cache", path=str(path), sample_unit="paragraph", num_workers=2)
    assert_same_rows(data, reference_rows(expected))


# --------------------------------------------------------------------------- #
# Bad input: one line naming the path; nothing published.
# --------------------------------------------------------------------------- #


def _parquet_bytes(tmp_path: Path, columns: dict) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    scratch = tmp_path / "scratch.parquet"
    pq.write_table(pa.table(columns), scratch)
    data = scratch.read_bytes()
    scratch.unlink()
    return data


BAD_INPUTS = [
    # (file name, content, data overrides, expected message after "<path>")
    ("empty.txt", b"", {}, ": file is empty"),
    ("blank.txt", b"\n   \n\n", {}, ": corpus is empty (no non-empty samples)"),
    ("binary.txt", b"\x89PNG\r\n\x1a\n\x00\x00", {}, ": binary data (NUL byte at offset 8), not UTF-8 text"),
    ("latin1.txt", b"fine\ncaf\xe9\n", {}, ": not UTF-8 text (bad byte at offset 8)"),
    ("latin1.jsonl", b'{"text": "caf\xe9"}\n', {}, ": not UTF-8 text (bad byte at offset 13)"),
    ("broken.jsonl", b'{"text": "a"}\n\n{"text": "b"\n', {}, ":3: invalid JSON: Expecting ',' delimiter"),
    ("nofield.jsonl", b'{"text": "a"}\n{"body": "b"}\n', {}, ":2: missing text field 'text'"),
    ("number.jsonl", b'{"text": "a"}\n{"text": 3}\n', {}, ":2: text field 'text' is int, not a string"),
    ("nocolumn.csv", b"id,body\n1,x\n", {}, ": no column 'text' (columns: id, body); set data.text_field"),
    ("broken.csv", b'text\n"never closed\n', {}, ": cannot read as csv: ParserError: Error tokenizing data."),
    ("fake.parquet", b"PAR1 but not really", {}, ": not a parquet file (no PAR1 magic bytes at both ends;"),
]


@pytest.mark.parametrize("name, content, overrides, expected", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_one_line_naming_the_path(tmp_path, name, content, overrides, expected):
    path = tmp_path / name
    path.write_bytes(content)
    cache = tmp_path / "cache"
    with pytest.raises(DataError) as caught:
        prepared(cache, path=str(path), **overrides)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{path}{expected}"), message
    assert not cache.exists() or [p.name for p in cache.iterdir() if not p.name.startswith(".lock-")] == []


def test_parquet_without_the_column_and_truncated_parquet(tmp_path):
    path = tmp_path / "other.parquet"
    path.write_bytes(_parquet_bytes(tmp_path, {"body": ["x"], "id": [1]}))
    with pytest.raises(DataError, match=re.escape(f"{path}: no column 'text' (columns: body, id)")):
        prepared(tmp_path / "cache", path=str(path))
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(_parquet_bytes(tmp_path, {"text": ["x"] * 50})[:-6])
    with pytest.raises(DataError, match=re.escape(f"{cut}: not a parquet file")):
        prepared(tmp_path / "cache", path=str(cut))
    numbers = tmp_path / "numbers.parquet"
    numbers.write_bytes(_parquet_bytes(tmp_path, {"text": [1, 2]}))
    with pytest.raises(DataError, match=re.escape(f"{numbers}: column 'text' holds int64 values, not text")):
        prepared(tmp_path / "cache", path=str(numbers))


def test_missing_path_split_and_unwritable_cache(tmp_path):
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'nope.txt'}: data path does not exist")):
        prepared(tmp_path / "cache", path=str(tmp_path / "nope.txt"))
    saved, _ = write_saved_dict(tmp_path)
    with pytest.raises(DataError, match=re.escape(f"{saved}: no split 'test' (splits: train, validation)")):
        prepared(tmp_path / "cache", path=str(saved), split="test")
    corpus, _ = write_text(tmp_path)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(DataError) as caught:
        prepared(blocker / "cache", path=str(corpus))
    assert str(caught.value) == (
        f"{blocker / 'cache'}: cannot create the data cache directory (Not a directory); "
        "set data.cache_dir or PARALLEL_LATENT_DATA_CACHE"
    )


# --------------------------------------------------------------------------- #
# The cache: keyed on what produced a copy; damaged and foreign copies refused.
# --------------------------------------------------------------------------- #


def test_the_fingerprint_follows_what_produced_the_copy(tmp_path):
    corpus, _ = write_text(tmp_path)
    cache = tmp_path / "cache"
    first, created = prepared(cache, path=str(corpus))
    assert created
    again, created = prepared(cache, path=str(corpus), eval_fraction=0.5, max_samples=3)  # not in the copy
    assert not created and again.path == first.path
    # Same size, new content (and modification time): a new preparation.
    time.sleep(0.01)
    corpus.write_bytes(corpus.read_bytes().replace(b"truth", b"TRUTH"))
    changed, created = prepared(cache, path=str(corpus))
    assert created and changed.path != first.path
    assert changed.token_ids(0) != first.token_ids(0)
    for setting in ({"max_length": 12}, {"sample_unit": "paragraph"}, {"format": "text", "text_field": "x"}):
        copy, created = prepared(cache, path=str(corpus), **setting)
        assert created and copy.fingerprint not in {first.fingerprint, changed.fingerprint}
    assert len(preparations(cache)) == 5


@pytest.fixture
def published(tmp_path):
    corpus, _ = write_text(tmp_path)
    data, _ = prepared(tmp_path / "cache", path=str(corpus))
    return corpus, data.path


def _refused(cache: Path, corpus: Path) -> str:
    with pytest.raises(DataError) as caught:
        prepared(cache, path=str(corpus))
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_a_damaged_copy_is_refused_and_left_alone(published):
    corpus, path = published
    ids = path / "input_ids.npy"
    damaged = ids.read_bytes()[:-2]
    ids.write_bytes(damaged)
    message = _refused(path.parent, corpus)
    assert message.startswith(f"{path}: prepared copy is damaged: input_ids.npy is ")
    assert "delete the directory to prepare again" in message
    assert ids.read_bytes() == damaged and len(preparations(path.parent)) == 1  # not overwritten


def test_a_copy_without_meta_or_of_another_kind_is_refused(published):
    corpus, path = published
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "format": "something-else"}))
    assert (
        _refused(path.parent, corpus) == f"{path}: not a parallel-latent prepared copy (meta.json has no format marker)"
    )
    (path / "meta.json").write_text(json.dumps({**meta, "version": 99}))
    assert _refused(path.parent, corpus).startswith(f"{path}: prepared copy has format version 99")
    (path / "meta.json").write_text("{not json")
    assert _refused(path.parent, corpus).startswith(f"{path}: prepared copy is damaged: meta.json is unreadable")
    (path / "meta.json").unlink()
    assert _refused(path.parent, corpus).startswith(f"{path}: not a prepared copy (no meta.json)")


def test_training_on_a_damaged_copy_is_one_line_and_writes_nothing(published, tmp_path, capsys):
    corpus, path = published
    (path / "lengths.npy").write_bytes(b"garbage")
    run_dir = tmp_path / "run"
    argv = ["train", "--config", str(TINY_CONFIG), "parallel.tensor_parallel=1", f"data.path={corpus}"]
    argv += ["model.max_length=8", f"data.cache_dir={path.parent}", f"logging.run_dir={run_dir}"]
    assert cli.main(argv) == ExitStatus.BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"parallel-latent: error: {path}: prepared copy is damaged: lengths.npy")
    assert not run_dir.exists()


def test_a_prepared_copy_can_be_named_as_the_data_path(published, tmp_path):
    _, path = published
    train, held_out = build_datasets(data_config(tmp_path / "elsewhere", path=str(path)), tokenizer())
    assert len(train) + len(held_out) == len(SAMPLES) and train.data.path == path
    assert not (tmp_path / "elsewhere").exists()  # nothing to prepare
    with pytest.raises(
        DataError, match=re.escape(f"{path}: prepared copy has rows of 8 tokens but model.max_length=9")
    ):
        build_datasets(data_config(tmp_path, path=str(path), max_length=9), tokenizer())


def fake_copy(path: Path, num_samples: int, max_length: int = 16) -> Path:
    """A prepared copy of ``num_samples`` empty rows, written sparse (instantly, whatever its size)."""
    tok = tokenizer()
    path.mkdir()
    for name, dtype, shape in (
        ("input_ids", np.uint16, (num_samples, max_length)),
        ("lengths", np.uint16, (num_samples,)),
        ("truncated", np.bool_, (num_samples,)),
    ):
        array = np.lib.format.open_memmap(path / f"{name}.npy", mode="w+", dtype=dtype, shape=shape)
        del array  # unmapped: the file stays sparse
    meta = {
        "format": PREPARED_MARKER,
        "version": 1,
        "fingerprint": "fake",
        "record": {"tokenizer": tokenizer_identity(tok)},
        "num_samples": num_samples,
        "max_length": max_length,
        "dtype": "uint16",
        "length_dtype": "uint16",
        "vocab_size": len(tok),
        "pad_token_id": tok.pad_token_id,
        "content_sha256": "none",
    }
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def _start_training_on(path: Path, cache: Path) -> None:
    """What a rank does with its data before and during training: open, split, sample, batch."""
    train, held_out = build_datasets(data_config(cache, path=str(path), max_length=16), tokenizer())
    sampler = ShardedBatchSampler(len(train), 16, dp_rank=1, dp_size=2, seed=3)
    for _ in range(20):
        get_batch(train, sampler.next_batch())
    get_batch(held_out, list(range(16)))
    list(held_out.texts[:3])
    sampler.state_dict()


def _peak_python_bytes(function, *args) -> int:
    tracemalloc.start()
    try:
        function(*args)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_ranks_memory_does_not_grow_with_the_corpus(tmp_path):
    small = fake_copy(tmp_path / "small", 1_000)
    large = fake_copy(tmp_path / "large", 20_000_000)
    _start_training_on(small, tmp_path)  # warm caches (imports, the tokenizer)
    peaks = [_peak_python_bytes(_start_training_on, path, tmp_path) for path in (small, large, small)]
    # Allocations of the 20M-sample run stay those of the 1,000-sample run: no index list, no
    # permutation, no per-sample object (one of them would be >= 20M bytes).
    assert peaks[1] <= max(peaks[0], peaks[2]) + 256 * 1024, peaks


def test_token_ids_outside_the_vocabulary_are_a_data_error(tmp_path):
    path = fake_copy(tmp_path / "copy", 10)
    ids = np.load(path / "input_ids.npy", mmap_mode="r+")
    lengths = np.load(path / "lengths.npy", mmap_mode="r+")
    ids[7, 0], lengths[7] = 60_000, 1
    ids.flush()
    lengths.flush()
    data = PreparedDataset(path)
    assert get_batch(data, [1, 2])["attention_mask"].sum() == 0
    with pytest.raises(DataError, match=re.escape(f"{path}: sample 7 holds token id 60000, outside the vocabulary")):
        get_batch(data, [1, 7])


# --------------------------------------------------------------------------- #
# Real processes: `parallel-latent prepare`.
# --------------------------------------------------------------------------- #


def prepare_command(corpus: Path, cache: Path, *overrides: str) -> list[str]:
    base = [sys.executable, "-m", "parallel_latent", "prepare", "--config", str(TINY_CONFIG)]
    return base + [f"data.path={corpus}", f"data.cache_dir={cache}", *overrides]


def run_prepare(corpus: Path, cache: Path, *overrides: str, env: dict | None = None):
    return subprocess.run(
        prepare_command(corpus, cache, *overrides),
        cwd=REPO,
        env=rank_env(env),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def fingerprint_of(stdout: str) -> str:
    match = re.search(r"fingerprint ([0-9a-f]{20})", stdout)
    assert match, stdout
    return match.group(1)


def test_prepare_command_and_what_triggers_a_new_preparation(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"Line {i} of a corpus." for i in range(40)) + "\n")
    cache = tmp_path / "cache"
    # In this process (no Python of its own to start): `prepare` in a process of its own runs in
    # test_a_killed_preparer_leaves_nothing_a_later_run_accepts and test_an_unreachable_hub_is_one_line.
    assert cli.main(prepare_command(corpus, cache)[3:]) == 0
    first = capsys.readouterr().out
    fingerprint = fingerprint_of(first)
    line = first.splitlines()[0]
    assert re.fullmatch(
        rf"prepared in [0-9.]+ s: {re.escape(str(cache))}/corpus-{fingerprint}: 40 samples of 16 tokens, "
        rf"0 truncated, fingerprint {fingerprint}",
        line,
    ), line
    assert "training would use 24 samples and hold out 16" in first
    assert cli.main(prepare_command(corpus, cache)[3:]) == 0
    assert capsys.readouterr().out.startswith(f"up to date: {cache}/corpus-{fingerprint}: 40 samples")

    with open(corpus, "a") as handle:
        handle.write("One more line.\n")
    status = cli.main(prepare_command(corpus, cache)[3:])
    changed = capsys.readouterr()
    assert status == 0 and changed.out.startswith("prepared in"), changed.err
    assert fingerprint_of(changed.out) != fingerprint and "41 samples" in changed.out

    status = cli.main(prepare_command(corpus, cache, "model.max_length=4")[3:])
    shorter = capsys.readouterr()
    assert status == 0 and shorter.out.startswith("prepared in"), shorter.err
    assert fingerprint_of(shorter.out) not in (fingerprint, fingerprint_of(changed.out))
    assert "40 truncated" in shorter.out  # "One more line." is exactly 4 tokens
    assert len(preparations(cache)) == 3


@pytest.mark.slow
def test_a_killed_preparer_leaves_nothing_a_later_run_accepts(tmp_path, capsys):
    bundled = (REPO / "parallel_latent" / "corpus" / "austen_pride_and_prejudice.txt").read_text()
    corpus = tmp_path / "big.txt"
    corpus.write_text(bundled * 4)  # ~19,500 lines: seconds of tokenising, killed before they start
    cache = tmp_path / "cache"
    job = subprocess.Popen(
        prepare_command(corpus, cache), cwd=REPO, env=rank_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 240
        while not list(cache.glob(".tmp-*/work")) and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert job.poll() is None, "prepare ended before it could be killed"
        os.kill(job.pid, signal.SIGKILL)
    finally:
        job.kill()
        job.communicate(timeout=60)
    assert job.returncode == -signal.SIGKILL
    leftovers = list(cache.glob(".tmp-*"))
    assert len(leftovers) == 1
    assert [p for p in cache.iterdir() if not p.name.startswith(".")] == []  # nothing published, no log

    # The later run in this process (no Python of its own to start): the killed one had its own.
    status = cli.main(prepare_command(corpus, cache)[3:])
    later = capsys.readouterr()
    assert status == 0, later.err
    assert later.out.startswith("prepared in")  # it did not take the partial copy
    assert not list(cache.glob(".tmp-*"))  # and removed it
    assert len(preparations(cache)) == 1
    data = PreparedDataset(cache / f"big-{fingerprint_of(later.out)}")
    assert len(data) == 4 * len(read_samples(""))


def test_an_unreachable_hub_is_one_line(tmp_path):
    result = run_prepare("hf:ag_news", tmp_path / "cache", env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(
        "parallel-latent: error: hf:ag_news: cannot load split 'train' from the Hugging Face hub (offline, or no "
        "such dataset?): "
    )
