"""Text data: naming a corpus, preparing it once into a memory-mapped copy, splitting off a
held-out set, and sharding batches over data-parallel ranks.

Sources (``DataConfig.path``):

- ``""``: the bundled corpus (:func:`bundled_corpus_path`);
- a text file: one sample per line, or per blank-line-separated paragraph when
  ``sample_unit: paragraph`` (the paragraph's lines are joined with spaces);
- a JSONL file (one JSON object per line), a parquet file or a CSV file (with a header row): the
  sample in ``text_field``;
- a directory: every ``*.txt`` / ``*.jsonl`` / ``*.parquet`` / ``*.csv`` below it, recursively, in
  sorted order; or a dataset written by ``datasets``' ``save_to_disk`` (``split`` picks the split of
  a ``DatasetDict``); or a prepared copy itself;
- ``hf:NAME`` or ``hf:NAME:CONFIG``: a Hugging Face hub dataset, split ``split``.

Training never holds the corpus: :func:`build_datasets` prepares it once per file system (see
:mod:`parallel_latent.data.prepare`) and returns lazy views of the memory-mapped copy, so a rank's
memory does not grow with the corpus. Every problem is a :class:`DataError` whose message is one
line naming the path.

Batches are drawn by :class:`ShardedBatchSampler`, keyed on the data-parallel rank
(``dp_rank``, ``dp_size``), never the global rank: all tensor-parallel ranks of a
model replica see the same batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from parallel_latent.data.permutation import KeyedPermutation
from parallel_latent.data.prepare import (
    CACHE_ENV,
    PrepareSpec,
    default_cache_dir,
    make_spec,
    open_for_training,
    prepare,
)
from parallel_latent.data.prepared import DatasetView, PreparedDataset, get_batch, read_meta
from parallel_latent.data.sampler import HeldOutSplit, ShardedBatchSampler, held_out_size
from parallel_latent.data.sources import (
    Source,
    bundled_corpus_path,
    list_data_files,
    read_samples,
    resolve_source,
)
from parallel_latent.data.tokenize import TokenizedDataset, tokenize_samples
from parallel_latent.errors import DataError

__all__ = [
    "CACHE_ENV",
    "DataError",
    "DatasetView",
    "HeldOutSplit",
    "KeyedPermutation",
    "PrepareSpec",
    "PreparedDataset",
    "ShardedBatchSampler",
    "Source",
    "TokenizedDataset",
    "build_datasets",
    "bundled_corpus_path",
    "check_source",
    "default_cache_dir",
    "get_batch",
    "held_out_size",
    "list_data_files",
    "make_spec",
    "open_for_training",
    "prepare",
    "read_samples",
    "resolve_source",
    "tokenize_samples",
]


def check_source(data: Any) -> Source:
    """The cheap checks of ``data.path`` (a ``DataConfig``) that need no tokenizer: it exists, names
    data files, a saved dataset, a prepared copy or a hub dataset. DataError otherwise."""
    source = resolve_source(data.path, data.format)
    if source.kind == "prepared":
        read_meta(Path(source.location))
    return source


def build_datasets(cfg: Any, tokenizer: Any, announce: bool = True) -> tuple[DatasetView, DatasetView]:
    """(train, held-out) views of ``cfg.data``'s prepared copy, tokenised to ``cfg.model.max_length``;
    prepared first if no valid copy exists (collective when a process group is up).

    The first ``data.max_samples`` samples (all if 0) are split by a fixed keyed permutation: the
    same held-out samples whatever the seed, TP or DP. Both views decode their ``texts`` with
    ``tokenizer`` on access. ``announce``: say on stdout when the corpus is being prepared.
    """
    data = open_for_training(cfg, tokenizer, announce)
    count = min(len(data), cfg.data.max_samples) if cfg.data.max_samples else len(data)
    source = cfg.data.path or str(bundled_corpus_path())
    split = HeldOutSplit(count, cfg.data.eval_fraction, cfg.data.min_eval_samples, source=source)
    train = DatasetView(data, split.train_rows, split.num_train, tokenizer)
    held_out = DatasetView(data, split.held_out_rows, split.num_eval, tokenizer)
    return train, held_out
