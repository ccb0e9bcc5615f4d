"""The Perceiver text autoencoder over frozen GPT-2 features."""

from .autoencoder import AutoencoderOutput, LatentAutoencoder, build_model, eval_mode
from .features import FeatureModel, load_gpt2, truncate_to_hidden_state
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
    "load_gpt2",
    "truncate_to_hidden_state",
]
