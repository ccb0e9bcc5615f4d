"""``parallel-latent encode-corpus`` and the latent datasets it writes (parallel_latent/latents/).

In one process: the latents equal ``TextAutoencoder.encode`` of the same texts bit for bit (fp32 and
bf16, same batch size), ``datasets.load_from_disk`` and ``open_latents`` read them back, the index's
checksums and statistics are those of the shards, a rerun of a complete export does nothing, and
bad input ends with one line each. On real processes (``--nproc 2``, gloo): DP=2 writes the very
bytes DP=1 writes; TP=2 equals TP=1 within the derived bound; an export killed with kill -9 inside a
half-written shard, rerun at another --nproc, ends byte-identical to an uninterrupted one, and
while it is stopped a second export and an export of another precision are refused.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import xxhash

from parallel_latent.api import TextAutoencoder
from parallel_latent.checkpoint import save_portable
from parallel_latent.cli import main
from parallel_latent.config import Config, FeatureModelConfig, ModelConfig
from parallel_latent.data import read_samples, tokenize_samples
from parallel_latent.data.prepared import PreparedDataset
from parallel_latent.feature_model.tokenizer import apply_tokenizer_facts, load_tokenizer, tokenizer_facts
from parallel_latent.latents import (
    INDEX_FILE,
    PAUSE_IN_SHARD_ENV,
    PAUSE_MARKER,
    WORK_DIR,
    ExportError,
    open_latents,
    plan_export,
)
from parallel_latent.latents.export import _rows_of_files
from parallel_latent.model import build_model
from tests.helpers.filesystems import directory_bytes, tmpfs
from tests.helpers.in_process_cli import run_main
from tests.helpers.tp_compare import order_bound, terms_scale
from tests.helpers.trainer_runs import REPO, describe, interrupt, rank_env, rank_pids

LINES = 70  # 5 shards of 16 (the last one of 6), batches of 8 (the last one of 6)
SETTINGS = ["export.batch_size=8", "export.shard_size=16", "logging.progress_bar=false"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny trained-for-a-few-steps checkpoint, a corpus of 70 lines, a shared data cache."""
    root = tmp_path_factory.mktemp("latents")
    tokenizer = load_tokenizer(Config().tokenizer)
    cfg = Config(
        model=ModelConfig(d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, max_length=12, dropout=0.0),
        feature_model=FeatureModelConfig(n_layer=3, n_head=2, n_embd=32),
    )
    cfg = apply_tokenizer_facts(cfg, tokenizer_facts(tokenizer))
    model = build_model(cfg)
    texts = read_samples("")[:LINES]
    batch = tokenize_samples(texts[:8], tokenizer, cfg.model.max_length, cfg.model.pad_token_id)
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=3e-3)
    for _ in range(3):  # so that the latents are not those of an initialisation
        model(batch.input_ids, batch.attention_mask).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    checkpoint = root / "ckpt"
    save_portable(model, checkpoint, cfg, tokenizer_facts(tokenizer), step=3)
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(texts) + "\n", encoding="utf-8")
    return {"root": root, "checkpoint": checkpoint, "corpus": corpus, "texts": texts, "cache": root / "cache"}


def command(setup, out: Path, *extra: str) -> list[str]:
    return [
        "encode-corpus",
        "--checkpoint",
        str(setup["checkpoint"]),
        "--data",
        str(setup["corpus"]),
        "--out",
        str(out),
        *SETTINGS,
        f"data.cache_dir={setup['cache']}",
        *extra,
    ]


def cli(args: list[str], env: dict | None = None):
    """``parallel-latent ARGS`` as a shell runs it, but in this process (tests/helpers/in_process_cli.py):
    one process exports here, ``--nproc 2`` launches its two real ranks under torchrun from here."""
    return run_main(args, env)


def largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def reference_latents(setup, precision: str = "fp32") -> torch.Tensor:
    """``TextAutoencoder.encode`` of the corpus's texts, in the export's batches of 8."""
    autoencoder = TextAutoencoder.from_checkpoint(setup["checkpoint"])
    if precision == "bf16":
        autoencoder.model.to(torch.bfloat16)
    texts = setup["texts"]
    return torch.cat([autoencoder.encode(texts[i : i + 8]).latents for i in range(0, len(texts), 8)])


@pytest.fixture(scope="module")
def one_process(setup):
    """The reference export: one process, fp32."""
    out = setup["root"] / "one-process"
    assert main(command(setup, out)) == 0
    return out


# --------------------------------------------------------------------------- #
# One process.
# --------------------------------------------------------------------------- #


def test_latents_equal_encode_bit_for_bit_and_read_back_both_ways(setup, one_process):
    import datasets

    assert sorted(p.name for p in one_process.iterdir()) == [
        *(f"data-{i:05d}-of-00005.arrow" for i in range(5)),
        "dataset_info.json",
        INDEX_FILE,
        "state.json",
    ]
    latents = open_latents(one_process)
    assert len(latents) == LINES
    everything = latents[:]
    assert torch.equal(everything["latents"], reference_latents(setup))
    reference = TextAutoencoder.from_checkpoint(setup["checkpoint"]).encode(setup["texts"])
    assert torch.equal(everything["attention_mask"], reference.attention_mask)
    assert torch.equal(everything["num_tokens"], reference.attention_mask.sum(1))
    assert torch.equal(everything["index"], torch.arange(LINES))
    # One sample, a reversed gather across shards, and datasets' own memory-mapped reader.
    assert torch.equal(latents[37]["latents"], everything["latents"][37])
    picked = [69, 3, 40, 17]
    assert torch.equal(latents[picked]["latents"], everything["latents"][picked])
    assert latents[[]]["latents"].shape == (0, 12, 32) and latents[torch.tensor([5, 6])]["index"].tolist() == [5, 6]
    loaded = datasets.load_from_disk(str(one_process)).with_format("torch")
    assert len(loaded) == LINES and loaded.cache_files  # memory-mapped Arrow files, not a copy in memory
    assert torch.equal(loaded[:]["latents"], everything["latents"])
    assert torch.equal(loaded[:]["index"], everything["index"])


def test_index_records_checksums_ranges_and_statistics(setup, one_process):
    index = json.loads((one_process / INDEX_FILE).read_text())
    assert [(s["first"], s["count"]) for s in index["shards"]] == [(0, 16), (16, 16), (32, 16), (48, 16), (64, 6)]
    for shard in index["shards"]:
        data = (one_process / shard["file"]).read_bytes()
        assert xxhash.xxh3_128(data).hexdigest() == shard["xxh3_128"] and len(data) == shard["bytes"]
    assert index["latents"] == {"shape": [12, 32], "dtype": "float32", "stored_as": "float32"}
    assert index["identity"]["batch_size"] == 8 and index["model"]["step"] == 3
    everything = open_latents(one_process)[:]
    vectors = everything["latents"][everything["attention_mask"].bool()].double()
    mean, std = vectors.mean(0), vectors.std(0, correction=0)
    # Both float64, summed in other orders over n vectors: (n u64) x the sum of |terms|.
    n = vectors.shape[0]
    bound = 4 * n * torch.finfo(torch.float64).eps * vectors.abs().max().item()
    assert index["statistics"]["count"] == n
    assert largest_difference(torch.tensor(index["statistics"]["mean"], dtype=torch.float64), mean) <= bound
    assert largest_difference(torch.tensor(index["statistics"]["std"], dtype=torch.float64), std) <= 10 * bound
    assert index["num_tokens"] == int(everything["num_tokens"].sum())
    corpus = str(setup["corpus"].resolve())
    assert index["corpus"]["files"] == [{"file": corpus, "format": "text", "first_row": 0, "rows": LINES}]


def test_a_version_1_export_still_opens(one_process, tmp_path):
    """Version 1 differs only in its checksums (SHA-256): its shards read as they did."""
    old = tmp_path / "v1"
    shutil.copytree(one_process, old)
    index = json.loads((old / INDEX_FILE).read_text())
    index["version"] = 1
    for shard in index["shards"]:
        del shard["xxh3_128"]
        shard["sha256"] = hashlib.sha256((old / shard["file"]).read_bytes()).hexdigest()
    (old / INDEX_FILE).write_text(json.dumps(index))
    assert torch.equal(open_latents(old)[:]["latents"], open_latents(one_process)[:]["latents"])
    index["version"] = 3
    (old / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ExportError, match="version 1 or 2"):
        open_latents(old)


def test_index_says_which_file_each_row_comes_from(setup, tmp_path):
    """A directory of two files (blank lines and a JSONL record without text among them): each
    file's first row and its count, so row first_row + k is that file's k-th sample."""
    texts = setup["texts"]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in [*texts[:5], "  ", texts[5]]))
    (corpus / "b.txt").write_text("\n\n".join(texts[6:20]) + "\n")
    args = command(setup, tmp_path / "out")
    args[args.index("--data") + 1] = str(corpus)
    assert main(args) == 0
    files = json.loads((tmp_path / "out" / INDEX_FILE).read_text())["corpus"]["files"]
    assert [(Path(f["file"]).name, f["format"], f["first_row"], f["rows"]) for f in files] == [
        ("a.jsonl", "jsonl", 0, 6),
        ("b.txt", "text", 6, 14),
    ]


def test_each_row_is_its_files_kth_sample_for_paragraphs_parquet_and_csv_until_a_file_changes(setup, tmp_path):
    """Every row of the export: the map's (file, k) is the file's k-th sample as the in-memory reader
    reads it, and its tokens are the prepared copy's row. A file edited after the preparation makes
    the counts disagree with the copy: the map is null."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = setup["texts"]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(
        "\n\n \n".join(f"{a}\n  {b}" for a, b in zip(texts[:8:2], texts[1:8:2], strict=True)) + "\n\n"
    )
    pq.write_table(pa.table({"text": [texts[8], None, " ", *texts[9:13]]}), corpus / "b.parquet", row_group_size=3)
    with open(corpus / "c.csv", "w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([["text", "id"], [texts[13], 0], ["", 1], [f"{texts[14]}\n{texts[15]}", 2]])
    args = command(setup, tmp_path / "out", "data.sample_unit=paragraph")
    args[args.index("--data") + 1] = str(corpus)
    assert main(args) == 0
    index = json.loads((tmp_path / "out" / INDEX_FILE).read_text())
    files = index["corpus"]["files"]
    assert [(Path(f["file"]).name, f["format"]) for f in files] == [
        ("a.txt", "text"),
        ("b.parquet", "parquet"),
        ("c.csv", "csv"),
    ]
    samples = [read_samples(f["file"], format=f["format"], sample_unit="paragraph") for f in files]
    assert [f["rows"] for f in files] == [len(s) for s in samples]
    copy = PreparedDataset(next(setup["cache"].glob(f"[!.]*-{index['corpus']['prepared_fingerprint']}")))
    tokenizer = load_tokenizer(Config().tokenizer)
    rows = open_latents(tmp_path / "out")[:]["index"].tolist()
    assert sorted(rows) == list(range(len(copy))) == list(range(sum(f["rows"] for f in files)))
    for row in rows:
        (part,) = [i for i, f in enumerate(files) if f["first_row"] <= row < f["first_row"] + f["rows"]]
        sample = samples[part][row - files[part]["first_row"]]
        expected = tokenize_samples([sample], tokenizer, copy.max_length, copy.pad_token_id).input_ids[0]
        assert torch.equal(torch.from_numpy(copy.input_ids[row].astype("int64")), expected), (row, sample)
    plan = plan_export(setup["checkpoint"], corpus, ["data.sample_unit=paragraph"])
    assert _rows_of_files(plan, len(copy)) == files
    with open(corpus / "c.csv", "a", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerow(["a sample added since the preparation", 3])
    assert _rows_of_files(plan, len(copy)) is None


def test_a_saved_or_hub_dataset_is_one_entry_of_every_row(setup, tmp_path, monkeypatch):
    import datasets

    texts = [*setup["texts"][:6], "  ", None]
    whole = datasets.Dataset.from_dict({"text": texts})
    whole.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": whole.select([0]), "test": whole}).save_to_disk(str(tmp_path / "saved-dict"))
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config=None, split=None, **_: whole)
    for path, kind, split in [
        (tmp_path / "saved", "saved", None),  # a Dataset: no splits
        (tmp_path / "saved-dict", "saved", "test"),
        ("hf:someone/corpus", "hub", "test"),
    ]:
        plan = plan_export(setup["checkpoint"], path, ["data.split=test"])
        rows = len(read_samples(path, split="test"))
        entry = {"file": str(path), "format": kind, "split": split, "first_row": 0, "rows": rows}
        assert _rows_of_files(plan, rows) == [entry], path
        assert _rows_of_files(plan, rows + 1) is None


def test_a_rerun_of_a_complete_export_changes_nothing(setup, one_process, capsys):
    before = directory_bytes(one_process)
    assert main(command(setup, one_process)) == 0
    assert directory_bytes(one_process) == before


def test_bf16_export_equals_bf16_encode_bit_for_bit(setup, tmp_path):
    out = tmp_path / "bf16"
    assert main(command(setup, out, "export.precision=bf16")) == 0
    latents = open_latents(out)[:]["latents"]
    assert latents.dtype == torch.bfloat16
    assert torch.equal(latents.view(torch.int16), reference_latents(setup, "bf16").view(torch.int16))
    assert json.loads((out / INDEX_FILE).read_text())["latents"]["stored_as"].startswith("uint16")


def test_a_compressed_model_exports_its_own_latent_shape(setup, tmp_path):
    """Fewer, narrower latents (model.num_latents, model.latent_dim) with the head made for them: the
    export is the model's own encode, [N, k] per sample, bit for bit."""
    tokenizer = load_tokenizer(Config().tokenizer)
    model_cfg = ModelConfig(
        d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, max_length=12, dropout=0.0,
        num_latents=6, latent_dim=8, predict_length=True, head="nearest", latent_noise=0.5,
    )  # fmt: skip
    features = FeatureModelConfig(n_layer=3, n_head=2, n_embd=32)
    cfg = apply_tokenizer_facts(Config(model=model_cfg, feature_model=features), tokenizer_facts(tokenizer))
    save_portable(build_model(cfg), tmp_path / "ckpt", cfg, tokenizer_facts(tokenizer), step=0)
    out = tmp_path / "compressed"
    assert main([*command(setup, out)[:2], str(tmp_path / "ckpt"), *command(setup, out)[3:]]) == 0
    exported = open_latents(out)[:]["latents"]
    assert exported.shape == (LINES, 6, 8)
    autoencoder = TextAutoencoder.from_checkpoint(tmp_path / "ckpt")
    texts = setup["texts"]
    want = torch.cat([autoencoder.encode(texts[i : i + 8]).latents for i in range(0, len(texts), 8)])
    assert torch.equal(exported, want)
    assert json.loads((out / INDEX_FILE).read_text())["latents"]["shape"] == [6, 8]


def one_line_error(capsys, args: list[str], status: int = 2) -> str:
    assert main(args) == status
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_bad_input_is_one_line_each(setup, one_process, tmp_path, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert one_line_error(capsys, command(setup, a_file)).endswith(f"{a_file}: --out is a file, expected a directory")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert "not empty and not an export (holds notes.txt)" in one_line_error(capsys, command(setup, foreign))
    # The complete export of another precision / batch size: refused, untouched.
    before = directory_bytes(one_process)
    line = one_line_error(capsys, command(setup, one_process, "export.precision=bf16"))
    assert f"{one_process}: holds an export of another export.precision (precision: fp32 there, bf16 now)" in line
    line = one_line_error(capsys, command(setup, one_process, "export.batch_size=4"))
    assert "another export.batch_size" in line
    assert directory_bytes(one_process) == before
    # Another corpus into the same directory.
    other = tmp_path / "other.txt"
    other.write_text("\n".join(setup["texts"][:30]) + "\n")
    args = command(setup, one_process)
    args[args.index("--data") + 1] = str(other)
    assert "holds an export of another corpus" in one_line_error(capsys, args)
    # A checkpoint that is not an autoencoder: a manifest without a model.
    not_autoencoder = tmp_path / "not-autoencoder"
    shutil.copytree(setup["checkpoint"], not_autoencoder)
    manifest = json.loads((setup["checkpoint"] / "manifest.json").read_text())
    manifest.pop("model_config")
    (not_autoencoder / "manifest.json").write_text(json.dumps(manifest))
    args = command(setup, tmp_path / "out-a")
    args[args.index("--checkpoint") + 1] = str(not_autoencoder)
    assert "not an autoencoder checkpoint" in one_line_error(capsys, args)
    # An empty corpus (blank lines only).
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    args = command(setup, tmp_path / "out-b")
    args[args.index("--data") + 1] = str(empty)
    assert "corpus is empty" in one_line_error(capsys, args)
    # Settings: a key an export does not read, a shard that is not whole batches, TP without processes.
    assert "an export takes export.*" in one_line_error(capsys, command(setup, tmp_path / "c", "model.d_model=8"))
    line = one_line_error(capsys, command(setup, tmp_path / "d", "export.shard_size=12"))
    assert "export.shard_size=12 is not a multiple of export.batch_size=8" in line
    line = one_line_error(capsys, command(setup, tmp_path / "e", "parallel.tensor_parallel=2", "--nproc", "3"))
    assert "world size 3 is not divisible by parallel.tensor_parallel=2" in line
    assert not any((tmp_path / name).exists() for name in ("out-a", "out-b", "c", "d", "e"))


def test_a_full_disk_ends_with_one_line_and_exit_4_and_the_rerun_completes(setup, one_process, tmp_path):
    """A real limit on what the process may write (RLIMIT_FSIZE: writes past it fail with EFBIG,
    as on a full disk), set so that the second shard cannot be written."""
    out = tmp_path / "limited"
    shard_bytes = (one_process / "data-00000-of-00005.arrow").stat().st_size
    limit = shard_bytes + shard_bytes // 2

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    # The corpus is prepared already (the module's first export): the limit meets the shards.
    result = subprocess.run(
        [sys.executable, "-m", "parallel_latent", *command(setup, out, "export.shard_size=64")],
        cwd=REPO,
        env=rank_env(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limited,
        check=False,
    )
    assert result.returncode == 4, describe(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(f"{out}: shard not written: File too large"), lines
    # Nothing a reader would take for a shard, and no index.
    assert not any(p.name.endswith(".arrow") for p in out.iterdir())
    assert not (out / INDEX_FILE).exists()
    rerun = cli(command(setup, out, "export.shard_size=64"))
    assert rerun.returncode == 0, describe(rerun)
    reference = tmp_path / "unlimited"
    assert main(command(setup, reference, "export.shard_size=64")) == 0
    assert directory_bytes(out) == directory_bytes(reference)


# --------------------------------------------------------------------------- #
# Real processes (--nproc 2 under torchrun, gloo).
# --------------------------------------------------------------------------- #


@pytest.fixture
def small_disk(tmp_path):
    """A real file system of 64 KiB (tmpfs: about two of the module's 26 KB shards): writes past it
    fail with ENOSPC. Skipped, saying so, where mounting is refused; the RLIMIT_FSIZE test above
    covers the same path without privileges."""
    with tmpfs(tmp_path / "disk", "64k") as disk:
        yield disk


@pytest.mark.slow
def test_a_real_full_disk_under_nproc_2_ends_with_one_line_and_exit_4_and_the_rerun_completes(
    setup, one_process, small_disk, tmp_path
):
    """Both ranks write shards onto a disk that fills up: the job ends with one line and exit 4,
    nothing a reader would take for a shard is left, and once there is room the same command
    finishes with the bytes of an export that never failed."""
    out = small_disk / "out"
    result = cli([*command(setup, out), "--nproc", "2"])
    assert result.returncode == 4, describe(result)
    lines = [line for line in result.stderr.strip().splitlines() if line.startswith("parallel-latent: error:")]
    assert len(lines) == 1 and "No space left on device" in lines[0], result.stderr
    assert not (out / INDEX_FILE).exists()
    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)
    rerun = cli([*command(setup, out), "--nproc", "2"])
    assert rerun.returncode == 0, describe(rerun)
    assert directory_bytes(out) == directory_bytes(one_process)


@pytest.mark.slow
def test_a_rank_whose_writer_fails_ends_every_rank_with_its_line(setup, tmp_path):
    """Rank 1's shard writer raises (not a full disk: any error): rank 0, done with its own shards,
    does not wait for an index that cannot come; the job ends at once with rank 1's line."""
    out = tmp_path / "failed"
    faults = {"PYTHONPATH": str(REPO / "tests" / "helpers" / "worker_faults"), "PL_FAULT_RANK": "1"}
    started = time.monotonic()
    result = cli([*command(setup, out), "--nproc", "2"], env={**faults, "PL_FAULT": "export", "PL_FAULT_STEP": "1"})
    assert result.returncode == 1, describe(result)
    assert (
        result.stderr.strip().splitlines()[-1]
        == "parallel-latent: error: rank 1: RuntimeError: injected fault in shard 1"
    )
    # Not ended by the hang watchdog (its allowance is 600 s): a bound that only catches that.
    assert time.monotonic() - started < 400
    assert not (out / INDEX_FILE).exists()


@pytest.mark.slow
def test_a_rank_that_stops_moving_ends_the_export_within_the_hang_timeout(setup, tmp_path):
    """Rank 1's main thread stops for good as it begins its second shard (shard 3), after its first:
    the hang watchdog, which covers encode-corpus as it covers training, ends the job with one line
    naming rank 1 and the shard, within the timeout of the export's short allowance (not the long
    one of a first batch), and status 5."""
    out = tmp_path / "stalled"
    faults = {"PYTHONPATH": str(REPO / "tests" / "helpers" / "worker_faults"), "PL_FAULT_RANK": "1"}
    env = {**faults, "PL_FAULT": "export-hang", "PL_FAULT_STEP": "3"}
    timeouts = ["training.hang_timeout_s=10", "training.hang_long_phase_s=600"]
    started = time.monotonic()
    result = cli([*command(setup, out, *timeouts), "--nproc", "2"], env=env)
    assert result.returncode == 5, describe(result)
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("parallel-latent: error: rank 1 (host ") and "stalled at step 3 in encoding" in line, line
    assert time.monotonic() - started < 450  # not the long allowance (600 s): only that fails here
    assert not (out / INDEX_FILE).exists()


@pytest.mark.slow
def test_dp2_writes_the_bytes_dp1_writes(setup, one_process, tmp_path):
    out = tmp_path / "dp2"
    result = cli([*command(setup, out), "--nproc", "2"])
    assert result.returncode == 0, describe(result)
    assert directory_bytes(out) == directory_bytes(one_process)


@pytest.mark.slow
def test_tp2_equals_tp1_within_the_derived_bound(setup, one_process, tmp_path):
    out = tmp_path / "tp2"
    result = cli([*command(setup, out, "parallel.tensor_parallel=2"), "--nproc", "2"])
    assert result.returncode == 0, describe(result)
    tp1, tp2 = open_latents(one_process)[:], open_latents(out)[:]
    for key in ("attention_mask", "index", "num_tokens", "truncated"):
        assert torch.equal(tp1[key], tp2[key]), key
    # The longest chain of reductions to a latent, each summed in another order at TP=2 (a slice
    # per rank, then the all-reduce) or by a GEMM blocked differently (the GPT-2 runs on half the
    # batch per rank): the GPT-2 blocks that run (n_layer - 2; per block its LayerNorms, q/k/v, the
    # scores and softmax over T, the output projection, the 4d MLP), then per Perceiver block the
    # LayerNorms, q/k/v, the scores, the softmax over context + stream, the output projection and
    # the MLP with their all-reduces (as tests/helpers/tp_compare.py counts them).
    index = json.loads((one_process / INDEX_FILE).read_text())["model"]
    cfg, gpt2 = index["model_config"], index["feature_model_config"]
    d, heads, length, hidden = cfg["d_model"], cfg["n_heads"], cfg["max_length"], cfg["mlp_ratio"] * cfg["d_model"]
    per_block = 3 * d + d + d // heads + 2 * (2 * length) + d + 2 + d + hidden + 2
    per_gpt2_block = 2 * d + d + 2 * length + d + d + 4 * d
    reduction = cfg["n_encoder_layers"] * per_block + (gpt2["n_layer"] - 2) * per_gpt2_block
    scale = terms_scale(tp1["latents"].abs().max().item(), reduction)
    bound = order_bound(reduction, scale)
    assert largest_difference(tp1["latents"], tp2["latents"]) <= bound
    assert not torch.equal(tp1["latents"], torch.zeros_like(tp1["latents"]))


def _wait_for(path: Path, job: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert job.poll() is None, f"the export ended (exit {job.returncode}) before {path.name} appeared"
        assert time.monotonic() < deadline, f"no {path} within {timeout}s"
        time.sleep(0.2)


def _paused_export(setup, out: Path, shard: int, *extra: str, **popen) -> subprocess.Popen:
    """``encode-corpus`` into ``out`` as its own process, paused half-way through shard ``shard``."""
    job = subprocess.Popen(
        [sys.executable, "-m", "parallel_latent", *command(setup, out), *extra],
        cwd=REPO,
        env=rank_env({PAUSE_IN_SHARD_ENV: str(shard)}),
        stdout=subprocess.DEVNULL,
        **popen,
    )
    try:
        _wait_for(out / WORK_DIR / PAUSE_MARKER, job)
    except BaseException:
        job.kill()
        job.wait()
        raise
    return job


@pytest.mark.slow
def test_killed_mid_shard_then_rerun_at_another_nproc_gives_the_same_bytes(setup, one_process, tmp_path):
    out = tmp_path / "killed"
    job = _paused_export(setup, out, 3, "--nproc", "2", stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        # Shard 3 is half-written under .export/: a second export, and one of another precision,
        # are refused while the first holds the directory.
        second = cli(command(setup, out))
        assert second.returncode == 2 and second.stderr.strip().endswith(
            f"{out}: another export is writing into it (one export at a time per directory)"
        ), describe(second)
        other = cli(command(setup, out, "export.precision=bf16"))
        assert other.returncode == 2 and "holds an export of another export.precision" in other.stderr
        assert len(other.stderr.strip().splitlines()) == 1
        agent = [
            pid
            for pid in rank_pids(job.pid)
            if b"parallel_latent.launching.agent" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        ranks = sorted(set(rank_pids(job.pid)) - set(agent))
        assert len(ranks) == 2, ranks
        os.kill(ranks[0], signal.SIGKILL)  # kill -9 of one rank: torchrun ends the job
        assert job.wait(timeout=120) != 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=60)
    assert not (out / INDEX_FILE).exists()
    assert "data-00003-of-00005.arrow" not in {p.name for p in out.iterdir()}  # never a half shard
    assert any(p.name.startswith("tmp-data-00003") for p in (out / WORK_DIR).iterdir())
    done = {p.name for p in out.glob("data-*.arrow")}
    stamps = {name: (out / name).stat().st_mtime_ns for name in done}
    rerun = cli(command(setup, out))  # one process now
    assert rerun.returncode == 0, describe(rerun)
    assert {name: (out / name).stat().st_mtime_ns for name in done} == stamps  # not written again
    assert directory_bytes(out) == directory_bytes(one_process)


@pytest.mark.slow
def test_ctrl_c_under_nproc_2_says_interrupted_and_exits_130(setup, one_process, tmp_path):
    """A terminal's Ctrl-C reaches the launcher, which forwards SIGTERM to the ranks: an export has
    nothing to save, so the job ends as Ctrl-C ends a command, one line and 130; a rerun continues it."""
    out = tmp_path / "interrupted"
    job = _paused_export(setup, out, 2, "--nproc", "2", stderr=subprocess.PIPE, text=True)
    stderr = interrupt(job, timeout_s=120)
    assert job.returncode == 130, stderr
    assert stderr.strip().splitlines() == ["parallel-latent: error: interrupted"], stderr
    assert main(command(setup, out)) == 0
    assert directory_bytes(out) == directory_bytes(one_process)


def test_sigterm_mid_shard_then_rerun_gives_the_same_bytes(setup, one_process, tmp_path):
    out = tmp_path / "terminated"
    job = _paused_export(setup, out, 2, stderr=subprocess.DEVNULL)
    try:
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=60) == 130  # a stop from outside ends an export as Ctrl-C does
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert sorted(p.name for p in out.glob("data-*.arrow")) == [f"data-0000{i}-of-00005.arrow" for i in (0, 1)]
    assert main(command(setup, out)) == 0
    assert directory_bytes(out) == directory_bytes(one_process)


def test_a_progress_bar_shows_samples_per_second_and_the_time_left(setup, tmp_path, capsys):
    assert main([*command(setup, tmp_path / "out"), "logging.progress_bar=true"]) == 0
    shown = capsys.readouterr().err
    assert "encoding" in shown and "samples/s" in shown and f"{LINES}/{LINES}" in shown
