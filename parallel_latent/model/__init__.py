"""The Perceiver text autoencoder over a frozen decoder's features (GPT-2 by default)."""

from .autoencoder import AutoencoderOutput, LatentAutoencoder, build_model, eval_mode
from .features import FeatureModel, load_decoder, truncate_to_hidden_state
from .perceiver import LatentDecoder, PerceiverBlock, PerceiverEncoder

__all__ = [
    "AutoencoderOutput",
    "FeatureModel",
    "LatentAutoencoder",
    "LatentDecoder",
    "PerceiverBlock",
    "PerceiverEncoder",
    "build_model",
    "eval_mode",
    "load_decoder",
    "truncate_to_hidden_state",
]
