"""parallel-latent: a Perceiver text autoencoder over a frozen GPT-2, trained with
Megatron-style tensor parallelism and DeepSpeed ZeRO.

``from parallel_latent import TextAutoencoder`` is the text-level API (:mod:`parallel_latent.api`),
imported on first use so that the command line starts without loading torch."""

__version__ = "0.1.0"
__all__ = ["Latents", "TextAutoencoder"]


def __getattr__(name: str):
    if name in __all__:
        from parallel_latent import api

        return getattr(api, name)
    raise AttributeError(f"module 'parallel_latent' has no attribute {name!r}")
