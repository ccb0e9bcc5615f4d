"""Model FLOPs and the peak device figures behind MFU: the FLOP count of one training sample from the
config, the dense peak throughput of a device, and a process's peak memory.
"""

from __future__ import annotations

import math
import os
import resource
import sys

import torch

from parallel_latent.config import Config

__all__ = [
    "PEAK_FLOPS_ENV",
    "gpu_peak_flops",
    "model_flops_per_sample",
    "peak_flops_per_device",
    "peak_memory_bytes",
]

PEAK_FLOPS_ENV = "PARALLEL_LATENT_PEAK_FLOPS"


def model_flops_per_sample(
    cfg: Config, feature_blocks: int | None = None, feature_width: int | None = None, feature_weights: int | None = None
) -> dict[str, float]:
    """Model FLOPs of one training sample (T positions), from the config.

    Conventions (those of the PaLM / Megatron "model FLOPs utilisation"):

    * a multiply-add is 2 FLOPs; only matrix products are counted (norms, GELU, softmax,
      dropout, the loss are noise at these widths);
    * training costs **3x the forward** for trainable parts (forward 2N, backward 4N per token:
      the "6N" rule) and **1x the forward** for the frozen feature model, which runs without an autograd
      graph; activation recomputation is *not* counted (it is overhead, not model work);
    * padding positions are counted: the model computes on all T positions.

    Per sample, with d = model.d_model, T = model.max_length, r = model.mlp_ratio, V the
    tokenizer's vocabulary, f = feature_model.n_embd, and n = feature_model.n_layer - 2 layers of the
    feature model actually run (hidden state -3):

    * one Perceiver block of Q queries over C context rows (keys/values: the context concatenated
      with the stream, C + Q): q and output projections 2 * 2*Q*d^2, k and v projections
      2 * 2*(C + Q)*d^2, scores and weighted sum 2 * 2*Q*(C + Q)*d, MLP 2 * 2*Q*d*(r*d); an
      encoder block has Q = N latents (``model.num_latents``, T by default) and C = T, a decoder
      block Q = T and C = N; at N = T that is (12 + 4r) * T * d^2 + 8 * T^2 * d;
    * the bottleneck (``model.latent_dim`` = k < d): 2 * N*d*k on each side;
    * the query MLP (d -> r*d -> d): 4r * T * d^2 when it runs per position (training with
      dropout: each query draws its own mask); otherwise it runs once per micro-batch on the one
      mask vector, 4r * d^2 / micro_batch_size per sample;
    * the vocabulary head: 2 * T * d * V; the ``nearest`` head reads r = N * k / T features of the d
      and scores in r dimensions, 2 * T * d * r + 2 * T * r * V, against the codes of the whole table,
      computed once per micro-batch, 2 * V * d * r / micro_batch_size per sample;
    * one feature-model layer of W matrix-product weights (width f, causal attention counted in
      full): 2 * T * W + 4 * T^2 * f; a GPT-2 block (MLP ratio 4) has W = 12 f^2.

    ``feature_blocks``, ``feature_width`` and ``feature_weights`` (W summed over the layers that run)
    are those of the decoder actually loaded (a pretrained one has its own widths, a Llama its gated
    MLP and grouped-query attention, whatever the YAML says); by default ``n_layer - 2``, ``n_embd``
    and GPT-2's W of the config.

    ``train = 3 * trainable_forward + frozen_forward`` (if the feature model is configured
    trainable, it moves to the first term), less one forward of what reads the frozen token table
    (the tied head's product, the nearest head's codes): its backward computes the other operand's
    gradient only (2x, not 3x).  The returned dict also holds the parts.
    """
    model, feature = cfg.model, cfg.feature_model
    d, t, r = model.d_model, model.max_length, model.mlp_ratio
    n, k = model.latent_count, model.latent_width
    f = feature.n_embd if feature_width is None else feature_width
    blocks = max(0, feature.n_layer - 2) if feature_blocks is None else feature_blocks
    weights = blocks * 12 * f * f if feature_weights is None else feature_weights
    query_rows = t if model.dropout > 0 else 1 / max(1, cfg.training.micro_batch_size)

    def block_linear(queries: int, context: int) -> int:
        return (4 + 4 * r) * queries * d * d + 4 * (context + queries) * d * d

    linear = model.n_encoder_layers * block_linear(n, t) + model.n_decoder_layers * block_linear(t, n)
    attention = (model.n_encoder_layers * n + model.n_decoder_layers * t) * 4 * (t + n) * d
    parts = {
        "perceiver_linear": float(linear),
        "perceiver_attention": float(attention),
        "bottleneck": float(4 * n * d * k if model.has_bottleneck else 0),
        "query_mlp": float(4 * r * query_rows * d * d),
        "feature_window": float(2 * t * model.feature_window * f * f if model.feature_window > 1 else 0),
        "head": float(2 * t * d * model.vocab_size),
        "head_codes": 0.0,
        "feature_linear": float(2 * t * weights),
        "feature_attention": float(blocks * 4 * t * t * f),
    }
    head = getattr(model, "head", "normal")
    if head == "nearest":
        rank = max(1, n * k // t)
        parts["head"] = float(2 * t * d * rank + 2 * t * rank * model.vocab_size)
        parts["head_codes"] = float(2 * model.vocab_size * d * rank / max(1, cfg.training.micro_batch_size))
    perceiver = parts["perceiver_linear"] + parts["perceiver_attention"] + parts["bottleneck"]
    perceiver += parts["query_mlp"] + parts["feature_window"] + parts["head"] + parts["head_codes"]
    features = parts["feature_linear"] + parts["feature_attention"]
    table_read = {"tied": parts["head"], "nearest": parts["head_codes"]}.get(head, 0.0) if feature.frozen else 0.0
    if feature.frozen:
        trainable_forward, frozen_forward = perceiver, features
    else:
        trainable_forward, frozen_forward = perceiver + features, 0.0
    return {
        **parts,
        "trainable_forward": trainable_forward,
        "frozen_forward": frozen_forward,
        "train": 3 * trainable_forward + frozen_forward - table_read,
    }


# Dense (no sparsity) peak FLOP/s per device, by dtype.  fp32 means plain fp32 (PyTorch does not
# use TF32 for matmuls by default).  Matched by substring of torch.cuda.get_device_name().
# More specific names come first: "H100 NVL" before "H100". The NVL parts (PCIe cards bridged in
# pairs) have their own, lower clocks: 1,671 TFLOP/s bf16 *with sparsity*, so 835 dense.
PEAK_FLOPS_TABLE: list[tuple[str, dict[str, float]]] = [
    ("H200 NVL", {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12}),
    ("H100 NVL", {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12}),
    ("H200", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12}),
    ("H100", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("GH200", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12}),
    ("A10G", {"bf16": 70e12, "fp16": 70e12, "fp32": 31.2e12}),
    ("A10", {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12}),
    ("L4", {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12}),
    ("V100", {"bf16": 15.7e12, "fp16": 125e12, "fp32": 15.7e12}),
    ("MI300X", {"bf16": 1307e12, "fp16": 1307e12, "fp32": 163e12}),
]
# CPU assumption: 32 fp32 FLOP per cycle per core (two 256-bit FMA units, AVX2) at 3 GHz, times
# the threads the rank computes with.  A rough upper bound for a modern x86 core, stated so the
# MFU figure can be read; set PARALLEL_LATENT_PEAK_FLOPS for a measured or vendor figure.
CPU_FLOPS_PER_CORE = 32 * 3.0e9


def peak_flops_per_device(device: str, precision: str, env: dict | None = None) -> tuple[float, str]:
    """(peak FLOP/s of one rank's device, where the number comes from).

    ``PARALLEL_LATENT_PEAK_FLOPS`` (FLOP/s per device) overrides everything.  Returns
    ``(nan, reason)`` for an unknown GPU, so MFU is reported as null rather than invented.
    """
    env = os.environ if env is None else env
    if env.get(PEAK_FLOPS_ENV):
        return float(env[PEAK_FLOPS_ENV]), f"${PEAK_FLOPS_ENV}"
    if device == "cuda" and torch.cuda.is_available():
        return gpu_peak_flops(torch.cuda.get_device_name(), precision)
    threads = torch.get_num_threads()
    per_cycle = 16 if precision == "fp64" else 32  # a 256-bit FMA holds 4 doubles or 8 floats
    return CPU_FLOPS_PER_CORE * per_cycle / 32 * threads, (
        f"CPU assumption: {threads} thread(s) x {per_cycle} FLOP/cycle x 3 GHz"
    )


def gpu_peak_flops(name: str, precision: str) -> tuple[float, str]:
    """(dense peak FLOP/s, source) of the GPU called ``name`` (torch.cuda.get_device_name())."""
    for key, by_dtype in PEAK_FLOPS_TABLE:
        if key in name:
            if precision not in by_dtype:
                return math.nan, f"table: {key} has no {precision} peak: set ${PEAK_FLOPS_ENV}"
            return by_dtype[precision], f"table: {key} {precision}"
    return math.nan, f"unknown GPU {name!r}: set ${PEAK_FLOPS_ENV}"


def peak_memory_bytes(device: str) -> tuple[int, str]:
    """(peak memory of this process so far, what was measured): the CUDA caching allocator's
    peak of allocated bytes on a GPU, the peak resident set size on CPU."""
    if device == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated()), "cuda_max_allocated"
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(max_rss if sys.platform == "darwin" else max_rss * 1024), "cpu_max_rss"
