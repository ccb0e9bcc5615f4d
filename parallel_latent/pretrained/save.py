"""``save_pretrained``: an autoencoder written as a pretrained directory (:mod:`.directory`), from any TP
degree. The weights go through the checkpoint package's public functions (``save_portable`` from
any TP degree, then ``consolidate``), so loading at any TP degree is the portable loader's.
"""

from __future__ import annotations

import json
from pathlib import Path

from parallel_latent import __version__
from parallel_latent.checkpoint import (
    CheckpointError,
    consolidate,
    discard,
    publish,
    require_empty_output,
    save_portable,
)
from parallel_latent.coordination import barrier, broadcast_value, is_main
from parallel_latent.errors import first_line
from parallel_latent.feature_model.tokenizer import tokenizer_facts

from .card import build_model_card
from .directory import CARD_FILE, CONFIG_FILE, LIBRARY, PRETRAINED_FORMAT, PRETRAINED_FORMAT_VERSION
from .record import TrainingRecord, training_record

__all__ = ["save_pretrained"]


def _write_pretrained(shards: Path, staging: Path, autoencoder, record: TrainingRecord, name: str, repo_id) -> None:
    """One process: the TP shards in ``shards`` become the pretrained layout in ``staging``."""
    consolidate(shards, staging)
    consolidated = json.loads((staging / CONFIG_FILE).read_text(encoding="utf-8"))
    config = {
        "format": PRETRAINED_FORMAT,
        "format_version": PRETRAINED_FORMAT_VERSION,
        "library_name": LIBRARY,
        "library_version": __version__,
        **consolidated,
        "training": record.to_dict(),
    }
    (staging / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    autoencoder.tokenizer.save_pretrained(str(staging))
    build_model_card(config, record, name, repo_id).save(staging / CARD_FILE)


def save_pretrained(
    autoencoder, directory: str | Path, *, record: TrainingRecord | None = None, repo_id: str | None = None
) -> Path:
    """Write ``autoencoder`` (a :class:`parallel_latent.api.TextAutoencoder`) as a pretrained
    directory (see :mod:`.directory`); ``record`` defaults to what its source checkpoint says, and the
    latents' statistics recorded are the autoencoder's (``latent_stats``).

    Under a process group it is collective: every rank calls it (each TP rank contributes its
    slices; global rank 0 assembles and publishes). ``directory`` must be new or empty; the files
    appear under it all at once (staged next to it, then renamed)."""
    output = Path(directory)
    require_empty_output(output)  # every rank decides the same on the shared file system
    record = record or training_record(getattr(autoencoder, "source", None))
    model = autoencoder.model
    work = output.with_name(f".{output.name}.save-pretrained")
    if is_main():
        discard(work)  # a save that died half-way
    barrier()
    failure = None
    try:
        # Collective, and it agrees on a failure: every rank raises, none waits for rank 0.
        shards = save_portable(
            model,
            work / "shards",
            record.config,
            tokenizer_facts(autoencoder.tokenizer),
            getattr(model, "tp_group", None),
            step=record.steps,
            record_keywords={"latent_stats": getattr(autoencoder, "latent_stats", None)},
        )
        if is_main():
            try:
                staging = work / "pretrained"
                _write_pretrained(shards, staging, autoencoder, record, repo_id or output.name, repo_id)
                publish(staging, output)  # fsynced, then renamed over the empty or missing output
            except (OSError, ValueError) as error:
                failure = error
    finally:
        if is_main():
            discard(work)
    message = broadcast_value(None if failure is None else first_line(failure))
    if failure is not None:
        raise failure
    if message is not None:
        raise CheckpointError(f"{output}: rank 0 could not write it: {message}")
    return output
