"""Reading a prepared copy: memory-mapped token rows, opened in O(1) time and memory.

A prepared copy is a directory::

    meta.json        format marker and version, fingerprint and what it was computed from,
                     sample / token / truncation counts, file sizes, a content digest
    input_ids.npy    [N, T] uint16 (uint32 for vocabularies over 65,536 ids), right-padded
    lengths.npy      [N] tokens kept per sample (<= T)
    truncated.npy    [N] bool: the sample had more than T tokens and was cut

Opening checks the structure (meta present and parseable, the marker, every array's header and
exact file size) but reads no sample: the check is O(1) and runs on every start. Token ids are
range-checked per batch, as they are read.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from parallel_latent.errors import DataError
from parallel_latent.files import load_json_file

__all__ = [
    "ARRAYS",
    "FORMAT_VERSION",
    "PREPARED_MARKER",
    "DatasetView",
    "LazyTexts",
    "PreparedDataset",
    "get_batch",
    "is_prepared_copy",
]

FORMAT_VERSION = 1
META = "meta.json"
PREPARED_MARKER = "parallel-latent-prepared"  # meta.json's "format": what makes a directory a prepared copy
ARRAYS = ("input_ids", "lengths", "truncated")


def is_prepared_copy(path: Path) -> bool:
    """Whether ``path`` is a directory this module reads (its meta.json carries the marker)."""
    meta = path / META
    if not meta.is_file():
        return False
    try:
        return load_json_file(meta).get("format") == PREPARED_MARKER
    except (OSError, ValueError, AttributeError):
        return False


def _open_array(path: Path, expected_dtype: np.dtype, expected_shape: tuple[int, ...], where: Path) -> np.memmap:
    """A read-only memmap of a .npy file whose header and size are exactly as expected."""

    def damaged(problem: str) -> DataError:
        return DataError(
            f"{where}: prepared copy is damaged: {path.name} {problem}; delete the directory to prepare again"
        )

    try:
        with open(path, "rb") as handle:
            version = np.lib.format.read_magic(handle)
            read_header = (
                np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read_header(handle)
            offset = handle.tell()
    except FileNotFoundError:
        raise damaged("is missing") from None
    except (OSError, ValueError) as error:
        raise damaged(f"has no valid .npy header ({error})") from None
    if fortran or dtype != expected_dtype or tuple(shape) != tuple(expected_shape):
        raise damaged(f"holds {dtype} {tuple(shape)}, expected {expected_dtype} {tuple(expected_shape)}")
    expected_size = offset + int(np.prod(expected_shape, dtype=np.int64)) * expected_dtype.itemsize
    actual_size = path.stat().st_size
    if actual_size != expected_size:
        raise damaged(f"is {actual_size} bytes, expected {expected_size} (truncated or overwritten)")
    if 0 in expected_shape:
        return np.zeros(expected_shape, dtype=expected_dtype)
    return np.memmap(path, dtype=expected_dtype, mode="r", offset=offset, shape=tuple(expected_shape))


def read_meta(path: Path) -> dict[str, Any]:
    """``meta.json`` of a prepared copy, checked to be ours and of this format version."""
    meta_path = path / META
    if not path.is_dir():
        raise DataError(f"{path}: prepared copy is not a directory")
    try:
        meta = load_json_file(meta_path)
    except FileNotFoundError:
        raise DataError(f"{path}: not a prepared copy (no {META}); delete the directory to prepare again") from None
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise DataError(f"{path}: prepared copy is damaged: {META} is unreadable ({error})") from None
    if not isinstance(meta, dict) or meta.get("format") != PREPARED_MARKER:
        raise DataError(f"{path}: not a parallel-latent prepared copy ({META} has no format marker)")
    if meta.get("version") != FORMAT_VERSION:
        raise DataError(
            f"{path}: prepared copy has format version {meta.get('version')}, this version reads "
            f"{FORMAT_VERSION}; delete the directory to prepare again"
        )
    return meta


class PreparedDataset:
    """A prepared copy, memory-mapped: ``len()`` samples of ``max_length`` tokens."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.meta = meta = read_meta(self.path)
        try:
            self.num_samples = int(meta["num_samples"])
            self.max_length = int(meta["max_length"])
            self.vocab_size = int(meta["vocab_size"])
            self.pad_token_id = int(meta["pad_token_id"])
            self.fingerprint = str(meta["fingerprint"])
            self.content_digest = str(meta["content_sha256"])
            id_dtype, length_dtype = np.dtype(meta["dtype"]), np.dtype(meta["length_dtype"])
        except (KeyError, TypeError, ValueError) as error:
            raise DataError(f"{self.path}: prepared copy is damaged: {META} lacks or garbles {error}") from None
        n, t = self.num_samples, self.max_length
        self.input_ids = _open_array(self.path / "input_ids.npy", id_dtype, (n, t), self.path)
        self.lengths = _open_array(self.path / "lengths.npy", length_dtype, (n,), self.path)
        self.truncated = _open_array(self.path / "truncated.npy", np.dtype(bool), (n,), self.path)

    def __len__(self) -> int:
        return self.num_samples

    @property
    def num_truncated(self) -> int:
        return int(self.meta.get("num_truncated", 0))

    @property
    def num_tokens(self) -> int:
        return int(self.meta.get("num_tokens", 0))

    def rows(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        """``{"input_ids", "attention_mask"}`` [B, T] long for sample rows ``rows``."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.num_samples):
            raise IndexError(f"sample row outside [0, {self.num_samples})")
        ids = self.input_ids[rows].astype(np.int64)
        lengths = self.lengths[rows].astype(np.int64)
        if ids.size and ids.max() >= self.vocab_size:
            row = int(rows[np.argmax(ids.max(axis=1))])
            raise DataError(
                f"{self.path}: sample {row} holds token id {int(ids.max())}, outside the vocabulary of "
                f"{self.vocab_size}; the prepared copy is damaged, delete the directory to prepare again"
            )
        mask = np.arange(self.max_length) < lengths[:, None]
        ids[~mask] = self.pad_token_id
        return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask.astype(np.int64))}

    def token_ids(self, row: int) -> list[int]:
        """The tokens of one sample, without padding."""
        return self.input_ids[row, : int(self.lengths[row])].astype(np.int64).tolist()


class LazyTexts(Sequence):
    """The texts of a view, as the model saw them: its token ids decoded on access (so cut at
    ``max_length`` tokens where the sample was longer). Supports ``len``, indexing and slicing."""

    def __init__(self, view: DatasetView):
        self._view = view

    def __len__(self) -> int:
        return len(self._view)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("text index out of range")
        return self._view.text(index)


class DatasetView:
    """A split of a prepared copy (train or held out): ``len()`` samples whose ``i``-th is the
    sample row ``rows_of([i])``. Nothing per sample is held in memory."""

    def __init__(self, data: PreparedDataset, rows_of, length: int, tokenizer: Any = None, features: Any = None):
        self.data = data
        self._rows_of = rows_of
        self._length = length
        self.tokenizer = tokenizer
        self.features = features  # the feature cache (``.rows(rows)`` -> [B, T, f]), or None

    def with_features(self, features: Any) -> DatasetView:
        """This view, its batches carrying their ``features`` from the feature cache ``features``."""
        return DatasetView(self.data, self._rows_of, self._length, self.tokenizer, features)

    def __len__(self) -> int:
        return self._length

    def rows(self, indices) -> np.ndarray:
        return self._rows_of(np.asarray(indices, dtype=np.int64))

    def batch(self, indices) -> dict[str, torch.Tensor]:
        """``{"input_ids", "attention_mask"}`` [B, T], and ``"features"`` [B, T, f] with a feature cache."""
        rows = self.rows(indices)
        batch = self.data.rows(rows)
        if self.features is not None:
            batch["features"] = self.features.rows(rows)
        return batch

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        batch = self.batch([index])
        return {key: value[0] for key, value in batch.items()}

    def truncated_at(self, indices) -> np.ndarray:
        return np.asarray(self.data.truncated[self.rows(indices)], dtype=bool)

    def text(self, index: int) -> str:
        if self.tokenizer is None:
            raise ValueError("this view has no tokenizer to decode its samples with")
        row = int(self.rows([index])[0])
        return self.tokenizer.decode(
            self.data.token_ids(row), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    @property
    def texts(self) -> LazyTexts:
        return LazyTexts(self)

    @property
    def max_length(self) -> int:
        return self.data.max_length


def token_count(dataset: Any, indices: Sequence[int] | np.ndarray) -> int:
    """Non-pad tokens of these samples: from the memory-mapped lengths where there are some (no
    token is read), else from the batch's mask."""
    if isinstance(dataset, DatasetView):
        return int(dataset.data.lengths[dataset.rows(indices)].astype(np.int64).sum())
    return int(get_batch(dataset, indices)["attention_mask"].sum())


def get_batch(dataset: Any, indices: Sequence[int] | torch.Tensor | np.ndarray) -> dict[str, torch.Tensor]:
    """``{"input_ids": [B, T], "attention_mask": [B, T]}`` (long) for the given sample indices of a
    :class:`DatasetView`, a :class:`PreparedDataset` or an in-memory ``TokenizedDataset``."""
    if isinstance(indices, torch.Tensor):
        indices = indices.cpu().numpy()
    if isinstance(dataset, PreparedDataset):
        return dataset.rows(np.asarray(indices, dtype=np.int64))
    return dataset.batch(indices)
