"""Tiny decoders of each supported family, saved as the hub ships them: a ``*ForCausalLM`` written by
``save_pretrained`` with its own small byte-level BPE tokenizer beside it (trained with the
``tokenizers`` library on the bundled corpus), so that ``feature_model.name_or_path=DIR
tokenizer.name_or_path=feature_model`` loads both from the directory, as for a real Pythia or Llama;
and a hub cache holding such directories under hub names, read offline (no network here)."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

import parallel_latent

CORPUS = Path(parallel_latent.__file__).parent / "corpus" / "austen_pride_and_prejudice.txt"
FAMILIES = ("gpt2", "gpt_neox", "llama")
WIDTH, HEADS, KV_HEADS, LAYERS, POSITIONS = 64, 4, 2, 4, 128
TOKENIZER_VOCAB = 512
END = "<|endoftext|>"


def _config(family: str, vocab_size: int):
    if family == "gpt2":
        return GPT2LMHeadModel, GPT2Config(
            vocab_size=vocab_size, n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH, n_positions=POSITIONS,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    if family == "gpt_neox":
        return GPTNeoXForCausalLM, GPTNeoXConfig(
            vocab_size=vocab_size, num_hidden_layers=LAYERS, num_attention_heads=HEADS, hidden_size=WIDTH,
            intermediate_size=3 * WIDTH, max_position_embeddings=POSITIONS, rotary_pct=0.5, bos_token_id=0,
            eos_token_id=0,
        )  # fmt: skip
    # Grouped-query attention and an MLP width that is not 4x: the Llama-family shapes people load.
    return LlamaForCausalLM, LlamaConfig(
        vocab_size=vocab_size, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        hidden_size=WIDTH, intermediate_size=176, max_position_embeddings=POSITIONS, rope_theta=500000.0,
        bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip


def small_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE of ``TOKENIZER_VOCAB`` tokens learnt from the bundled corpus (id 0: the end
    of text), as ``transformers`` would load one from a model's directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, special_tokens=[END], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator(CORPUS.read_text(encoding="utf-8").splitlines(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=END, bos_token=END)


def save_tiny_decoder(
    directory: Path, family: str, tokenizer: PreTrainedTokenizerFast, seed: int = 0, **changes
) -> Path:
    """A random ``family`` decoder with an LM head, and ``tokenizer``, saved into ``directory``;
    ``changes``: config keys set otherwise (another decoder under the same family)."""
    model_class, config = _config(family, len(tokenizer))
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model_class(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


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
