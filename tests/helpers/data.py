"""Shared helpers of the data tests: a tokenizer, configs pointing at a private cache, and the
reference rows (the in-memory reader + tokenize_samples) that every prepared copy must equal."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from parallel_latent.config import Config, TokenizerConfig, config_from_dict
from parallel_latent.data import get_batch, read_samples, tokenize_samples
from parallel_latent.feature_model.tokenizer import apply_tokenizer_facts, load_tokenizer, tokenizer_facts

_TOKENIZER = None


def tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = load_tokenizer(TokenizerConfig(name_or_path="offline"))
    return _TOKENIZER


def data_config(cache_dir: Path, max_length: int = 8, **data) -> Config:
    cfg = config_from_dict(
        {"data": {"cache_dir": str(cache_dir), "min_eval_samples": 1, **data}, "model": {"max_length": max_length}}
    )
    return apply_tokenizer_facts(cfg, tokenizer_facts(tokenizer()))


def reference_rows(texts: list[str], max_length: int = 8):
    """(input_ids, attention_mask, truncated) as the in-memory path tokenises ``texts``."""
    tok = tokenizer()
    dataset = tokenize_samples(texts, tok, max_length, tok.pad_token_id)
    return dataset.input_ids, dataset.attention_mask, dataset.truncated


def reference_from_path(path: Path, max_length: int = 8, **read_options):
    return reference_rows(read_samples(path, **read_options), max_length)


def all_rows(data):
    """Every row of a PreparedDataset, in order."""
    batch = get_batch(data, np.arange(len(data)))
    return batch["input_ids"], batch["attention_mask"], torch.from_numpy(np.array(data.truncated, dtype=bool))


def assert_same_rows(data, reference) -> None:
    got = all_rows(data)
    assert got[0].shape == reference[0].shape, (got[0].shape, reference[0].shape)
    for mine, theirs in zip(got, reference, strict=True):
        assert torch.equal(mine, theirs)
