"""The performance model behind the projected figures: what one H200 is taken to do (the pinned
roofline and its pessimistic range, NVLink, the MFU peak from ``parallel_latent/training/flops.py``'s
table), the goals, the kernels CUDA launches for a traced operator (benchmarks/step_trace.py) and
their cost, the step of configs/gpt2.yaml projected from its trace, and the frozen feature model at
realistic sizes (built on the meta device from published configs).

Pinned rules, so that figures stay comparable from change to change:

* MFU against 989 TFLOP/s dense bf16, with ``training/flops.py``'s model FLOPs (the traced matmul FLOPs
  equal them within 1%: a test);
* a matmul takes max(FLOPs / 700 TFLOP/s above 20 GFLOP, or / 593 TFLOP/s below; bytes / 4.0 TB/s);
  every other kernel bytes / 4.0 TB/s; no kernel less than 2 us of device time (a kernel's launch
  to retirement on the device, however little it touches); 5 us of host time per launch (eager;
  none inside a CUDA graph);
* the kernels an operator launches on CUDA: one, except where :data:`CUDA_KERNELS` says (an
  operator whose CUDA implementation is several kernels), a multi-tensor operator (``_foreach_*``,
  fused AdamW) as many as torch's ``multi_tensor_apply`` launches for its tensors
  (:func:`multi_tensor_launches`), a ``cat`` one per 128 inputs, and none for an operator that
  only makes a host scalar;
* a region compiled with torch.compile is one kernel per run of consecutive non-matmul,
  non-collective operators between matmuls and collectives, whose bytes are the run's external
  inputs and outputs only; a scatter (an indexed write) and an operator of several CUDA kernels
  end the run (inductor materialises around them);
* per row: device + launch time summed, and the overlapped max of the two; the top ten costs.

What the CPU trace cannot show, and is added here (:func:`cuda_only`): the micro-batch's
host-to-device copies (on a CPU the batch is already where the model is). What is left out: the
CUDA caching allocator (no kernels), NCCL's internal work at DP=1 (there is no collective), cuBLAS
split-K reductions (none at these shapes is assumed) and the compiled regions' autotuning.

The frozen pass of a decoder of :data:`MODELS` per rank is a roofline with the same constants: per
layer, its matrix products (FLOPs over the matmul rate, or the weights read over the bandwidth,
whichever is longer) and causal attention (4 T^2 f FLOPs per sample, counted in full); collectives
at ``NVLINK`` bytes/s per direction in a ring (all-reduce 2 (n-1)/n of the bytes, all-gather
(n-1)/n) plus ``COLLECTIVE_LATENCY`` each. Kernel launches and elementwise work are left out (the
same in both layouts). Each decoder is cut to hidden state -3 as the trainer cuts it
(``model/features.py``), its parameters counted by name: a held layer's matrices are what ``shard``
splits, the rest (token table, norms) stays whole on every rank. Bytes are bf16.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

from benchmarks.step_trace import (
    Op,
    fake_tp_group,
    real_step,
    real_step_on_ranks,
    real_step_overrides,
    row_config,
    trace_model,
)
from parallel_latent.training.flops import gpu_peak_flops

PEAK_FLOPS = gpu_peak_flops("H200", "bf16")[0]  # dense bf16, the MFU denominator
BIG_MATMUL_FLOPS = 20e9  # a matmul above this many FLOPs runs at the big rate


@dataclasses.dataclass(frozen=True)
class Roofline:
    """What one H200 is taken to do: matmul rates above and below BIG_MATMUL_FLOPS, memory bandwidth
    (bytes/s), host time per eager kernel launch (the project captures no CUDA graph: every kernel is
    launched), device time of the smallest kernel."""

    big_matmul_rate: float
    small_matmul_rate: float
    bandwidth: float
    launch_s: float
    min_kernel_s: float


# The pinned figures (comparable from change to change), and the low end of what H100/H200 reports
# show for each assumption: cuBLAS at K or N = 768 (550 / 450 TFLOP/s), 3.3 TB/s of HBM, 10 us per
# eager launch. The smallest kernel's time is the same in both.
PINNED = Roofline(big_matmul_rate=700e12, small_matmul_rate=593e12, bandwidth=4.0e12, launch_s=5e-6, min_kernel_s=2e-6)
PESSIMISTIC = Roofline(big_matmul_rate=550e12, small_matmul_rate=450e12, bandwidth=3.3e12, launch_s=10e-6,
                       min_kernel_s=2e-6)  # fmt: skip
# Each assumption of the range: the constants it moves from PINNED to PESSIMISTIC.
ASSUMPTIONS = {"matmul rate": ("big_matmul_rate", "small_matmul_rate"), "bandwidth": ("bandwidth",),
               "launch cost": ("launch_s",)}  # fmt: skip

NVLINK = 450e9  # H200 NVLink: 900 GB/s both directions together
COLLECTIVE_LATENCY = 10e-6


def pessimistic_in(assumption: str) -> Roofline:
    """PINNED with one assumption's constants at their pessimistic values."""
    return dataclasses.replace(PINNED, **{name: getattr(PESSIMISTIC, name) for name in ASSUMPTIONS[assumption]})


# The goals (an H200, TP=1, bf16): the overlapped MFU at dropout 0.1, projected (bench_projection.py)
# and measured (bench_gpu.py); DeepSpeed's backward work + its step per DP size; Python hook calls.
MFU_GOALS = {"default": 0.43, "compile": 0.50, "micro32": 0.30}
DEEPSPEED_KERNEL_GOALS = {1: 250, 2: 300}
HOOK_CALL_GOAL = 20

# Operators whose CUDA implementation launches more than one kernel, and what they are.
CUDA_KERNELS = {
    "aten.native_layer_norm_backward.default": (2, "the input gradient, then the weight and bias gradients' "
                                                "reduction over rows"),
    "aten._scaled_dot_product_efficient_attention_backward.default": (2, "the row sums of dO * O (delta), then "
                                                                      "the backward kernel"),
    "aten.embedding_dense_backward.default": (6, "a sort of the indices, the segment offsets and sizes, partial "
                                              "sums per segment, their reduction into the table"),
    "aten._foreach_norm.Scalar": (None, "multi_tensor_apply's launches, then one cleanup kernel"),
}  # fmt: skip
SCATTERS = ("aten.index_put", "aten._index_put_impl_", "aten.index_add", "aten.scatter", "aten.index_copy")
# torch's multi_tensor_apply: per launch at most this many tensors (by the number of tensor lists
# the operator takes) and 320 blocks of 65536 elements.
MULTI_TENSOR_LISTS = {"aten._foreach_copy_": 2, "aten._foreach_norm": 1, "aten._foreach_zero_": 1,
                      "aten._foreach_add_": 1, "aten._foreach_mul_": 1, "aten._fused_adamw_": 4}  # fmt: skip
MAX_TENSORS = {1: 110, 2: 64, 3: 48, 4: 36, 5: 30}
MAX_BLOCKS, CHUNK = 320, 65536


# --------------------------------------------------------------------------- #
# Kernels of an operator.
# --------------------------------------------------------------------------- #


def multi_tensor_launches(numels: list[int], lists: int) -> int:
    """Kernel launches of torch's CUDA ``multi_tensor_apply`` over tensors of ``numels`` elements
    with ``lists`` tensor lists: a launch whenever its tensor or block table fills, and at the end."""
    launches, tensors, blocks = 0, 0, 0
    live = [n for n in numels if n > 0]
    for index, numel in enumerate(live):
        tensors += 1
        chunks = math.ceil(numel / CHUNK)
        for chunk in range(chunks):
            blocks += 1
            last = index == len(live) - 1 and chunk == chunks - 1
            if blocks == MAX_BLOCKS or tensors == MAX_TENSORS[lists] or last:
                launches += 1
                blocks = 0
                tensors = 0 if chunk == chunks - 1 else 1  # a tensor split over launches starts the next
    return launches


def kernels_per_op(op: Op) -> int:
    """The kernels CUDA launches for one traced operator."""
    if op.host:
        return 0
    base = op.name.rsplit(".", 1)[0]
    if base in MULTI_TENSOR_LISTS:
        extra = 1 if base == "aten._foreach_norm" else 0
        return multi_tensor_launches(op.tensors, MULTI_TENSOR_LISTS[base]) + extra
    if base == "aten.cat":
        return max(1, math.ceil(len(op.reads) / 128))
    if op.name.startswith("aten._local_scalar_dense"):
        return 0  # a device-to-host copy: a synchronisation, reported apart
    return CUDA_KERNELS.get(op.name, (1, ""))[0] or 1


# --------------------------------------------------------------------------- #
# The roofline.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class Kernel:
    label: str  # what it is, for the top ten
    device_s: float
    flops: float
    part: str = "model"
    collective: bool = False  # a TP collective of a trace at TP > 1 (the whole step times it over NVLink)


def matmul_seconds(flops: float, nbytes: int, roofline: Roofline = PINNED) -> float:
    rate = roofline.big_matmul_rate if flops > BIG_MATMUL_FLOPS else roofline.small_matmul_rate
    return max(flops / rate, nbytes / roofline.bandwidth)


def _distinct_bytes(accesses) -> int:
    """Bytes of the views ``accesses`` touch, each element once: per tensor, the union of the
    views' element ranges (no more than their elements)."""
    by_storage = defaultdict(list)
    for storage, view, nbytes in accesses:
        by_storage[storage].append((view, nbytes))
    total = 0
    for views in by_storage.values():
        ranges = sorted((first, first + span) for (first, span, _), _ in views)
        covered, end = 0, None
        for start, stop in ranges:
            start = start if end is None else max(start, end)
            covered += max(0, stop - start)
            end = stop if end is None else max(end, stop)
        element = views[0][0][2]
        total += min(covered * element, sum(nbytes for _, nbytes in views))
    return total


def _fused_run(run: list[Op], later_reads: set[int]) -> int:
    """Bytes of one fused kernel: what it reads of the tensors it did not write, and what it writes
    of the tensors that someone after it reads."""
    written = {storage for op in run for storage, *_ in op.writes}
    inputs = [access for op in run for access in op.reads if access[0] not in written]
    outputs = [access for op in run for access in op.writes if access[0] in later_reads]
    return _distinct_bytes(inputs) + _distinct_bytes(outputs)


def _fusible(op: Op) -> bool:
    """Whether a compiled region's inductor code can fuse ``op`` with its neighbours."""
    return (
        op.region is not None
        and op.kind == "other"
        and not op.name.startswith(SCATTERS)
        and kernels_per_op(op) == 1
        and not op.host
    )


# Operators that read only the rows or elements their indices name, not the whole of their source.
GATHERS = ("aten.gather", "aten.index_select", "aten.embedding.", "aten.index.Tensor")


def op_bytes(op: Op) -> int:
    """Bytes an eager kernel moves: every operand read and written, except a gather's source, of which
    it reads as many elements as it writes."""
    if not op.name.startswith(GATHERS):
        return op.bytes
    source, *others = op.reads
    written = sum(b for *_, b in op.writes)
    return min(source[2], written) + sum(b for *_, b in others) + written


def kernels_of(ops: list[Op], roofline: Roofline = PINNED) -> list[Kernel]:
    """The kernels a traced op list launches under the pinned rules, timed by ``roofline``."""
    reads_after: list[set[int]] = [set() for _ in ops]  # storage keys read by ops after index i
    seen: set[int] = set()
    for i in range(len(ops) - 1, -1, -1):
        reads_after[i] = set(seen)
        seen.update(storage for storage, *_ in ops[i].reads)
    kernels, run, run_region = [], [], None

    def close_run(end: int) -> None:
        if run:
            nbytes = _fused_run(run, reads_after[end])
            seconds = max(nbytes / roofline.bandwidth, roofline.min_kernel_s)
            kernels.append(Kernel(f"{run_region[0]} (fused)", seconds, 0.0, run[0].part))
            run.clear()

    for i, op in enumerate(ops):
        fusible = _fusible(op)
        if run and (not fusible or op.region != run_region):
            close_run(i - 1)
        if fusible:
            run_region = op.region
            run.append(op)
            continue
        count = kernels_per_op(op)
        if count == 0:
            continue
        if op.kind == "matmul":
            seconds = matmul_seconds(op.flops, op.bytes, roofline)
        else:
            seconds = op_bytes(op) / roofline.bandwidth
        label = f"{op.name} [{op.phase if op.phase != 'step' else op.part}]"
        # The bytes spread over the kernels, each no shorter than the minimum.
        kernel = Kernel(label, max(seconds / count, roofline.min_kernel_s), op.flops / count, op.part)
        kernel.collective = op.kind == "collective"
        kernels += [kernel] * count
    close_run(len(ops) - 1)
    return kernels


def cuda_only(cfg, roofline: Roofline = PINNED) -> list[Kernel]:
    """What CUDA runs that a CPU trace cannot show: the micro-batch's ids and mask copied to the
    device (pinned host memory, one copy each)."""
    nbytes = cfg.training.micro_batch_size * cfg.model.max_length * 8  # int64
    seconds = max(nbytes / roofline.bandwidth, roofline.min_kernel_s)
    copy = Kernel("host-to-device copy of the batch [step]", seconds, 0.0, "trainer")
    return [copy] * 2


def projection(kernels: list[Kernel], model_flops: float, roofline: Roofline = PINNED) -> dict:
    device = sum(k.device_s for k in kernels)
    launch = roofline.launch_s * len(kernels)
    overlapped, summed = max(device, launch), device + launch
    return {
        "step_ms_overlapped": overlapped * 1e3,
        "step_ms_summed": summed * 1e3,
        "mfu_overlapped": model_flops / overlapped / PEAK_FLOPS if overlapped else 0.0,
        "mfu_summed": model_flops / summed / PEAK_FLOPS if summed else 0.0,
        "device_ms": device * 1e3,
        "launch_ms": launch * 1e3,
        "kernels": len(kernels),
    }


def top_costs(kernels: list[Kernel], n: int = 10) -> list[tuple[str, float, int]]:
    """(label, device + launch ms, kernels) of the ``n`` biggest kinds of kernel."""
    totals, counts = defaultdict(float), Counter()
    for k in kernels:
        totals[k.label] += k.device_s + PINNED.launch_s
        counts[k.label] += 1
    ranked = sorted(totals, key=totals.get, reverse=True)[:n]
    return [(label, totals[label] * 1e3, counts[label]) for label in ranked]


def block_activation_bytes(b: int, s: int, c: int, h: int, a: int, t: int, sp: bool) -> int:
    """Bytes an encoder block saves for backward per rank (fp32, dropout on), tensor by tensor:
    the three LayerNorms' inputs and statistics (stream, context, MLP), the region entries'
    (gathered) inputs, q/k/v with the log-sum-exp and the key mask, the output projection's input,
    GELU's input, the hidden dropout mask and output, the two output dropout masks (bool).
    Sequence parallelism divides what lives between the regions (LayerNorm inputs and statistics,
    output dropout masks) by t; the region entries keep the gathered input (Megatron all-gathers it
    again in backward instead, which would save that too at the price of a second all-gather)."""
    between = 1 / t if sp else 1
    lns = 4 * b * (s + c + s) * h * between + 8 * b * (s + c + s) * between  # inputs + mean/rstd
    entries = 4 * b * (c + s) * h + 4 * b * s * h  # attention's cat(context, stream), the MLP's input
    attention = 4 * b * (s + 2 * (c + s)) * h / t + 4 * b * (a // t) * s + 4 * b * (c + s)  # q, k, v; lse; mask
    projection_in = 4 * b * s * h / t
    mlp = 4 * b * s * 4 * h / t + b * s * 4 * h / t + 4 * b * s * 4 * h / t  # GELU in, mask, dropout out
    masks = 2 * b * s * h * between  # attention and MLP output dropout (bool)
    return int(lns + entries + attention + projection_in + mlp + masks)


# --------------------------------------------------------------------------- #
# The frozen feature model at realistic sizes, on meta.
# --------------------------------------------------------------------------- #

BYTES = 2  # bf16
TP_DEGREES = (1, 2, 4, 8)

# Published config.json figures (hidden, layers, heads, kv heads, MLP width, vocabulary, positions).
MODELS = {
    "gpt2 (124M)": ("gpt2", 768, 12, 12, 12, 3072, 50257, 1024),
    "gpt2-xl (1.5B)": ("gpt2", 1600, 48, 25, 25, 6400, 50257, 1024),
    "pythia-1.4b": ("gpt_neox", 2048, 24, 16, 16, 8192, 50304, 2048),
    "pythia-6.9b": ("gpt_neox", 4096, 32, 32, 32, 16384, 50432, 2048),
    "llama-3.2-1b": ("llama", 2048, 16, 32, 8, 8192, 128256, 131072),
    "mistral-7b": ("llama", 4096, 32, 32, 8, 14336, 32000, 32768),
    "llama-3.1-8b": ("llama", 4096, 32, 32, 8, 14336, 128256, 131072),
    "qwen2.5-7b": ("llama", 3584, 28, 28, 4, 18944, 152064, 32768),
    "llama-3.1-70b": ("llama", 8192, 80, 64, 8, 28672, 128256, 131072),
}
QUICK_MODELS = ("gpt2 (124M)", "pythia-1.4b", "llama-3.2-1b")


def transformers_config(family: str, hidden, layers, heads, kv_heads, mlp, vocab, positions):
    """The published shape as its family's own config mapping builds it."""
    from parallel_latent.model.families import FAMILIES

    return FAMILIES[family].random_config(vocab, layers, heads, hidden, positions, kv_heads, mlp)


@dataclasses.dataclass(frozen=True)
class Held:
    """What the cut decoder holds: per held layer its matrix elements, the whole-kept elements."""

    layers: int
    layer_matrices: int  # elements of one held layer's matrices (what shard splits)
    replicated: int  # token table, positions, norms: whole on every rank
    width: int
    kv_heads: int
    heads: int
    mlp: int
    family: str
    config: object  # the transformers config, for model/sharded.py's check


def held_on_meta(name: str) -> Held:
    import torch
    from transformers import AutoModel

    from parallel_latent.model.families import FAMILIES, held_layers
    from parallel_latent.model.features import truncate_to_hidden_state

    family_name, hidden, layers, heads, kv_heads, mlp, *_ = MODELS[name]
    family = FAMILIES[family_name]
    config = transformers_config(family_name, *MODELS[name][1:])
    keep = held_layers(layers, -3, family, name)
    setattr(config, family.layers_key, keep)
    with torch.device("meta"):
        decoder = AutoModel.from_config(config)
    truncate_to_hidden_state(decoder, -3, depth=layers)
    stack = getattr(decoder, family.layers)
    per_layer = sum(p.numel() for p in stack[0].parameters() if p.dim() == 2)
    matrices = per_layer * len(stack)
    replicated = sum(p.numel() for p in decoder.parameters()) - matrices  # the layers' norms and biases too
    return Held(len(stack), per_layer, replicated, hidden, kv_heads, heads, mlp, family_name, config)


def frozen_bytes(held: Held, tp: int, layout: str) -> float:
    split = tp if layout == "shard" else 1
    return BYTES * (held.replicated + held.layers * held.layer_matrices / split)


def shard_refusal(held: Held, tp: int) -> str | None:
    """Why ``shard`` refuses this decoder at ``tp`` (model/sharded.py's check itself), or None."""
    from parallel_latent.config import ConfigError, FeatureModelConfig
    from parallel_latent.model.families import FAMILIES
    from parallel_latent.model.sharded import check_shardable

    try:
        check_shardable(FeatureModelConfig(parallel="shard"), FAMILIES[held.family], held.config, tp)
    except ConfigError as refusal:
        return str(refusal)
    return None


def collective_seconds(kind: str, nbytes: float, tp: int) -> float:
    """A collective over ``tp`` ranks in a ring at ``NVLINK`` bytes/s per direction, plus
    ``COLLECTIVE_LATENCY``: an all-reduce moves 2 (n-1)/n of its tensor's ``nbytes``, an all-gather or
    a reduce-scatter (n-1)/n of the whole tensor's (the gathered output, the scattered input)."""
    share = 2 * (tp - 1) / tp if kind == "all_reduce" else (tp - 1) / tp
    return share * nbytes / NVLINK + COLLECTIVE_LATENCY


def frozen_seconds(held: Held, tp: int, layout: str, batch: int, length: int) -> float:
    """One rank's frozen pass over a micro-batch of ``batch`` samples of ``length`` tokens."""
    samples = batch / tp if layout == "replicate" else batch
    split = tp if layout == "shard" else 1
    tokens = samples * length
    per_layer = matmul_seconds(2 * tokens * held.layer_matrices / split, BYTES * held.layer_matrices / split, PINNED)
    per_layer += 4 * samples * length * length * held.width / split / PINNED.big_matmul_rate
    seconds = held.layers * per_layer
    features = BYTES * batch * length * held.width
    if tp > 1 and layout == "replicate":  # the features all-gathered once
        seconds += collective_seconds("all_gather", features, tp)
    if tp > 1 and layout == "shard":  # two all-reduces of [B, T, f] per layer
        seconds += held.layers * 2 * collective_seconds("all_reduce", features, tp)
    return seconds


def model_flops(cfg, recorded: dict | None = None) -> float:
    """The step's model FLOPs, the feature model's from the layers it holds (built on meta; from
    ``recorded``, a whole transformers config, if given)."""
    import torch

    from parallel_latent.model import FeatureModel
    from parallel_latent.model.features import random_features_unannounced
    from parallel_latent.training.flops import model_flops_per_sample

    vocab = cfg.model.vocab_size
    with torch.device("meta"), random_features_unannounced():
        features = FeatureModel(cfg.feature_model, vocab, recorded and {**recorded, "vocab_size": vocab})
    counts = (features.blocks, features.width, features.matmul_weights)
    return model_flops_per_sample(cfg, *counts)["train"] * cfg.training.micro_batch_size


def feature_model_setting(name: str) -> dict:
    """The overrides that make the rows' model read the features of decoder ``name`` (its shape; the
    decoder itself is rebuilt from :func:`feature_model_record`)."""
    family, hidden, layers, heads, kv_heads, _, _, positions = MODELS[name]
    setting = {
        "feature_model.architecture": family, "feature_model.n_layer": layers, "feature_model.n_head": heads,
        "feature_model.n_embd": hidden, "feature_model.n_positions": positions, "model.d_model": hidden,
        "model.n_heads": hidden // 128,
    }  # fmt: skip
    if kv_heads != heads:  # grouped-query attention
        setting["feature_model.n_kv_head"] = kv_heads
    return {key: str(value) for key, value in setting.items()}


def feature_model_record(name: str) -> dict:
    """Decoder ``name``'s whole transformers config from :data:`MODELS`' published figures
    (its own MLP width: a random build from the few ``feature_model.n_*`` keys has 4x its width), which
    the trace rebuilds the feature model from as a checkpoint's record does."""
    return transformers_config(*MODELS[name]).to_dict()


# --------------------------------------------------------------------------- #
# The rest of the step, from real CPU steps (cached: one per size and DP).
# --------------------------------------------------------------------------- #


@functools.cache
def rest_of_step(quick: bool, data_parallel: int = 1):
    """The real step's operators outside the model's forward and backward, and its hook calls."""
    if data_parallel > 1:
        traced = real_step_on_ranks(data_parallel, quick)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-projection.") as scratch:
            traced = real_step(real_step_overrides(Path(scratch), quick))
    return traced.rest, traced.hook_calls


def deepspeed_ops(rest: list[Op]) -> list[Op]:
    return [op for op in rest if op.part in ("deepspeed backward", "optimizer")]


def step_kernels(cfg, ops: list[Op], quick: bool, rest: bool, roofline: Roofline) -> list[Kernel]:
    """The kernels of one step: the traced model's, and with ``rest`` the rest of the step's."""
    kernels = kernels_of(ops, roofline)
    if rest:
        kernels += kernels_of(rest_of_step(quick, 1)[0], roofline) + cuda_only(cfg, roofline)
    return kernels


def project(setting: dict, quick: bool = False, rest: bool = True, recorded: dict | None = None) -> dict:
    """The projection of one gpu.sh setting, with its kernels and traced FLOPs; under ``ranges`` the
    same trace timed by the pessimistic roofline and by PINNED with each assumption made pessimistic
    alone. ``recorded``: the feature model's whole transformers config (:func:`feature_model_record`)."""
    cfg = row_config(setting, quick)
    ops = trace_model(cfg, "cuda", recorded=recorded)
    kernels = step_kernels(cfg, ops, quick, rest, PINNED)
    flops = model_flops(cfg, recorded)
    rooflines = {"pessimistic": PESSIMISTIC, **{name: pessimistic_in(name) for name in ASSUMPTIONS}}
    ranges = {name: projection(step_kernels(cfg, ops, quick, rest, roofline), flops, roofline)
              for name, roofline in rooflines.items()}  # fmt: skip
    return {
        **projection(kernels, flops),
        "ranges": ranges,
        "model_flops": flops,
        "traced_flops": sum(op.flops for op in ops),
        "top": top_costs(kernels),
        "ops": ops,
        "kernel_list": kernels,
    }


def project_row(setting: dict, *, quick: bool = False) -> dict | None:
    """Projected H200 step time and MFU of a gpu.sh setting (``model.dropout``,
    ``training.micro_batch_size``, ``training.compile``...), or None if it cannot be projected.
    The first call runs DeepSpeed steps on the CPU (tens of seconds at gpt2.yaml's size; later
    calls reuse them): call it before CUDA is initialised, or where DS_ACCELERATOR=cpu."""
    try:
        result = project(setting, quick)
    except Exception as error:  # a projection must never stop the measured table
        print(f"projection of {setting}: failed: {type(error).__name__}: {error}".splitlines()[0], file=sys.stderr)
        return None
    return {key: result[key] for key in ("step_ms_overlapped", "step_ms_summed", "mfu_overlapped", "mfu_summed")}


def matrix(quick: bool) -> list[tuple[str, dict, float | None]]:
    """(name, setting, MFU goal) of gpu.sh's rows (its micro-batches when quick)."""
    big, small = ("8", "4") if quick else ("256", "32")
    rows = [
        ("default", {"model.dropout": "0.1", "training.micro_batch_size": big}, MFU_GOALS["default"]),
        ("compile", {"model.dropout": "0.1", "training.micro_batch_size": big, "training.compile": "true"},
         MFU_GOALS["compile"]),
        ("micro32", {"model.dropout": "0.1", "training.micro_batch_size": small}, MFU_GOALS["micro32"]),
        ("dropout0", {"model.dropout": "0.0", "training.micro_batch_size": big}, None),
        ("dropout0 micro32", {"model.dropout": "0.0", "training.micro_batch_size": small}, None),
    ]  # fmt: skip
    return rows


def setting_label(setting: dict) -> str:
    """A row's setting in words (``dropout=0.1, micro_batch_size=256``), less the dropout kernel's switch."""
    return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in setting.items() if k != "training.compile_dropout")


# --------------------------------------------------------------------------- #
# --feature-model: the whole step per rank at TP 1/2/4/8.
# --------------------------------------------------------------------------- #

# The collectives a trace at TP > 1 holds (the model's own, dispatched on a fake group): what each
# does, and which of the operands it reads is its whole tensor.
COLLECTIVES = {
    "c10d.allreduce_": ("all_reduce", sum),  # the tensors it reduces in place
    "c10d._allgather_base_": ("all_gather", max),  # the gathered output (the input is 1/tp of it)
    "c10d._reduce_scatter_base_": ("reduce_scatter", max),  # the scattered input
    "c10d.allgather_": ("all_gather", lambda sizes: sum(sizes[:-1])),  # one output per rank, then the input
}


def collective_of(op: Op) -> tuple[str, int]:
    """(what a traced collective does, the bytes of its whole tensor)."""
    base = op.name.rsplit(".", 1)[0]
    if base not in COLLECTIVES:
        raise ValueError(f"{op.name}: a collective whose time the projection does not model")
    kind, whole = COLLECTIVES[base]
    return kind, whole([nbytes for *_, nbytes in op.reads])


def perceiver_at(name: str, setting: dict, quick: bool, tp: int) -> dict:
    """One rank's part of the model's forward and backward at TP=``tp`` with decoder ``name`` as its
    frozen feature model, the frozen pass left out (it is timed apart, per layout): the model built
    at that degree on meta (step_trace.fake_tp_group: this rank's slices, and every collective the
    model's code issues at its real size), its kernels timed as the TP=1 rows' are (what is split
    runs at its local shape, what is not, e.g. the norms without sequence parallelism, whole), its
    TP collectives at NVLink's rate (:func:`collective_seconds`), none overlapped."""
    recorded = feature_model_record(name)
    cfg = row_config({**setting, **feature_model_setting(name), "parallel.tensor_parallel": str(tp)}, quick)
    with fake_tp_group(tp) as group:
        ops = trace_model(cfg, "cuda", tp_group=group, recorded=recorded)
    ours = [op for op in ops if op.part != "features"]
    kernels = [k for k in kernels_of(ops) if k.part != "features" and not k.collective]
    collectives = [collective_of(op) for op in ours if op.kind == "collective"]
    return {
        "compute": projection(kernels, 0.0),
        "kernels": kernels,
        "matmul_flops": sum(op.flops for op in ours),
        "matmul_ms": sum(k.device_s for k in kernels if k.flops) * 1e3,
        "collectives": collectives,
        "collective_ms": sum(collective_seconds(kind, nbytes, tp) for kind, nbytes in collectives) * 1e3,
        "ops": ops,
    }


def whole_steps(name: str, setting: dict, quick: bool, tps: tuple[int, ...] | None = None) -> list[dict]:
    """Per TP degree (``tps``, by default :data:`TP_DEGREES`) and layout, one rank's whole step (the model's
    forward and backward; the optimizer and DeepSpeed's work are measured at gpt2.yaml's size only):
    the Perceiver's compute and its TP collectives (:func:`perceiver_at`, the same in both layouts)
    and the frozen pass (:func:`frozen_seconds`), one after the other. Per rank: the TP
    group shares one micro-batch, so a rank's tokens per second and model FLOPs are 1/tp of the
    group's. A degree that the layout (model/sharded.py's check) or the Perceiver's config refuses
    says why."""
    from parallel_latent.config import ConfigError

    held, cfg = held_on_meta(name), row_config({**setting, **feature_model_setting(name)}, quick)
    batch, length = cfg.training.micro_batch_size, cfg.model.max_length
    flops = model_flops(cfg, feature_model_record(name))
    rows = []
    for tp in tps or TP_DEGREES:
        try:
            ours = perceiver_at(name, setting, quick, tp)
        except ConfigError as refusal:
            rows += [{"tp": tp, "layout": layout, "refused": str(refusal)} for layout in ("replicate", "shard")]
            continue
        for layout in ("replicate", "shard"):
            refusal = shard_refusal(held, tp) if layout == "shard" else None
            if refusal:
                rows.append({"tp": tp, "layout": layout, "refused": refusal})
                continue
            frozen_ms = frozen_seconds(held, tp, layout, batch, length) * 1e3
            step_ms = ours["compute"]["step_ms_overlapped"] + ours["collective_ms"] + frozen_ms
            rows.append({
                "tp": tp, "layout": layout, "perceiver": ours, "frozen_ms": frozen_ms, "step_ms": step_ms,
                "tokens_per_s": batch * length / tp / (step_ms / 1e3), "mfu": flops / tp / (step_ms / 1e3) / PEAK_FLOPS,
            })  # fmt: skip
    return rows
