"""The Perceiver text autoencoder over frozen GPT-2 features (DESIGN.md section 2)."""
from .autoencoder import AutoencoderOutput, LatentAutoencoder, build_model, reconstruct_texts
from .features import FeatureModel, load_gpt2, truncate_to_hidden_state
from .perceiver import LatentDecoder, PerceiverBlock, PerceiverEncoder

__all__ = ["LatentAutoencoder", "AutoencoderOutput", "build_model", "reconstruct_texts", "FeatureModel",
           "load_gpt2", "truncate_to_hidden_state", "PerceiverEncoder", "LatentDecoder", "PerceiverBlock"]
