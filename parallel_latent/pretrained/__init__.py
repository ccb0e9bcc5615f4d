"""Sharing a trained autoencoder the Hugging Face way: a model repository's layout on disk,
``from_pretrained`` from a directory or a hub repository id, ``push_to_hub``.

- :mod:`.directory`: the files of a pretrained directory and its ``config.json``;
- :mod:`.record`: how the weights were trained (config, steps, held-out evaluation);
- :mod:`.card`: the model card;
- :mod:`.save`: ``save_pretrained`` from any TP degree;
- :mod:`.sharing`: a directory by path or hub repository id, and pushing one.
"""

from .card import build_model_card
from .directory import CARD_FILE, CONFIG_FILE, PRETRAINED_FORMAT, PRETRAINED_FORMAT_VERSION, read_pretrained_config
from .record import BUNDLED_CORPUS, LATENT_METRICS, METRICS, TrainingRecord, latent_figures, training_record
from .save import save_pretrained
from .sharing import hub_repo_id, pretrained_directory, push_directory_to_hub, push_to_hub

__all__ = [
    "BUNDLED_CORPUS",
    "CARD_FILE",
    "CONFIG_FILE",
    "LATENT_METRICS",
    "METRICS",
    "PRETRAINED_FORMAT",
    "PRETRAINED_FORMAT_VERSION",
    "TrainingRecord",
    "build_model_card",
    "hub_repo_id",
    "latent_figures",
    "pretrained_directory",
    "push_directory_to_hub",
    "push_to_hub",
    "read_pretrained_config",
    "save_pretrained",
    "training_record",
]
