"""Corpus reading, tokenisation to fixed length, held-out split, DP-sharded sampling (the in-memory
reader, the lazy split and sampler; preparation is tested in tests/data/)."""

from __future__ import annotations

import functools
import json
import math
import operator
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from parallel_latent.config import Config, TokenizerConfig, config_from_dict
from parallel_latent.data import (
    DataError,
    DatasetView,
    HeldOutSplit,
    KeyedPermutation,
    ShardedBatchSampler,
    build_datasets,
    bundled_corpus_path,
    get_batch,
    read_samples,
    tokenize_samples,
)
from parallel_latent.feature_model.tokenizer import apply_tokenizer_facts, load_tokenizer, tokenizer_facts

PAD = 50258


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TokenizerConfig(name_or_path="offline"))


def data_error(*args, **kwargs) -> str:
    """The message of the DataError that read_samples raises; asserts it is one line."""
    with pytest.raises(DataError) as caught:
        read_samples(*args, **kwargs)
    message = str(caught.value)
    assert "\n" not in message, message
    return message


# --------------------------------------------------------------------------- #
# Reading.
# --------------------------------------------------------------------------- #


def test_text_lines(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("first line\n\n   \n  second line  \r\nthird\n")
    assert read_samples(path) == ["first line", "second line", "third"]


def test_text_paragraphs(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("one\ntwo\n\n\nthree\n  \nfour\nfive")
    assert read_samples(path, sample_unit="paragraph") == ["one two", "three", "four five"]


def test_jsonl(tmp_path):
    path = tmp_path / "a.jsonl"
    records = [{"text": "alpha", "id": 1}, {"text": "  "}, {"text": "beta"}]
    path.write_text("\n".join(json.dumps(record) for record in records) + "\n\n")
    assert read_samples(path) == ["alpha", "beta"]
    assert read_samples(path, format="jsonl") == ["alpha", "beta"]
    # format=text reads the same file as plain lines.
    assert read_samples(path, format="text")[0] == '{"text": "alpha", "id": 1}'


def test_jsonl_custom_field(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"body": "gamma"}) + "\n")
    assert read_samples(path, text_field="body") == ["gamma"]


def test_directory_is_read_recursively_in_sorted_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("from b/z\n")
    (tmp_path / "a.txt").write_text("from a\n")
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "from c"}) + "\n")
    (tmp_path / "notes.md").write_text("ignored\n")
    assert read_samples(tmp_path) == ["from a", "from b/z", "from c"]
    assert read_samples(tmp_path, format="text") == ["from a", "from b/z"]
    assert read_samples(tmp_path, format="jsonl") == ["from c"]


def test_bundled_corpus():
    assert bundled_corpus_path().is_file()
    assert (bundled_corpus_path().parent / "SOURCE.md").is_file()
    samples = read_samples("")
    assert samples == read_samples(bundled_corpus_path())
    assert len(samples) > 4000
    assert samples[0].startswith("It is a truth universally acknowledged")


# --------------------------------------------------------------------------- #
# Errors: one line naming the path.
# --------------------------------------------------------------------------- #


def test_missing_path(tmp_path):
    missing = tmp_path / "nope.txt"
    assert data_error(missing) == f"{missing}: data path does not exist"


def test_not_utf8_file(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"caf\xe9\n")
    assert data_error(path) == f"{path}: not UTF-8 text (bad byte at offset 3)"


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file(tmp_path):
    path = tmp_path / "secret.txt"
    path.write_text("hidden\n")
    path.chmod(0)
    try:
        assert data_error(path) == f"{path}: cannot read file: Permission denied"
    finally:
        path.chmod(0o600)


def test_read_error_is_one_line(tmp_path, monkeypatch):
    # Runs even as root (who can read a chmod 000 file): simulate the OS refusing.
    path = tmp_path / "locked.txt"
    path.write_text("x\n")

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", refuse)
    assert data_error(path) == f"{path}: cannot read file: Permission denied"


def test_empty_corpus(tmp_path):
    path = tmp_path / "blank.txt"
    path.write_text("\n  \n\n")
    assert data_error(path) == f"{path}: corpus is empty (no non-empty samples)"
    jsonl = tmp_path / "blank.jsonl"
    jsonl.write_text(json.dumps({"text": ""}) + "\n")
    assert data_error(jsonl) == f"{jsonl}: corpus is empty (no non-empty samples)"


def test_directory_without_data_files(tmp_path):
    (tmp_path / "readme.md").write_text("x")
    (tmp_path / "empty.txt").write_text("")  # an empty file holds no samples: left out
    assert data_error(tmp_path) == f"{tmp_path}: directory contains no *.txt, *.jsonl, *.parquet or *.csv files"
    assert data_error(tmp_path, format="jsonl") == f"{tmp_path}: directory contains no *.jsonl files"


def test_binary_file(tmp_path):
    # UTF-16 text is valid UTF-8 byte by byte, but full of NUL bytes.
    path = tmp_path / "utf16.txt"
    path.write_bytes("hi there\n".encode("utf-16-le"))
    assert data_error(path) == f"{path}: binary data (NUL byte at offset 1), not UTF-8 text"


@pytest.mark.parametrize(
    "line, expected",
    [
        ('{"text": "ok"', "invalid JSON: Expecting ',' delimiter (column 14)"),
        ("not json", "invalid JSON: Expecting value (column 1)"),
        ("[" * 100_000 + "]" * 100_000, "nested deeper than 64 levels"),
        ('{"text": "a", "weight": NaN}', "holds NaN, which is no number JSON allows"),
        ('{"body": "x"}', "missing text field 'text'"),
        ('["text"]', "expected a JSON object, got list"),
        ('{"text": 3}', "text field 'text' is int, not a string"),
    ],
)
def test_bad_jsonl_line_names_file_and_line(tmp_path, line, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n\n" + line + "\n")
    assert data_error(path) == f"{path}:3: {expected}"


# --------------------------------------------------------------------------- #
# Tokenisation.
# --------------------------------------------------------------------------- #


def test_pad_and_truncate(tokenizer):
    long_text = " ".join(["word"] * 50)
    dataset = tokenize_samples(["Hello world", long_text], tokenizer, max_length=8, pad_token_id=PAD)
    assert dataset.input_ids.dtype == torch.long and dataset.attention_mask.dtype == torch.long
    assert dataset.input_ids.shape == dataset.attention_mask.shape == (2, 8)
    assert dataset.input_ids[0].tolist() == [15496, 995] + [PAD] * 6
    assert dataset.attention_mask[0].tolist() == [1, 1] + [0] * 6
    assert dataset.input_ids[1].tolist() == tokenizer(long_text)["input_ids"][:8]
    assert dataset.attention_mask[1].tolist() == [1] * 8
    assert dataset.truncated.tolist() == [False, True] and dataset.num_truncated == 1
    assert dataset.num_tokens == 10 and len(dataset) == 2
    assert dataset.texts == ["Hello world", long_text]


def test_exactly_max_length_is_not_truncated(tokenizer):
    text = " ".join(["word"] * 8)
    assert len(tokenizer(text)["input_ids"]) == 8
    dataset = tokenize_samples([text], tokenizer, max_length=8, pad_token_id=PAD)
    assert dataset.attention_mask.sum() == 8 and dataset.num_truncated == 0


class _WordTokenizer:
    """Stand-in tokenizer: one id per word, so a sample can tokenise to nothing."""

    def __call__(self, texts, **kwargs):
        return {"input_ids": [[len(word) for word in text.split() if word != "~"] for text in texts]}


def test_samples_without_tokens_are_dropped():
    dataset = tokenize_samples(["a bb", "~", "ccc"], _WordTokenizer(), max_length=4, pad_token_id=0)
    assert dataset.texts == ["a bb", "ccc"]
    assert dataset.input_ids.tolist() == [[1, 2, 0, 0], [3, 0, 0, 0]]


def test_get_batch():
    dataset = tokenize_samples(["a", "bb", "ccc"], _WordTokenizer(), max_length=2, pad_token_id=9)
    batch = get_batch(dataset, [2, 0])
    assert set(batch) == {"input_ids", "attention_mask"}
    assert batch["input_ids"].tolist() == [[3, 9], [1, 9]]
    assert batch["attention_mask"].tolist() == [[1, 0], [1, 0]]
    assert get_batch(dataset, torch.tensor([1]))["input_ids"].tolist() == [[2, 9]]
    assert dataset[1]["input_ids"].tolist() == [2, 9]


# --------------------------------------------------------------------------- #
# Held-out split: a fixed keyed permutation, nothing per sample in memory.
# --------------------------------------------------------------------------- #


def test_keyed_permutation_is_a_bijection_for_every_size():
    for n in (1, 2, 3, 5, 16, 17, 1000, 4097):
        values = KeyedPermutation(n, key=99)(np.arange(n))
        assert sorted(values.tolist()) == list(range(n)), n
    perm = KeyedPermutation(1000, key=7)
    assert perm(np.arange(1000)).tolist() != list(range(1000))
    assert perm([5, 3]).tolist() == [perm([5])[0], perm([3])[0]]  # a pure function of the position
    assert perm(np.arange(1000)).tolist() != KeyedPermutation(1000, key=8)(np.arange(1000)).tolist()
    with pytest.raises(IndexError):
        perm([1000])


def test_split_is_deterministic_disjoint_and_complete():
    split = HeldOutSplit(1000, eval_fraction=0.05, min_eval_samples=16)
    held_out = split.held_out_rows(np.arange(split.num_eval)).tolist()
    train = split.train_rows(np.arange(split.num_train)).tolist()
    again = HeldOutSplit(1000, eval_fraction=0.05, min_eval_samples=16)
    assert again.held_out_rows(np.arange(50)).tolist() == held_out
    assert len(held_out) == 50 and len(train) == 950
    assert sorted(train + held_out) == list(range(1000))
    assert sorted(held_out) != list(range(50))  # shuffled, not the head of the file


def test_split_sizes():
    assert HeldOutSplit(100, 0.02, 16).num_eval == 16  # the minimum wins
    assert HeldOutSplit(101, 0.5, 0).num_eval == 51  # rounded up
    assert HeldOutSplit(10, 0.0, 0).num_eval == 0
    assert HeldOutSplit(17, 0.0, 16).num_train == 1


def test_split_too_small_is_a_clear_error():
    with pytest.raises(DataError) as caught:
        HeldOutSplit(16, 0.02, 16, source="tiny.txt")
    assert str(caught.value) == (
        "tiny.txt: corpus of 16 samples is too small to hold out 16 for evaluation and still "
        "train (data.eval_fraction=0.02, data.min_eval_samples=16)"
    )


def test_build_datasets(tokenizer, tmp_path):
    path = tmp_path / "corpus.txt"
    texts = [f"Sentence number {i} of the test corpus." for i in range(200)]
    path.write_text("\n".join(texts))
    overrides = {"path": str(path), "eval_fraction": 0.1, "min_eval_samples": 4, "cache_dir": str(tmp_path / "c")}
    cfg = config_from_dict({"data": overrides, "model": {"max_length": 6}})
    cfg = apply_tokenizer_facts(cfg, tokenizer_facts(tokenizer))
    train, held_out = build_datasets(cfg, tokenizer)
    assert isinstance(train, DatasetView) and isinstance(held_out, DatasetView)
    assert (len(train), len(held_out)) == (180, 20)
    batch = get_batch(train, list(range(180)))
    assert batch["input_ids"].shape == (180, 6) and batch["input_ids"].dtype == torch.long
    assert get_batch(held_out, torch.arange(20))["attention_mask"].shape == (20, 6)
    # Texts as the model saw them: the first 6 tokens, decoded.
    reference = tokenize_samples(texts, tokenizer, 6, cfg.model.pad_token_id)
    seen = {tokenizer.decode(row.tolist()) for row in reference.input_ids}
    assert set(train.texts) | set(held_out.texts) == seen and not set(train.texts) & set(held_out.texts)
    assert list(build_datasets(cfg, tokenizer)[1].texts) == list(held_out.texts)  # deterministic
    assert held_out.truncated_at(range(20)).all()  # every sample is longer than 6 tokens
    rows = np.concatenate([train.rows(range(180)), held_out.rows(range(20))])
    assert sorted(rows.tolist()) == list(range(200))

    capped = config_from_dict({"data": {**overrides, "max_samples": 50, "eval_fraction": 0.02, "min_eval_samples": 16}})
    train, held_out = build_datasets(capped, tokenizer)
    assert (len(train), len(held_out)) == (34, 16)
    assert get_batch(train, [0])["input_ids"].shape[1] == 32
    assert max(train.rows(range(34)).max(), held_out.rows(range(16)).max()) < 50  # the first 50 samples


def test_build_datasets_on_the_bundled_corpus(tokenizer):
    cfg = apply_tokenizer_facts(Config(), tokenizer_facts(tokenizer))
    train, held_out = build_datasets(cfg, tokenizer)
    assert len(train) + len(held_out) == len(read_samples(""))
    assert len(held_out) == max(16, math.ceil(0.02 * len(read_samples(""))))
    batch = get_batch(train, range(len(train)))
    assert (batch["input_ids"][batch["attention_mask"] == 0] == cfg.model.pad_token_id).all()
    # Most samples fit in T=32 tokens.
    assert train.truncated_at(range(len(train))).sum() < 0.3 * len(train)
    assert train.data.num_truncated == int(np.asarray(train.data.truncated).sum())


# --------------------------------------------------------------------------- #
# Sharded sampler.
# --------------------------------------------------------------------------- #


def take(sampler: ShardedBatchSampler, count: int) -> list[list[int]]:
    batches = sampler.iter_batches()
    return [next(batches) for _ in range(count)]


def test_dp_ranks_get_disjoint_batches_covering_the_epoch():
    samplers = [ShardedBatchSampler(100, 8, dp_rank=r, dp_size=3, seed=5) for r in range(3)]
    per_rank = [functools.reduce(operator.iadd, sampler.epoch_batches(0), []) for sampler in samplers]
    assert all(len(indices) == 4 * 8 for indices in per_rank)  # 100 // 24 = 4 batches each
    flat = functools.reduce(operator.iadd, per_rank, [])
    assert len(set(flat)) == len(flat) == 96
    epoch_order = samplers[0].epoch_order(0, np.arange(100)).tolist()
    assert sorted(epoch_order) == list(range(100))
    assert sorted(flat) == sorted(epoch_order[:96])
    # Rank r's micro-batch b holds positions (b * dp_size + r) * batch_size ... of the epoch order.
    assert samplers[1].batch_at(0, 2) == epoch_order[(2 * 3 + 1) * 8 : (2 * 3 + 2) * 8]


def test_same_dp_rank_gets_identical_batches():
    # Tensor-parallel ranks of one replica build their sampler from the same dp_rank.
    first = ShardedBatchSampler(100, 8, dp_rank=1, dp_size=2, seed=3)
    second = ShardedBatchSampler(100, 8, dp_rank=1, dp_size=2, seed=3)
    assert take(first, 20) == take(second, 20)


def test_order_is_a_function_of_seed_and_epoch():
    sampler = ShardedBatchSampler(64, 4, seed=10)
    flat = functools.reduce(operator.iadd, sampler.epoch_batches(0), [])
    assert sorted(flat) == list(range(64)) and flat != list(range(64))
    assert sampler.epoch_batches(3) == ShardedBatchSampler(64, 4, seed=10).epoch_batches(3)
    assert sampler.epoch_batches(0) != sampler.epoch_batches(1)
    assert sampler.epoch_batches(0) != ShardedBatchSampler(64, 4, seed=99).epoch_batches(0)
    # Seed and epoch do not simply add up: seed 11's epoch 1 is not seed 10's epoch 2.
    assert sampler.epoch_batches(2) != ShardedBatchSampler(64, 4, seed=11).epoch_batches(1)


def test_global_batches_do_not_depend_on_the_dp_split():
    whole = ShardedBatchSampler(96, 16, dp_rank=0, dp_size=1, seed=7)
    halves = [ShardedBatchSampler(96, 8, dp_rank=r, dp_size=2, seed=7) for r in range(2)]
    for step in range(6):
        assert whole.batch_at(0, step) == halves[0].batch_at(0, step) + halves[1].batch_at(0, step)


def test_iteration_runs_over_epochs_and_iter_gives_one_epoch():
    sampler = ShardedBatchSampler(10, 3, seed=0)  # 3 batches per epoch, 1 sample dropped
    assert len(sampler) == 3
    endless = take(ShardedBatchSampler(10, 3, seed=0), 7)
    assert endless[:3] == sampler.epoch_batches(0) and endless[3:6] == sampler.epoch_batches(1)
    assert list(sampler) == sampler.epoch_batches(0)
    assert list(sampler) == sampler.epoch_batches(1)
    assert sampler.state_dict()["epoch"] == 1


def test_resume_from_state_equals_uninterrupted_run():
    uninterrupted = take(ShardedBatchSampler(50, 4, dp_rank=1, dp_size=2, seed=42), 30)
    for stop_after in (0, 5, 6, 13):  # 6 batches per epoch: 6 is an epoch boundary
        first = ShardedBatchSampler(50, 4, dp_rank=1, dp_size=2, seed=42)
        before = take(first, stop_after)
        state = first.state_dict()
        resumed = ShardedBatchSampler(50, 4, dp_rank=1, dp_size=2, seed=42)
        resumed.load_state_dict(state)
        assert before + take(resumed, 30 - stop_after) == uninterrupted


def test_set_position():
    sampler = ShardedBatchSampler(50, 4, seed=1)
    sampler.set_position(3, 2)
    assert next(sampler.iter_batches()) == sampler.batch_at(3, 2)
    assert sampler.state_dict()["epoch"] == 3 and sampler.state_dict()["batches_consumed"] == 3
    with pytest.raises(ValueError):
        sampler.set_position(0, sampler.batches_per_epoch + 1)


def test_resume_with_the_same_global_batch_split_differently():
    # A run at DP=1 x batch 8 resumed at DP=2 x batch 4 continues the same global batches.
    single = ShardedBatchSampler(40, 8, seed=2)
    take(single, 3)
    pair = [ShardedBatchSampler(40, 4, dp_rank=r, dp_size=2, seed=2) for r in range(2)]
    for sampler in pair:
        sampler.load_state_dict(single.state_dict())
    for _ in range(4):
        assert next(single.iter_batches()) == pair[0].next_batch() + pair[1].next_batch()


def test_resume_rejects_a_different_sequence():
    state = ShardedBatchSampler(40, 8, seed=2).state_dict()
    with pytest.raises(ValueError, match="seed=2 but this sampler has seed=3"):
        ShardedBatchSampler(40, 8, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="num_samples=40"):
        ShardedBatchSampler(41, 8, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="global_batch_size=8"):
        ShardedBatchSampler(40, 4, seed=2).load_state_dict(state)


def test_without_drop_last_every_sample_is_seen_and_batches_are_full():
    samplers = [
        ShardedBatchSampler(10, 3, dp_rank=r, dp_size=2, seed=0, drop_last=False, shuffle=False) for r in range(2)
    ]
    assert [len(sampler) for sampler in samplers] == [2, 2]
    batches = [sampler.epoch_batches(0) for sampler in samplers]
    assert batches[0] == [[0, 1, 2], [6, 7, 8]] and batches[1] == [[3, 4, 5], [9, 0, 1]]


def test_too_few_samples_for_one_global_batch():
    with pytest.raises(DataError, match="10 samples cannot fill one global batch of 4 x 3"):
        ShardedBatchSampler(10, 4, dp_rank=0, dp_size=3)
    with pytest.raises(ValueError):
        ShardedBatchSampler(10, 2, dp_rank=2, dp_size=2)


def test_resume_with_the_same_global_batch_accumulated_differently():
    """One step of 8 = two accumulated micro-batches of 4 = four of 2 over two DP ranks: the same
    samples, the same epoch ends (the dropped tail is counted in global batches), and a position
    saved under one split resumes under another."""
    one = ShardedBatchSampler(45, 8, seed=4)  # 5 steps of 8 per epoch, 5 samples dropped
    two = ShardedBatchSampler(45, 4, seed=4, grad_accum=2)
    four = [ShardedBatchSampler(45, 2, dp_rank=r, dp_size=2, seed=4, grad_accum=2) for r in range(2)]
    assert one.global_batch_size == two.global_batch_size == four[0].global_batch_size == 8
    assert (len(one), len(two), len(four[0])) == (5, 10, 10)
    for _ in range(12):  # past the end of the first epoch
        step = one.next_batch()
        assert step == two.next_batch() + two.next_batch()
        pieces = [four[0].next_batch(), four[1].next_batch(), four[0].next_batch(), four[1].next_batch()]
        assert step == pieces[0] + pieces[1] + pieces[2] + pieces[3]
    resumed = ShardedBatchSampler(45, 2, dp_rank=1, dp_size=2, seed=4, grad_accum=2)
    resumed.load_state_dict(one.state_dict())
    step = one.next_batch()
    assert resumed.next_batch() + resumed.next_batch() == step[2:4] + step[6:8]  # rank 1's shares
    with pytest.raises(ValueError, match="inside an optimizer step"):
        ShardedBatchSampler(45, 8, seed=4).load_state_dict({**two.state_dict(), "batches_consumed": 3})
