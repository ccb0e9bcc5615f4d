"""Tokenising samples to fixed-length rows: in memory for a handful of texts (the inference API),
and as numpy rows for the preparation pipeline. Both follow one rule: tokens as the tokenizer's
ordinary call gives them (special tokens included), cut to ``max_length``, right-padded with the
pad id; a sample with no token at all is dropped."""

from __future__ import annotations

import copy
import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["RowEncoder", "TokenizedDataset", "token_dtype", "tokenize_samples", "tokenizer_identity"]

# Texts compared between the fast path and the tokenizer's own call before the fast path is trusted.
VERIFY_TEXTS = 64


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id of a vocabulary (uint16 for GPT-2's 50,259)."""
    for dtype in (np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    return np.dtype(np.uint64)


def _serialise_without_call_settings(backend: Any) -> str:
    """The backend's JSON without its truncation and padding: every ``tokenizer(..., truncation=True)``
    call changes those, and they are the call's settings, not the tokenizer's identity."""
    truncation, padding = backend.truncation, backend.padding
    backend.no_truncation()
    backend.no_padding()
    try:
        return backend.to_str()
    finally:
        if truncation:
            backend.enable_truncation(**truncation)
        if padding:
            backend.enable_padding(**padding)


def tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    """What identifies a tokenizer's output: a hash of its full serialisation (vocabulary, merges,
    normalisation, added tokens, post-processor) and the facts the rows depend on."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        serialised = _serialise_without_call_settings(backend)
    else:  # a slow (Python) tokenizer: its vocabulary and added tokens
        serialised = repr(sorted(tokenizer.get_vocab().items())) + repr(getattr(tokenizer, "init_kwargs", {}))
    return {
        "class": type(tokenizer).__name__,
        "sha256": hashlib.sha256(serialised.encode()).hexdigest(),
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "truncation_side": getattr(tokenizer, "truncation_side", "right"),
    }


class RowEncoder:
    """Texts -> (ids [B, T] in ``dtype``, lengths [B] int64, truncated [B] bool), the rows right-padded
    with ``pad_token_id``.

    A fast tokenizer is called through its Rust backend (the same ``encode_batch`` that
    ``tokenizer(texts)`` makes, without building the Python attention-mask lists that are thrown
    away here); the first call checks that it agrees with the tokenizer's own call and falls back to
    that call if not.
    """

    def __init__(self, tokenizer: Any, max_length: int, pad_token_id: int, dtype: np.dtype | None = None):
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.pad_token_id = pad_token_id
        self.vocab_size = len(tokenizer)
        self.dtype = np.dtype(dtype) if dtype is not None else token_dtype(self.vocab_size)
        self._backend = None
        self._verified = False
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if getattr(tokenizer, "is_fast", False) and backend is not None:
            # A copy: the tokenizer object keeps its own truncation settings.
            backend = copy.deepcopy(backend)
            backend.no_padding()
            # One token beyond T tells which samples were cut, without tokenising (and warning
            # about) whole long paragraphs.
            backend.enable_truncation(
                max_length + 1, stride=0, strategy="longest_first", direction=tokenizer.truncation_side
            )
            split_special = getattr(tokenizer, "split_special_tokens", False)
            if hasattr(backend, "encode_special_tokens"):
                backend.encode_special_tokens = split_special
            self._backend = backend

    def _reference_ids(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, truncation=True, max_length=self.max_length + 1, add_special_tokens=True)[
            "input_ids"
        ]

    def ids(self, texts: list[str]) -> list[list[int]]:
        if not texts:  # the tokenizer's own call fails on an empty batch
            return []
        if self._backend is None:
            return self._reference_ids(texts)
        encoded = [encoding.ids for encoding in self._backend.encode_batch(texts, add_special_tokens=True)]
        if not self._verified:
            self._verified = True
            if encoded[:VERIFY_TEXTS] != self._reference_ids(texts[:VERIFY_TEXTS]):
                self._backend = None
                return self._reference_ids(texts)
        return encoded

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        width = self.max_length + 1
        encoded = self.ids(texts)
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        flat = np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int64, count=int(lengths.sum()))
        if flat.size and (flat.min() < 0 or flat.max() >= self.vocab_size):
            bad = int(flat.max() if flat.max() >= self.vocab_size else flat.min())
            raise ValueError(f"tokenizer produced id {bad} outside its vocabulary of {self.vocab_size}")
        rows = np.full((len(encoded), width), self.pad_token_id, dtype=self.dtype)
        rows[np.arange(width) < lengths[:, None]] = flat  # row-major: the same order as the flat ids
        return rows[:, : self.max_length], np.minimum(lengths, self.max_length), lengths > self.max_length


@dataclass
class TokenizedDataset:
    """Samples tokenised to a fixed length T, right-padded, in memory.

    ``input_ids`` [N, T] long (pad positions hold the pad id), ``attention_mask``
    [N, T] long (1 real token, 0 pad), ``texts`` the N source strings.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    texts: list[str]
    truncated: torch.Tensor  # [N] bool: the sample had more than T tokens and was cut

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "attention_mask": self.attention_mask[index]}

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def num_truncated(self) -> int:
        return int(self.truncated.sum())

    def subset(self, indices: Sequence[int]) -> TokenizedDataset:
        index = torch.as_tensor(list(indices), dtype=torch.long)
        return TokenizedDataset(
            input_ids=self.input_ids[index],
            attention_mask=self.attention_mask[index],
            texts=[self.texts[i] for i in index.tolist()],
            truncated=self.truncated[index],
        )

    def batch(self, indices: Sequence[int] | torch.Tensor | np.ndarray) -> dict[str, torch.Tensor]:
        index = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        return {"input_ids": self.input_ids[index], "attention_mask": self.attention_mask[index]}


def tokenize_samples(
    texts: Sequence[str], tokenizer: Any, max_length: int, pad_token_id: int, keep_empty: bool = False
) -> TokenizedDataset:
    """Tokenise, truncate to ``max_length`` and right-pad with ``pad_token_id``.
    Samples that produce no tokens are dropped (kept as rows without tokens if ``keep_empty``)."""
    texts = list(texts)
    encoded = tokenizer(texts, truncation=True, max_length=max_length + 1, add_special_tokens=True)["input_ids"]
    kept = [(text, ids) for text, ids in zip(texts, encoded, strict=True) if ids or keep_empty]
    input_ids = torch.full((len(kept), max_length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(kept), max_length), dtype=torch.long)
    truncated = torch.zeros(len(kept), dtype=torch.bool)
    for row, (_, ids) in enumerate(kept):
        truncated[row] = len(ids) > max_length
        ids = ids[:max_length]
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, : len(ids)] = 1
    return TokenizedDataset(input_ids, attention_mask, [text for text, _ in kept], truncated)
