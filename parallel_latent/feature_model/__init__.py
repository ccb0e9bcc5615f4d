"""Where the features come from: the frozen decoder (one of :mod:`.families`, by hub name, directory,
package or GGUF file, cut to the layers its hidden state needs, replicated or sharded over the TP
group), its tokenizer, and the cache of its features (:mod:`.cache`), computed once per sample."""

from .features import FeatureModel, load_decoder, truncate_to_hidden_state

__all__ = ["FeatureModel", "load_decoder", "truncate_to_hidden_state"]
