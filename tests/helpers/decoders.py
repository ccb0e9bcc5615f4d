"""Tiny decoders of each supported family, saved as the hub ships them (benchmarks/tiny_decoders.py,
which bench_quality.py's ``--tiny-decoder`` shares), their rounding bound, and a hub cache holding
such directories under hub names, read offline (no network here)."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

from benchmarks.harness import BUNDLED as CORPUS  # noqa: F401 (the tests take these from here)
from benchmarks.tiny_decoders import FAMILIES, HEADS, LAYERS, WIDTH, save_tiny_decoder, small_tokenizer  # noqa: F401


def reduction_length(family: str, length: int, layers: int) -> int:
    """Terms summed on the path through ``layers`` layers of a tiny ``family`` decoder: two norms,
    q/k/v, scores (head width), softmax and weighted sums (T each), the output projection, the MLP's
    two (three, gated) products, and 16 roundings for elementwise activations and rotary steps."""
    mlp = {"gpt2": 4 * WIDTH, "gpt_neox": 3 * WIDTH, "llama": 2 * 176}[family]
    return layers * (2 * WIDTH + WIDTH + WIDTH // HEADS + 2 * length + WIDTH + WIDTH + mlp + 16)


HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"  # any 40 hex digits: a snapshot's name


def into_hub_cache(cache: Path, name: str, directory: Path) -> Path:
    """``directory``'s files put where ``huggingface_hub`` finds hub model ``name`` (``org/model``)
    once downloaded into ``cache``: ``models--org--model/snapshots/<commit>/`` and ``refs/main``
    naming that commit. (A real cache links the snapshot's files to ``blobs/``; plain files read alike.)"""
    repo = cache / f"models--{name.replace('/', '--')}"
    shutil.copytree(directory, repo / "snapshots" / HUB_COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HUB_COMMIT)
    return repo


@contextlib.contextmanager
def offline_hub(cache: Path) -> Iterator[None]:
    """Inside the block ``huggingface_hub`` (and ``transformers`` through it) reads ``cache`` as the
    hub cache and never the network (``HF_HUB_OFFLINE=1``). Both are read from
    ``huggingface_hub.constants`` at each call (the environment variables only when it is first
    imported, long before a test or a pool's rank runs), so they are set there, and put back after:
    a pool's ranks run other modules' tasks next."""
    from huggingface_hub import constants

    saved = constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE
    constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE = str(cache), True
    try:
        yield
    finally:
        constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE = saved
