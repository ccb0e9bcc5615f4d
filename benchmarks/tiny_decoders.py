"""Tiny decoders of each family the tests load, saved as the hub ships them (``save_pretrained``, beside
its own byte-level BPE learnt from the bundled corpus) so that ``feature_model.name_or_path=DIR
tokenizer.name_or_path=feature_model`` loads both (bench_quality.py's ``--tiny-decoder``, the tests)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from benchmarks.harness import BUNDLED

FAMILIES = ("gpt2", "gpt_neox", "llama")
WIDTH, HEADS, KV_HEADS, LAYERS, POSITIONS = 64, 4, 2, 4, 128
TOKENIZER_VOCAB = 512
END = "<|endoftext|>"
# Per family: key/value heads and MLP width (0: the family's default), and the keys its config sets
# otherwise than the random build (Llama: grouped-query attention, an MLP not 4x wide; its saved config
# names a padding token, as SmolLM2's does, set once the weights are drawn: a zero row loses a token).
SHAPES = {"gpt2": (0, 0, {}), "gpt_neox": (0, 3 * WIDTH, {"rotary_pct": 0.5}),
          "llama": (KV_HEADS, 176, {"rope_theta": 500000.0, "tie_word_embeddings": False})}  # fmt: skip


def decoder_config(family: str, vocab_size: int):
    """``family``'s tiny decoder: its random build, its end of text id 0, and the keys of :data:`SHAPES`."""
    from parallel_latent.feature_model.families import FAMILIES as BUILDS

    kv_heads, mlp_width, changes = SHAPES[family]
    built = BUILDS[family].random_config(vocab_size, LAYERS, HEADS, WIDTH, POSITIONS, kv_heads, mlp_width)
    keys = {**built.to_dict(), "bos_token_id": 0, "eos_token_id": 0, **changes}
    keys.pop("rope_parameters", None)  # the build's, which the rope keys above make again
    return type(built)(**keys)


def small_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE of ``TOKENIZER_VOCAB`` tokens learnt from the bundled corpus (id 0: the end of text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=[END], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(BUNDLED.read_text(encoding="utf-8").splitlines(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=END, bos_token=END)


def save_tiny_decoder(directory: Path, family: str, tokenizer: PreTrainedTokenizerFast, seed: int = 0,
                      **changes) -> Path:  # fmt: skip
    """A random ``family`` decoder with an LM head, and ``tokenizer``, saved into ``directory``;
    ``changes``: config keys set otherwise (another decoder under the same family)."""
    config = decoder_config(family, len(tokenizer))
    config.update(changes)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.config.update({"pad_token_id": TOKENIZER_VOCAB - 1} if family == "llama" else {})
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
