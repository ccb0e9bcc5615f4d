"""parallel-latent: a Perceiver text autoencoder over a frozen GPT-2, trained with
Megatron-style tensor parallelism and DeepSpeed ZeRO."""

__version__ = "0.1.0"
