"""Text data: reading a corpus, tokenising it to fixed length, splitting off a
held-out set, and sharding batches over data-parallel ranks.

Sources (``DataConfig.path``):

- ``""``: the bundled corpus (:func:`bundled_corpus_path`);
- a text file: one sample per line, or per blank-line-separated paragraph when
  ``sample_unit: paragraph`` (the paragraph's lines are joined with spaces);
- a JSONL file: one JSON object per line, the sample in ``text_field``;
- a directory: every ``*.txt`` / ``*.jsonl`` below it, recursively, in sorted order.

Every problem is a :class:`DataError` whose message is one line naming the path
(and ``file:line`` for JSONL).

Batches are drawn by :class:`ShardedBatchSampler`, keyed on the data-parallel rank
(``dp_rank``, ``dp_size``), never the global rank: all tensor-parallel ranks of a
model replica see the same batch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from parallel_latent.config import Config

__all__ = [
    "DataError",
    "ShardedBatchSampler",
    "TokenizedDataset",
    "build_datasets",
    "bundled_corpus_path",
    "get_batch",
    "list_data_files",
    "read_samples",
    "split_indices",
    "tokenize_samples",
]

# The held-out split does not depend on training.seed, so runs with different
# seeds are evaluated on the same samples.
SPLIT_SEED = 0
TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl",)


class DataError(ValueError):
    """A data problem; the message is one line naming the offending path."""


def bundled_corpus_path() -> Path:
    """The corpus shipped with the package (see ``corpus/SOURCE.md``)."""
    return Path(__file__).resolve().parent / "corpus" / "austen_pride_and_prejudice.txt"


# --------------------------------------------------------------------------- #
# Reading.
# --------------------------------------------------------------------------- #


def _file_format(path: Path, requested: str) -> str:
    if requested != "auto":
        return requested
    return "jsonl" if path.suffix.lower() in JSONL_SUFFIXES else "text"


def list_data_files(path: str | Path, format: str = "auto") -> list[Path]:
    """The files a data path stands for: the file itself, or for a directory all
    ``*.txt`` / ``*.jsonl`` files below it (only one kind if ``format`` says so)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: data path does not exist")
    if not path.is_dir():
        return [path]
    suffixes = {
        "auto": TEXT_SUFFIXES + JSONL_SUFFIXES,
        "text": TEXT_SUFFIXES,
        "jsonl": JSONL_SUFFIXES,
    }[format]
    files = sorted(
        candidate for candidate in path.rglob("*") if candidate.is_file() and candidate.suffix.lower() in suffixes
    )
    if not files:
        patterns = " or ".join(f"*{suffix}" for suffix in suffixes)
        raise DataError(f"{path}: directory contains no {patterns} files")
    return files


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 text (bad byte at offset {error.start})") from None
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise DataError(f"{path}: cannot read file: {reason}") from None


def _text_samples(path: Path, sample_unit: str) -> list[str]:
    lines = _read_text(path).splitlines()
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
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{where}: invalid JSON: {error.msg}") from None
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
) -> list[str]:
    """All non-empty samples (stripped strings) of a data path, in file order."""
    root = Path(path) if str(path) else bundled_corpus_path()
    samples: list[str] = []
    for data_file in list_data_files(root, format):
        if _file_format(data_file, format) == "jsonl":
            samples.extend(_jsonl_samples(data_file, text_field))
        else:
            samples.extend(_text_samples(data_file, sample_unit))
    if not samples:
        raise DataError(f"{root}: corpus is empty (no non-empty samples)")
    return samples


# --------------------------------------------------------------------------- #
# Held-out split.
# --------------------------------------------------------------------------- #


def split_indices(
    num_samples: int,
    eval_fraction: float,
    min_eval_samples: int,
    seed: int = SPLIT_SEED,
    source: str = "<data>",
) -> tuple[list[int], list[int]]:
    """Deterministic (train, eval) index lists, each in ascending order.

    The eval set has ``max(min_eval_samples, ceil(eval_fraction * num_samples))``
    samples (none when both are 0) and never takes the whole set.
    """
    num_eval = max(min_eval_samples, math.ceil(eval_fraction * num_samples - 1e-9))
    if num_eval >= num_samples:
        raise DataError(
            f"{source}: corpus of {num_samples} samples is too small to hold out "
            f"{num_eval} for evaluation and still train (data.eval_fraction={eval_fraction}, "
            f"data.min_eval_samples={min_eval_samples})"
        )
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[num_eval:]), sorted(order[:num_eval])


# --------------------------------------------------------------------------- #
# Tokenised datasets.
# --------------------------------------------------------------------------- #


@dataclass
class TokenizedDataset:
    """Samples tokenised to a fixed length T, right-padded.

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


def tokenize_samples(
    texts: Sequence[str], tokenizer: Any, max_length: int, pad_token_id: int, keep_empty: bool = False
) -> TokenizedDataset:
    """Tokenise, truncate to ``max_length`` and right-pad with ``pad_token_id``.
    Samples that produce no tokens are dropped (kept as rows without tokens if ``keep_empty``)."""
    # One token beyond T tells which samples were cut, without tokenising (and
    # warning about) whole long paragraphs.
    encoded = tokenizer(list(texts), truncation=True, max_length=max_length + 1, add_special_tokens=True)["input_ids"]
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


def build_datasets(cfg: Config, tokenizer: Any) -> tuple[TokenizedDataset, TokenizedDataset]:
    """Read ``cfg.data``, tokenise to ``cfg.model.max_length``, split into (train, eval).

    Pads with ``cfg.model.pad_token_id``: apply the tokenizer's facts to ``cfg`` first.
    """
    data = cfg.data
    source = data.path or str(bundled_corpus_path())
    texts = read_samples(data.path, data.format, data.text_field, data.sample_unit)
    if data.max_samples:
        texts = texts[: data.max_samples]
    dataset = tokenize_samples(texts, tokenizer, cfg.model.max_length, cfg.model.pad_token_id)
    if len(dataset) == 0:
        raise DataError(f"{source}: corpus is empty (no sample produced any token)")
    train_indices, eval_indices = split_indices(len(dataset), data.eval_fraction, data.min_eval_samples, source=source)
    return dataset.subset(train_indices), dataset.subset(eval_indices)


def get_batch(dataset: TokenizedDataset, indices: Sequence[int] | torch.Tensor) -> dict[str, torch.Tensor]:
    """``{"input_ids": [B, T], "attention_mask": [B, T]}`` for the given sample indices."""
    index = torch.as_tensor(indices, dtype=torch.long)
    return {"input_ids": dataset.input_ids[index], "attention_mask": dataset.attention_mask[index]}


# --------------------------------------------------------------------------- #
# Sharded, resumable batch order.
# --------------------------------------------------------------------------- #


class ShardedBatchSampler:
    """Batches of sample indices for one data-parallel rank, over endless epochs.

    Epoch ``e`` orders the samples by ``torch.randperm`` seeded with ``seed + e``
    (identity order when ``shuffle`` is false).  That order is cut into global
    batches of ``batch_size * dp_size`` samples, and DP rank ``r`` takes the
    ``r``-th slice of ``batch_size`` from each.  Consequences:

    - DP ranks get disjoint indices; ranks with the same ``dp_rank`` (the
      tensor-parallel group of a replica) get identical batches;
    - the sequence of global batches depends only on ``seed`` and the global batch
      size, not on how it is split over DP ranks or gradient-accumulation steps;
    - with ``drop_last`` the incomplete tail of an epoch is skipped; without it the
      tail is filled up by wrapping around to the start of the epoch's order, so all
      ranks always take the same number of equal-sized batches.

    The position (epoch, batches consumed in it) advances as batches are handed
    out; :meth:`state_dict` / :meth:`load_state_dict` resume exactly there.
    Iterating the object yields the rest of the current epoch (usable as a
    DataLoader ``batch_sampler``); :meth:`iter_batches` never ends.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        drop_last: bool = True,
        shuffle: bool = True,
    ):
        if batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"invalid sampler layout: batch_size={batch_size}, dp_rank={dp_rank}, dp_size={dp_size}")
        if num_samples < 1 or (drop_last and num_samples < batch_size * dp_size):
            raise DataError(
                f"sampler: {num_samples} samples cannot fill one global batch of "
                f"{batch_size} x {dp_size} data-parallel ranks = {batch_size * dp_size}"
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.drop_last = drop_last
        self.shuffle = shuffle
        self.epoch = 0
        self.batches_consumed = 0  # in the current epoch
        self._cached_epoch: int | None = None
        self._cached_order: list[int] = []

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.dp_size

    @property
    def batches_per_epoch(self) -> int:
        rounding = math.floor if self.drop_last else math.ceil
        return rounding(self.num_samples / self.global_batch_size)

    def __len__(self) -> int:
        return self.batches_per_epoch

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._cached_epoch != epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(self.num_samples, generator=generator).tolist()
            else:
                order = list(range(self.num_samples))
            shortfall = self.batches_per_epoch * self.global_batch_size - len(order)
            while shortfall > 0:  # drop_last=False: wrap around to fill the last batch
                order.extend(order[:shortfall])
                shortfall = self.batches_per_epoch * self.global_batch_size - len(order)
            self._cached_epoch, self._cached_order = epoch, order
        return self._cached_order

    def batch_at(self, epoch: int, batch_index: int) -> list[int]:
        """This rank's batch number ``batch_index`` of ``epoch`` (pure: no state change)."""
        if not 0 <= batch_index < self.batches_per_epoch:
            raise IndexError(f"batch {batch_index} outside an epoch of {self.batches_per_epoch}")
        start = (batch_index * self.dp_size + self.dp_rank) * self.batch_size
        return self._epoch_order(epoch)[start : start + self.batch_size]

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """All of this rank's batches of ``epoch`` (pure: no state change)."""
        return [self.batch_at(epoch, index) for index in range(self.batches_per_epoch)]

    # -- position ---------------------------------------------------------- #

    def set_position(self, epoch: int, offset: int = 0) -> None:
        """Continue from batch ``offset`` of ``epoch``."""
        if epoch < 0 or not 0 <= offset <= self.batches_per_epoch:
            raise ValueError(
                f"sampler position epoch={epoch}, offset={offset} outside an epoch of {self.batches_per_epoch} batches"
            )
        self.epoch, self.batches_consumed = epoch, offset

    def set_epoch(self, epoch: int) -> None:
        """torch DistributedSampler-style: start ``epoch`` from its first batch."""
        self.set_position(epoch, 0)

    def next_batch(self) -> list[int]:
        if self.batches_consumed >= self.batches_per_epoch:
            self.epoch, self.batches_consumed = self.epoch + 1, 0
        batch = self.batch_at(self.epoch, self.batches_consumed)
        self.batches_consumed += 1  # before handing it out, so state_dict() counts it
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        """The remaining batches of the current epoch (all of the next one if the
        current is finished)."""
        if self.batches_consumed >= self.batches_per_epoch:
            self.epoch, self.batches_consumed = self.epoch + 1, 0
        while self.batches_consumed < self.batches_per_epoch:
            yield self.next_batch()

    def iter_batches(self) -> Iterator[list[int]]:
        """Batches without end, epoch after epoch, from the current position."""
        while True:
            yield self.next_batch()

    # -- checkpointing ------------------------------------------------------ #

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "batches_consumed": self.batches_consumed,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a saved position.  The saved run may have split the same global
        batch differently over DP ranks; it must have had the same data, seed and
        global batch size, or the continuation would not be the same sequence."""
        for key in ("seed", "num_samples", "global_batch_size"):
            if key in state and int(state[key]) != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]} but this sampler has "
                    f"{key}={getattr(self, key)}: cannot resume the same batch sequence"
                )
        self.set_position(int(state["epoch"]), int(state["batches_consumed"]))
