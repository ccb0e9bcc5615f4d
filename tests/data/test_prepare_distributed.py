"""Preparing from every rank of a job at once: real gloo ranks (4), a fresh cache each time.

One shared cache directory: exactly one preparation (global rank 0), every rank reads the same
copy. Node-local caches (two "nodes" of two ranks, each with its own directory, LOCAL_RANK 0/1):
one preparation per node. A problem on one rank stops every rank with the same one-line error
instead of leaving the others waiting.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from parallel_latent.data import DataError, build_datasets
from parallel_latent.data.prepare import LOG_NAME
from tests.helpers.data import data_config, tokenizer
from tests.helpers.pool_training import shared_pool

WORLD = 4


@pytest.fixture(scope="module")
def pool(request):
    """Four gloo ranks shared with the other checkpoint and data modules (tests/helpers/pool_training.py)."""
    return shared_pool(request, WORLD)


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(f"Sample number {i} of a corpus that four ranks share." for i in range(300)) + "\n")
    return path


def _open(cache_dir: str, corpus: str, local_rank: int | None = None) -> dict:
    import torch.distributed as dist

    if local_rank is not None:
        os.environ["LOCAL_RANK"] = str(local_rank)
    try:
        train, held_out = build_datasets(data_config(Path(cache_dir), path=corpus, eval_fraction=0.1), tokenizer())
    finally:
        os.environ["LOCAL_RANK"] = str(dist.get_rank())
    return {
        "path": str(train.data.path),
        "digest": train.data.content_digest,
        "sizes": (len(train), len(held_out)),
        "first_held_out": held_out.texts[0],
    }


def _expect_error(cache_dir: str, corpus_by_rank: list[str]) -> str:
    import torch.distributed as dist

    try:
        build_datasets(data_config(Path(cache_dir), path=corpus_by_rank[dist.get_rank()]), tokenizer())
    except DataError as error:
        return str(error)
    return "no error"


def preparations(cache_dir: Path) -> list[dict]:
    log = cache_dir / LOG_NAME
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_ranks_started_together_on_a_fresh_shared_cache_prepare_once(pool, corpus, tmp_path):
    cache = tmp_path / "shared-cache"
    results = pool.run(_open, str(cache), str(corpus))
    entries = preparations(cache)
    assert len(entries) == 1, entries
    assert entries[0]["rank"] == "0"
    assert all(result == results[0] for result in results)
    assert results[0]["sizes"] == (270, 30)
    assert not list(cache.glob(".tmp-*"))
    # A second start finds the copy: nobody prepares.
    assert pool.run(_open, str(cache), str(corpus)) == results
    assert len(preparations(cache)) == 1


def _open_node_local(root: str, corpus: str) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    return _open(str(Path(root) / f"node{rank // 2}"), corpus, local_rank=rank % 2)


def test_node_local_caches_are_prepared_once_per_node(pool, corpus, tmp_path):
    results = pool.run(_open_node_local, str(tmp_path), str(corpus))
    for node in (0, 1):
        entries = preparations(tmp_path / f"node{node}")
        assert len(entries) == 1, (node, entries)
        assert entries[0]["rank"] == str(2 * node)  # the node's local rank 0
    assert results[0]["path"] != results[2]["path"]  # each node reads its own disk
    assert len({result["digest"] for result in results}) == 1
    assert len({result["first_held_out"] for result in results}) == 1


def test_a_problem_on_one_rank_stops_every_rank_with_its_message(pool, corpus, tmp_path):
    missing = tmp_path / "only-on-rank-3.txt"
    by_rank = [str(corpus)] * (WORLD - 1) + [str(missing)]
    messages = pool.run(_expect_error, str(tmp_path / "cache"), by_rank)
    assert messages == [f"{missing}: data path does not exist"] * WORLD
    # A corpus that fails while rank 0 prepares it: the waiting ranks get rank 0's message.
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"text\x00more")
    messages = pool.run(_expect_error, str(tmp_path / "cache"), [str(binary)] * WORLD)
    assert messages == [f"{binary}: binary data (NUL byte at offset 4), not UTF-8 text"] * WORLD
    assert not list((tmp_path / "cache").glob(".tmp-*")) and len(preparations(tmp_path / "cache")) == 0
