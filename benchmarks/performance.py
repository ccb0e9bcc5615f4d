"""The performance model: what one H200 is taken to do (the pinned roofline and its pessimistic range,
NVLink, the MFU peak from ``training/flops.py``'s table), the goals, and the kernels CUDA launches for a
traced operator (benchmarks/step_trace.py) with their cost. Its pinned rules, and what it leaves out:
docs/development.md, Benchmarks; a step projected with it: benchmarks/step_projection.py."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, defaultdict

from benchmarks.step_trace import Op
from parallel_latent.training.flops import gpu_peak_flops

PEAK_FLOPS = gpu_peak_flops("H200", "bf16")[0]  # dense bf16, the MFU denominator
BIG_MATMUL_FLOPS = 20e9  # a matmul above this many FLOPs runs at the big rate


@dataclasses.dataclass(frozen=True)
class Roofline:
    """Matmul rates above and below BIG_MATMUL_FLOPS, memory bandwidth (bytes/s), host time per eager
    kernel launch (no CUDA graph is captured: every kernel is launched), device time of the smallest kernel."""

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


# The range a projection is also timed by: PESSIMISTIC, and PINNED with each assumption pessimistic alone.
RANGES = {"pessimistic": PESSIMISTIC, **{name: pessimistic_in(name) for name in ASSUMPTIONS}}

# The goals (an H200, TP=1, bf16): the overlapped MFU at dropout 0.1, projected (bench_projection.py)
# and measured (bench_gpu.py); DeepSpeed's backward work + its step per DP size; Python hook calls.
MFU_GOALS = {"default": 0.43, "compile": 0.50, "micro32": 0.30}
DEEPSPEED_KERNEL_GOALS = {1: 250, 2: 300}
HOOK_CALL_GOAL = 20

# Operators whose CUDA implementation launches more than one kernel (None: multi_tensor_apply's
# launches, then one cleanup kernel).
CUDA_KERNELS = {
    "aten.native_layer_norm_backward.default": 2,  # the input gradient, then the weight and bias gradients'
    "aten._scaled_dot_product_efficient_attention_backward.default": 2,  # delta (rowsum dO * O), the kernel
    "aten.embedding_dense_backward.default": 6,  # sort, segment offsets and sizes, partial sums, reduction
    "aten._foreach_norm.Scalar": None,
}
SCATTERS = ("aten.index_put", "aten._index_put_impl_", "aten.index_add", "aten.scatter", "aten.index_copy")
# Operators that read only the rows or elements their indices name, not the whole of their source.
GATHERS = ("aten.gather", "aten.index_select", "aten.embedding.", "aten.index.Tensor")
# torch's multi_tensor_apply: per launch at most this many tensors (by the number of tensor lists
# the operator takes) and 320 blocks of 65536 elements.
MULTI_TENSOR_LISTS = {"aten._foreach_copy_": 2, "aten._foreach_norm": 1, "aten._foreach_zero_": 1,
                      "aten._foreach_add_": 1, "aten._foreach_mul_": 1, "aten._fused_adamw_": 4}  # fmt: skip
MAX_TENSORS = {1: 110, 2: 64, 3: 48, 4: 36, 5: 30}
MAX_BLOCKS, CHUNK = 320, 65536


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
    if base in MULTI_TENSOR_LISTS:  # (and _foreach_norm's cleanup kernel)
        return multi_tensor_launches(op.tensors, MULTI_TENSOR_LISTS[base]) + int(base == "aten._foreach_norm")
    if base == "aten.cat":
        return max(1, math.ceil(len(op.reads) / 128))
    if op.name.startswith("aten._local_scalar_dense"):
        return 0  # a device-to-host copy: a synchronisation, reported apart
    return CUDA_KERNELS.get(op.name, 1) or 1


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
    """Bytes the views ``accesses`` touch, each element once: per tensor, the union of their ranges (<= their bytes)."""
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


def op_bytes(op: Op) -> int:
    """Bytes an eager kernel moves: every operand, of a gather's source only as many elements as it writes."""
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
        if run:  # one fused kernel: it reads what it did not write, and writes what an op after it reads
            written = {storage for op in run for storage, *_ in op.writes}
            inputs = [access for op in run for access in op.reads if access[0] not in written]
            outputs = [access for op in run for access in op.writes if access[0] in reads_after[end]]
            nbytes = _distinct_bytes(inputs) + _distinct_bytes(outputs)
            seconds = max(nbytes / roofline.bandwidth, roofline.min_kernel_s)
            kernels.append(Kernel(f"{run_region[0]} (fused)", seconds, 0.0, run[0].part))
            run.clear()

    for i, op in enumerate(ops):
        # Whether a compiled region's inductor code can fuse it with its neighbours.
        fusible = (op.region is not None and op.kind == "other" and not op.name.startswith(SCATTERS)
                   and kernels_per_op(op) == 1 and not op.host)  # fmt: skip
        if run and (not fusible or op.region != run_region):
            close_run(i - 1)
        if fusible:
            run_region = op.region
            run.append(op)
            continue
        count = kernels_per_op(op)
        if count == 0:
            continue
        matmul = op.kind == "matmul"
        seconds = matmul_seconds(op.flops, op.bytes, roofline) if matmul else op_bytes(op) / roofline.bandwidth
        label = f"{op.name} [{op.phase if op.phase != 'step' else op.part}]"
        per_kernel = max(seconds / count, roofline.min_kernel_s)
        kernels += [Kernel(label, per_kernel, op.flops / count, op.part, op.kind == "collective")] * count
    close_run(len(ops) - 1)
    return kernels


def cuda_only(cfg, roofline: Roofline = PINNED) -> list[Kernel]:
    """What a CPU trace cannot show: the micro-batch's ids and mask copied to the device (pinned, one copy each)."""
    nbytes = cfg.training.micro_batch_size * cfg.model.max_length * 8  # int64
    seconds = max(nbytes / roofline.bandwidth, roofline.min_kernel_s)
    return [Kernel("host-to-device copy of the batch [step]", seconds, 0.0, "trainer")] * 2


def projection(kernels: list[Kernel], model_flops: float, roofline: Roofline = PINNED) -> dict:
    device, launch = sum(k.device_s for k in kernels), roofline.launch_s * len(kernels)
    overlapped, summed = max(device, launch), device + launch
    return {"step_ms_overlapped": overlapped * 1e3, "step_ms_summed": summed * 1e3,
            "mfu_overlapped": model_flops / overlapped / PEAK_FLOPS if overlapped else 0.0,
            "mfu_summed": model_flops / summed / PEAK_FLOPS if summed else 0.0,
            "device_ms": device * 1e3, "launch_ms": launch * 1e3, "kernels": len(kernels)}  # fmt: skip


def top_costs(kernels: list[Kernel], n: int = 10) -> list[tuple[str, float, int]]:
    """(label, device + launch ms, kernels) of the ``n`` biggest kinds of kernel."""
    totals, counts = defaultdict(float), Counter()
    for k in kernels:
        totals[k.label] += k.device_s + PINNED.launch_s
        counts[k.label] += 1
    ranked = sorted(totals, key=totals.get, reverse=True)[:n]
    return [(label, totals[label] * 1e3, counts[label]) for label in ranked]


def block_activation_bytes(b: int, s: int, c: int, h: int, a: int, t: int, sp: bool) -> int:
    """Bytes an encoder block saves for backward per rank (fp32, dropout on), tensor by tensor; sequence
    parallelism divides what lives between the regions by t (the region entries keep the gathered input)."""
    between = 1 / t if sp else 1
    lns = 4 * b * (s + c + s) * h * between + 8 * b * (s + c + s) * between  # inputs + mean/rstd
    entries = 4 * b * (c + s) * h + 4 * b * s * h  # attention's cat(context, stream), the MLP's input
    attention = 4 * b * (s + 2 * (c + s)) * h / t + 4 * b * (a // t) * s + 4 * b * (c + s)  # q, k, v; lse; mask
    projection_in = 4 * b * s * h / t
    mlp = 4 * b * s * 4 * h / t + b * s * 4 * h / t + 4 * b * s * 4 * h / t  # GELU in, mask, dropout out
    masks = 2 * b * s * h * between  # attention and MLP output dropout (bool)
    return int(lns + entries + attention + projection_in + mlp + masks)


def collective_seconds(kind: str, nbytes: float, tp: int) -> float:
    """A collective over ``tp`` ranks in a ring at ``NVLINK`` bytes/s per direction, plus its latency: an
    all-reduce moves 2 (n-1)/n of its tensor's ``nbytes``, the others (n-1)/n of the whole tensor's."""
    share = 2 * (tp - 1) / tp if kind == "all_reduce" else (tp - 1) / tp
    return share * nbytes / NVLINK + COLLECTIVE_LATENCY
