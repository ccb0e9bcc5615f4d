"""The Perceiver text autoencoder over a frozen decoder's features (GPT-2 by default)."""

from .autoencoder import AutoencoderOutput, LatentAutoencoder, build_model, eval_mode
from .perceiver import LatentDecoder, PerceiverBlock, PerceiverEncoder

__all__ = [
    "AutoencoderOutput",
    "LatentAutoencoder",
    "LatentDecoder",
    "PerceiverBlock",
    "PerceiverEncoder",
    "build_model",
    "eval_mode",
]
