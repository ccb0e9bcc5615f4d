"""The H200 step of configs/gpt2.yaml, projected on a CPU: one training step traced on the meta
device (bf16, the real model and loss, no FLOP spent), every dispatched operator recorded with its
FLOPs, bytes read and written and the kernels it costs, then a roofline with pinned constants for
each row of benchmarks/gpu.sh's matrix (dropout 0.1 / 0.0 x micro-batch 256 / 32, and
``training.compile`` at dropout 0.1, micro-batch 256).

Pinned rules, so that figures stay comparable from change to change:

* MFU against 989 TFLOP/s dense bf16, with ``training/flops.py``'s model FLOPs (the traced matmul FLOPs
  equal them within 1%: a test);
* a matmul takes max(FLOPs / 700 TFLOP/s above 20 GFLOP, or / 593 TFLOP/s below; bytes / 4.0 TB/s);
  every other kernel bytes / 4.0 TB/s; 5 us per kernel launch (eager; none inside a CUDA graph);
* a region compiled with torch.compile is one kernel per run of consecutive non-matmul,
  non-collective operators between matmuls and collectives, whose bytes are the run's external
  inputs and outputs only;
* per row: device + launch time summed, and the overlapped max of the two; the top ten costs.

What runs is what the code does on CUDA: the dropout mask is one compiled region per site where
``training.compile_dropout`` is on (``DropoutRNG.kernel``), the loss's per-chunk work is compiled
where the model's ``LossKernels`` say so for a CUDA device, ``training.compile`` compiles each
Perceiver block (forward and backward: the autograd nodes a region created count as the region;
a ``torch.compiler.disable`` function inside it runs eagerly and starts a new forward graph after it).
Attention is the kernel CUDA picks for a masked bf16 SDPA (memory-efficient attention, its bias
from the boolean mask): on meta, SDPA would otherwise decompose into its math path.

The optimizer step cannot run on meta: it is measured by running the real ``Trainer.train_step``
(DeepSpeed's engine, ZeRO-2, bf16) on the CPU at gpt2.yaml's parameter count (micro-batch 1: the
step's cost does not depend on the batch) under a dispatch mode around ``engine.step``, with
torch's fused AdamW (``optimizer.fused=on``: what CUDA runs, whose kernel the CPU has too); every
operator it dispatches counts as one kernel (a CUDA fused or foreach op over ZeRO's flat partition
is one or a few), its bytes those of its real tensors, and its host synchronisations
(``aten._local_scalar_dense``) are reported.

Usage: python benchmarks/bench_projection.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from common import REPO, Report, add_common_arguments, run

PEAK_FLOPS = 989e12  # H200 dense bf16, the MFU denominator
BIG_MATMUL_FLOPS, BIG_MATMUL_RATE, SMALL_MATMUL_RATE = 20e9, 700e12, 593e12
BANDWIDTH = 4.0e12  # bytes/s
LAUNCH_S = 5e-6  # per kernel launch (the project captures no CUDA graph: every kernel is launched)
MFU_GOALS = {"default": 0.35, "compile": 0.45, "micro32": 0.20}  # overlapped figure, dropout 0.1

SHRINK = ["model.d_model=64", "model.n_heads=4", "model.n_encoder_layers=2", "model.n_decoder_layers=2",
          "feature_model.n_layer=4", "feature_model.n_head=4", "feature_model.n_embd=64"]  # fmt: skip
# Operators that launch nothing: allocation, metadata, aliasing.
NO_KERNEL = {
    "aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default", "aten.new_empty.default",
    "aten.new_empty_strided.default", "aten.detach.default", "aten._unsafe_view.default", "aten.alias.default",
    "aten.lift_fresh.default", "aten.set_.source_Storage_storage_offset", "aten.resize_.default",
}  # fmt: skip
COLLECTIVE_PREFIXES = ("c10d.", "_c10d_functional.", "c10d_functional.")


# --------------------------------------------------------------------------- #
# Tracing.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class Op:
    name: str
    kind: str  # "matmul", "collective" or "other"
    flops: float
    reads: list[tuple[int, tuple, int]]  # (storage key, (first element, elements spanned, element size), bytes)
    writes: list[tuple[int, tuple, int]]
    region: tuple[str, int] | None  # the compiled region's label and call it runs in, None: eager
    phase: str  # "forward", "backward", "optimizer"
    part: str  # "loss" (the cross-entropy, forward and backward) or "model"

    @property
    def bytes(self) -> int:
        return sum(b for *_, b in self.reads) + sum(b for *_, b in self.writes)


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _written_arguments(func, args, kwargs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors an operator writes in place (``self`` of ``add_``, ``out=``), and which of them
    it only writes (``out=``: not read)."""
    written, only_written = [], []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) and not argument.kwarg_only else kwargs.get(argument.name)
        tensors = _tensors(value)
        written += tensors
        if argument.is_out:
            only_written += tensors
    return written, only_written


class StepTracer(TorchDispatchMode):
    """Records every operator that launches a kernel, with the compiled region it belongs to:
    in forward the innermost :meth:`region` being run, in backward the region whose forward
    created the autograd node being run."""

    def __init__(self):
        super().__init__()
        self.ops: list[Op] = []
        self.phase = "forward"
        self.in_loss = False
        self._region: tuple[str, int] | None = None
        self._calls = 0
        self._node_regions: dict = {}
        self._storages: list = []  # kept alive: a storage key is never reused within the trace

    def _access(self, tensor: torch.Tensor) -> tuple[int, tuple, int]:
        storage = tensor.untyped_storage()
        self._storages.append(storage)
        span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
        view = (tensor.storage_offset(), span if tensor.numel() else 0, tensor.element_size())
        return storage._cdata, view, tensor.numel() * tensor.element_size()

    def _current_region(self) -> tuple[str, int] | None:
        if self._region is not None:
            return self._region
        node = torch._C._current_autograd_node()
        return None if node is None else self._node_regions.get(node)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        if func.is_view or name in NO_KERNEL:
            return out
        flops = 0.0
        if func.overloadpacket in flop_registry:
            flops = float(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))
        kind = "collective" if name.startswith(COLLECTIVE_PREFIXES) else ("matmul" if flops > 0 else "other")
        mutated, out_args = _written_arguments(func, args, kwargs)
        inputs = [t for t in _tensors((args, kwargs)) if not any(t is o for o in out_args)]
        outputs = [t for t in _tensors(out) if not any(t is i for i in [*inputs, *out_args])] + mutated
        written, read = [self._access(t) for t in outputs], [self._access(t) for t in inputs]
        node = torch._C._current_autograd_node()
        loss = self.in_loss or (node is not None and "CrossEntropy" in node.name())
        self.ops.append(
            Op(name, kind, flops, read, written, self._current_region(), self.phase, "loss" if loss else "model")
        )
        return out

    def region(self, fn, label: str):
        """``fn`` as a compiled region: its forward operators and the backward of the autograd
        nodes it creates count as ``label``'s (a region inside a region is the outer one's)."""
        tracer = self

        def traced(*args, **kwargs):
            if tracer._region is not None:
                return fn(*args, **kwargs)
            tracer._calls += 1  # each call its own kernels: a compiled graph does not fuse across calls
            region = tracer._region = (label, tracer._calls)
            try:
                out = fn(*args, **kwargs)
            finally:
                tracer._region = None
            stop = {t.grad_fn for t in _tensors((args, kwargs)) if t.grad_fn is not None}
            tracer._tag_nodes([t.grad_fn for t in _tensors(out) if t.grad_fn is not None], stop, region)
            return out

        return traced

    def graph_break(self, fn):
        """``fn`` as code torch.compile leaves out of its graph (``torch.compiler.disable``): its
        operators run eagerly, and the region's forward resumes in a new graph after it."""
        tracer = self

        def eager(*args, **kwargs):
            if tracer._region is None:
                return fn(*args, **kwargs)
            label, tracer._region = tracer._region[0], None
            try:
                return fn(*args, **kwargs)
            finally:
                tracer._calls += 1
                tracer._region = (label, tracer._calls)

        return eager

    def _tag_nodes(self, frontier: list, stop: set, region: tuple[str, int]) -> None:
        while frontier:
            node = frontier.pop()
            if node is None or node in stop or node in self._node_regions or node.name().endswith("AccumulateGrad"):
                continue
            self._node_regions[node] = region
            frontier.extend(next_node for next_node, _ in node.next_functions)


def cuda_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
    """What a masked bf16 SDPA runs on CUDA: memory-efficient attention with an additive bias
    (the boolean mask turned into one by one kernel, as torch's CUDA path does)."""
    bias = None
    if attn_mask is not None:
        shape = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        if attn_mask.dtype == torch.bool:
            zero = torch.zeros((), dtype=query.dtype, device=query.device)
            attn_mask = torch.where(attn_mask, zero, torch.finfo(query.dtype).min)
        bias = attn_mask.expand(shape)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, needs_grad, dropout_p, is_causal and bias is None, scale=scale
    )[0]


def row_config(setting: dict, quick: bool):
    from parallel_latent.config import load_config

    overrides = [*(SHRINK if quick else []), "feature_model.pretrained=false", "training.precision=bf16"]
    overrides += [f"{k}={v}" for k, v in setting.items()]
    return load_config(REPO / "configs" / "gpt2.yaml", overrides)


def meta_model(cfg, tracer: StepTracer):
    """The model of ``cfg`` on the meta device in bf16, its compiled regions as CUDA would run them."""
    from parallel_latent.model import build_model, perceiver
    from parallel_latent.parallel import LossKernels
    from parallel_latent.parallel.dropout import dropout_core

    compile_blocks = cfg.training.compile  # (traced as regions below: compiling on meta fails)
    cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, compile=False))
    # The head's scale reads the token table's std (a value meta has not got; it changes no cost).
    with torch.device("meta"), _patched(perceiver, "token_table_scale", lambda table: 1.0):
        model = build_model(cfg).to(torch.bfloat16).train()
    kernels = LossKernels.compiled() if compile_blocks else model.loss_kernels.on(torch.device("cuda"))
    rng = model.dropout_rng
    if "cuda" in rng.compile_devices:  # the mask kernel, compiled on CUDA (training.compile_dropout)
        rng.compile_devices = ("meta",)
        rng._kernel = tracer.region(dropout_core, "dropout mask")
    if compile_blocks:
        for stack in (model.encoder.stack, model.decoder.stack):
            for block in stack.blocks:
                block.forward = tracer.region(block.forward, "Perceiver block")
        for module in model.modules():  # where the compiled blocks' graphs break
            for name in dir(type(module)):
                if getattr(getattr(type(module), name, None), "_torchdynamo_disable", False):
                    setattr(module, name, tracer.graph_break(getattr(module, name)))
    if kernels.compiled_kernels:  # the plain functions (compiling on meta fails), traced as compiled regions
        compiled = {f.name: getattr(kernels, f.name) for f in dataclasses.fields(kernels)}
        traced = {name: tracer.region(k.fn, "loss chunk") for name, k in compiled.items() if hasattr(k, "fn")}
        kernels = dataclasses.replace(kernels, **traced)
    model.loss_kernels = kernels
    return model


def trace_forward_backward(cfg) -> StepTracer:
    """One micro-batch's forward and backward of the training step, on meta."""
    tracer = StepTracer()
    model = meta_model(cfg, tracer)
    micro, length = cfg.training.micro_batch_size, cfg.model.max_length
    ids = torch.zeros(micro, length, dtype=torch.long, device="meta")
    mask = torch.ones(micro, length, dtype=torch.long, device="meta")
    with tracer, _patched(F, "scaled_dot_product_attention", cuda_attention), _loss_marked(tracer):
        out = model(ids, mask)
        tracer.phase = "backward"
        (out.loss_sum * 1.0).backward()
    return tracer


@contextlib.contextmanager
def _patched(owner, name: str, replacement):
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _loss_marked(tracer: StepTracer):
    """The model's loss call, its operators marked as the loss's (its backward is found by node name)."""
    from parallel_latent.model import autoencoder

    loss = autoencoder.vocab_parallel_cross_entropy

    def marked(*args, **kwargs):
        tracer.in_loss = True
        try:
            return loss(*args, **kwargs)
        finally:
            tracer.in_loss = False

    return _patched(autoencoder, "vocab_parallel_cross_entropy", marked)


# --------------------------------------------------------------------------- #
# The optimizer step: the real DeepSpeed engine on the CPU.
# --------------------------------------------------------------------------- #


def trace_optimizer_step(quick: bool) -> StepTracer:
    """The ops of DeepSpeed's ``engine.step`` inside a real ``Trainer.train_step`` at gpt2.yaml's
    parameter count (micro-batch 1, a corpus of a few lines), after one step has built its state."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from parallel_latent.config import load_config
    from parallel_latent.parallel import destroy_distributed
    from parallel_latent.training.startup import start_run
    from parallel_latent.training.trainer import Trainer

    tracer = StepTracer()
    tracer.phase = "optimizer"
    with tempfile.TemporaryDirectory(prefix="bench-projection.") as scratch:
        corpus = Path(scratch) / "corpus.txt"
        corpus.write_text("\n".join(f"line {i} of a corpus for one optimizer step" for i in range(64)) + "\n")
        overrides = [
            *(SHRINK if quick else []), "feature_model.pretrained=false", "training.precision=bf16",
            f"data.path={corpus}", "data.min_eval_samples=1", "data.eval_fraction=0.1", f"data.cache_dir={scratch}/c",
            "training.micro_batch_size=1", "training.eval_every=0", "training.max_steps=3", "parallel.zero_stage=2",
            f"logging.run_dir={scratch}/run", "logging.tensorboard=false", "logging.progress_bar=false",
            "logging.print_samples=0", "checkpoint.save_every=0", "checkpoint.export_portable=false",
            "checkpoint.resume=never", "training.device=cpu",
            "optimizer.fused=on",  # what CUDA runs (torch's fused AdamW, one pass per group): the CPU has it too
        ]  # fmt: skip
        trainer = Trainer(start_run(load_config(REPO / "configs" / "gpt2.yaml", overrides)))
        try:
            trainer.train_step()  # builds the optimizer's state
            engine_step = trainer.engine.step

            def traced_step(*args, **kwargs):
                with tracer:
                    return engine_step(*args, **kwargs)

            trainer.engine.step = traced_step
            trainer.train_step()
        finally:
            trainer.close()
            trainer.logger.close()
            destroy_distributed()
    return tracer


# --------------------------------------------------------------------------- #
# The roofline.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class Kernel:
    label: str  # what it is, for the top ten
    device_s: float
    flops: float
    part: str = "model"


def matmul_seconds(flops: float, nbytes: int) -> float:
    rate = BIG_MATMUL_RATE if flops > BIG_MATMUL_FLOPS else SMALL_MATMUL_RATE
    return max(flops / rate, nbytes / BANDWIDTH)


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


def kernels_of(ops: list[Op]) -> list[Kernel]:
    """The kernels a traced op list launches under the pinned rules."""
    reads_after: list[set[int]] = [set() for _ in ops]  # storage keys read by ops after index i
    seen: set[int] = set()
    for i in range(len(ops) - 1, -1, -1):
        reads_after[i] = set(seen)
        seen.update(storage for storage, *_ in ops[i].reads)
    kernels, run, run_region = [], [], None

    def close_run(end: int) -> None:
        if run:
            nbytes = _fused_run(run, reads_after[end])
            kernels.append(Kernel(f"{run_region[0]} (fused)", nbytes / BANDWIDTH, 0.0, run[0].part))
            run.clear()

    for i, op in enumerate(ops):
        fusible = op.region is not None and op.kind == "other"
        if run and (not fusible or op.region != run_region):
            close_run(i - 1)
        if fusible:
            run_region = op.region
            run.append(op)
            continue
        seconds = matmul_seconds(op.flops, op.bytes) if op.kind == "matmul" else op.bytes / BANDWIDTH
        kernels.append(Kernel(f"{op.name} [{op.phase}]", seconds, op.flops, op.part))
    close_run(len(ops) - 1)
    return kernels


def projection(kernels: list[Kernel], model_flops: float) -> dict:
    device = sum(k.device_s for k in kernels)
    launch = LAUNCH_S * len(kernels)
    overlapped, summed = max(device, launch), device + launch
    return {
        "step_ms_overlapped": overlapped * 1e3,
        "step_ms_summed": summed * 1e3,
        "mfu_overlapped": model_flops / overlapped / PEAK_FLOPS,
        "mfu_summed": model_flops / summed / PEAK_FLOPS,
        "device_ms": device * 1e3,
        "launch_ms": launch * 1e3,
        "kernels": len(kernels),
    }


def top_costs(kernels: list[Kernel], n: int = 10) -> list[tuple[str, float, int]]:
    """(label, device + launch ms, kernels) of the ``n`` biggest kinds of kernel."""
    totals, counts = defaultdict(float), Counter()
    for k in kernels:
        totals[k.label] += k.device_s + LAUNCH_S
        counts[k.label] += 1
    ranked = sorted(totals, key=totals.get, reverse=True)[:n]
    return [(label, totals[label] * 1e3, counts[label]) for label in ranked]


def model_flops(cfg) -> float:
    from parallel_latent.training.flops import model_flops_per_sample

    return model_flops_per_sample(cfg)["train"] * cfg.training.micro_batch_size


@functools.cache  # one CPU step is enough for every row
def optimizer_ops(quick: bool) -> list[Op]:
    return trace_optimizer_step(quick).ops


def project(setting: dict, quick: bool = False, optimizer: bool = True) -> dict:
    """The projection of one gpu.sh setting, with its kernels and traced FLOPs."""
    cfg = row_config(setting, quick)
    ops = trace_forward_backward(cfg).ops + (optimizer_ops(quick) if optimizer else [])
    kernels = kernels_of(ops)
    flops = model_flops(cfg)
    return {
        **projection(kernels, flops),
        "model_flops": flops,
        "traced_flops": sum(op.flops for op in ops),
        "top": top_costs(kernels),
        "ops": ops,
        "kernel_list": kernels,
    }


def project_row(setting: dict, *, quick: bool = False) -> dict | None:
    """Projected H200 step time and MFU of a gpu.sh setting (``model.dropout``,
    ``training.micro_batch_size``, ``training.compile``...), or None if it cannot be projected.
    The first call runs one DeepSpeed step on the CPU (tens of seconds at gpt2.yaml's size; later
    calls reuse it): call it before CUDA is initialised, or where DS_ACCELERATOR=cpu."""
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


def phase_split(result: dict) -> str:
    parts = defaultdict(float)
    for k in result["kernel_list"]:
        kind = "matmul" if k.flops else "memory-bound"
        parts[kind] += k.device_s * 1e3
    return ", ".join(f"{kind} {ms:.1f} ms" for kind, ms in sorted(parts.items()))


def label(setting: dict) -> str:
    return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in setting.items())


def body(args, report: Report) -> None:
    optimizer = optimizer_ops(args.quick)
    opt_kernels = kernels_of(optimizer)
    syncs = sum(op.name.startswith("aten._local_scalar_dense") for op in optimizer)
    opt = projection(opt_kernels, 0.0)
    print(f"optimizer step (DeepSpeed ZeRO-2 bf16, counted on the CPU): {opt['kernels']} kernels, "
          f"{opt['device_ms']:.2f} ms device + {opt['launch_ms']:.2f} ms launches, {syncs} host syncs")  # fmt: skip
    report.figure("optimizer step kernels", opt["kernels"])
    report.figure("optimizer step, device + launch", opt["device_ms"] + opt["launch_ms"], "ms")
    report.figure("optimizer step host synchronisations", syncs)
    for name, setting, goal in matrix(args.quick):
        result = project(setting, args.quick)
        loss = [k for k in result["kernel_list"] if k.part == "loss"]
        loss_ms = sum(k.device_s + LAUNCH_S for k in loss) * 1e3
        print(
            f"\n{label(setting)}: {result['step_ms_overlapped']:.1f}-{result['step_ms_summed']:.1f} ms "
            f"(overlapped-summed), MFU {result['mfu_overlapped'] * 100:.1f}-{result['mfu_summed'] * 100:.1f}%; "
            f"{result['kernels']:,} kernels, device {result['device_ms']:.1f} ms ({phase_split(result)}), launches "
            f"{result['launch_ms']:.1f} ms; traced / model FLOPs {result['traced_flops'] / result['model_flops']:.4f}; "
            f"the loss {loss_ms:.2f} ms in {len(loss)} kernels"
        )
        for cost_label, ms, count in result["top"]:
            print(f"    {ms:8.2f} ms  {count:5d} x {cost_label}")
        quick_goal = None if args.quick else goal
        report.figure(f"projected MFU overlapped, {name}", result["mfu_overlapped"], at_least=quick_goal)
        report.figure(f"projected MFU summed, {name}", result["mfu_summed"])
        report.figure(f"projected step overlapped, {name}", result["step_ms_overlapped"], "ms")
        report.figure(f"projected step summed, {name}", result["step_ms_summed"], "ms")
        report.figure(f"kernels per step, {name}", result["kernels"])
        report.figure(f"traced / model FLOPs, {name}", result["traced_flops"] / result["model_flops"], "x")
        report.figure(f"the loss, device + launch, {name}", loss_ms, "ms")
        if name == "default":  # the page's top ten (every row's is printed above)
            for rank, (cost_label, ms, count) in enumerate(result["top"], 1):
                report.figure(f"top cost {rank}, default: {count} x {cost_label}", ms, "ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    return run("bench_projection", parser, body)


if __name__ == "__main__":
    sys.exit(main())
