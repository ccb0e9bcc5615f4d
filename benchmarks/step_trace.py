"""The operators of one training step, for the performance model: every dispatched operator that launches
a kernel, with its FLOPs, the bytes it reads and writes, its compiled region and the part of the step
that asked for it; and a real ``Trainer.train_step`` on the CPU traced so. An operator inside the
model's ``forward``, or run by an autograd node of its backward graph, is the model's; anything else is
the rest of the step. (The model alone is traced on the meta device: benchmarks/meta_trace.py.)"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from benchmarks.harness import GPT2, GPT2_SHRUNK, QUIET_RUN, started_trainer
from benchmarks.processes import on_ranks
from parallel_latent.config import load_config

# Operators that launch nothing: allocation, metadata, aliasing.
NO_KERNEL = {"aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default",
             "aten.new_empty.default", "aten.new_empty_strided.default", "aten.detach.default", "aten.alias.default",
             "aten._unsafe_view.default", "aten.lift_fresh.default", "aten.set_.source_Storage_storage_offset",
             "aten.resize_.default"}  # fmt: skip
COLLECTIVE_PREFIXES = ("c10d.", "_c10d_functional.", "c10d_functional.")
STDLIB = sysconfig.get_paths()["stdlib"]


@dataclasses.dataclass
class Op:
    name: str
    kind: str  # "matmul", "collective" or "other"
    flops: float
    reads: list[tuple[int, tuple, int]]  # (storage key, (first element, elements spanned, element size), bytes)
    writes: list[tuple[int, tuple, int]]
    region: tuple[str, int] | None  # the compiled region's label and call it runs in, None: eager
    phase: str  # "forward", "backward" (the model's), "step" (the rest of train_step)
    part: str  # "loss", "features" (the frozen pass), "model"; the rest's "trainer", "deepspeed backward", "optimizer"
    tensors: list[int] = dataclasses.field(default_factory=list)  # elements of each tensor of a multi-tensor op
    host: bool = False  # only host tensors out of a meta trace (a Python scalar's tensor): no kernel

    @property
    def bytes(self) -> int:
        return sum(b for *_, b in self.reads) + sum(b for *_, b in self.writes)


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _claim(outputs, inputs, owner: dict, value, keep=lambda node: True) -> None:
    """Every autograd node reachable from ``outputs`` short of ``inputs``' own, not yet in ``owner``, is ``value``'s."""
    nodes = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
    stop = {t.grad_fn for t in _tensors(inputs) if t.grad_fn is not None}
    while nodes:
        node = nodes.pop()
        if node is not None and node not in stop and node not in owner and keep(node):
            owner[node] = value
            nodes.extend(next_node for next_node, _ in node.next_functions)


def _written_arguments(func, args, kwargs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors an operator writes in place (``self`` of ``add_``, ``out=``), and those it only writes."""
    written, only_written = [], []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[index] if index < len(args) and not argument.kwarg_only else kwargs.get(argument.name)
            tensors = _tensors(value)
            written += tensors
            only_written += tensors if argument.is_out else []
    return written, only_written


class StepTracer(TorchDispatchMode):
    """Records every operator that launches a kernel, with its compiled region (in backward: the one whose
    forward made the node being run) and the part of the step (:attr:`part`, set by the caller) asking."""

    def __init__(self, on_meta: bool = False):
        super().__init__()
        self.ops: list[Op] = []
        self.part = "model"  # what the caller is running: "model", "trainer", "backward", "optimizer"
        self.within: str | None = None  # inside the model: "loss" or "features" (the frozen pass), see _marked
        self.on_meta = on_meta  # a meta trace: what it makes on the CPU stays on the host
        self._region: tuple[str, int] | None = None
        self._calls = 0
        self._node_regions: dict = {}
        self._model_nodes: dict = {}  # the autograd nodes created inside the model's forward
        self._storages: list = []  # kept alive: a storage key is never reused within the trace

    def _access(self, tensor: torch.Tensor) -> tuple[int, tuple, int]:
        storage = tensor.untyped_storage()
        self._storages.append(storage)
        span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
        view = (tensor.storage_offset(), span if tensor.numel() else 0, tensor.element_size())
        return storage._cdata, view, tensor.numel() * tensor.element_size()

    def _phase_and_part(self) -> tuple[str, str]:
        node = torch._C._current_autograd_node()
        loss = self.within == "loss" or (node is not None and "CrossEntropy" in node.name())
        model_part = "loss" if loss else self.within or "model"
        if node is not None and (node in self._model_nodes or node.name().endswith("AccumulateGrad")):
            return "backward", model_part
        if self.part == "model" and node is None:
            return "forward", model_part
        return "step", {"backward": "deepspeed backward"}.get(self.part, self.part)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        if func.is_view or name in NO_KERNEL:
            return out
        packet = func.overloadpacket
        flops = float(flop_registry[packet](*args, **kwargs, out_val=out)) if packet in flop_registry else 0.0
        kind = "collective" if name.startswith(COLLECTIVE_PREFIXES) else ("matmul" if flops > 0 else "other")
        mutated, out_args = _written_arguments(func, args, kwargs)
        inputs = [t for t in _tensors((args, kwargs)) if not any(t is o for o in out_args)]
        outputs = [t for t in _tensors(out) if not any(t is i for i in [*inputs, *out_args])] + mutated
        written, read = [self._access(t) for t in outputs], [self._access(t) for t in inputs]
        phase, part = self._phase_and_part()
        first_list = next((a for a in args if isinstance(a, (list, tuple))), ())
        multi = name.startswith(("aten._foreach_", "aten._fused_"))
        tensors = [t.numel() for t in first_list if isinstance(t, torch.Tensor)] if multi else []
        host = self.on_meta and all(t.device.type == "cpu" for t in _tensors(out))
        region = self._region or self._node_regions.get(torch._C._current_autograd_node())  # (backward: its node's)
        self.ops.append(Op(name, kind, flops, read, written, region, phase, part, tensors, host))
        return out

    def region(self, fn, label: str):
        """``fn`` as a compiled region ``label`` (forward and backward; a region inside one is the outer one's)."""

        def traced(*args, **kwargs):
            if self._region is not None:
                return fn(*args, **kwargs)
            self._calls += 1  # each call its own kernels: a compiled graph does not fuse across calls
            region = self._region = (label, self._calls)
            try:
                out = fn(*args, **kwargs)
            finally:
                self._region = None
            _claim(out, (args, kwargs), self._node_regions, region,
                   keep=lambda node: not node.name().endswith("AccumulateGrad"))  # fmt: skip
            return out

        return traced

    def model_call(self, fn):
        """``fn`` as the model's forward: its operators, and the backward of its autograd nodes, are the model's."""

        def model(*args, **kwargs):
            with self.running("model"):
                out = fn(*args, **kwargs)
            outputs = vars(out) if dataclasses.is_dataclass(out) else out
            _claim(outputs, (args, kwargs), self._model_nodes, True)
            return out

        return model

    def graph_break(self, fn):
        """``fn`` as code torch.compile leaves out of its graph: run eagerly, a new graph after it."""

        def eager(*args, **kwargs):
            if self._region is None:
                return fn(*args, **kwargs)
            label, self._region = self._region[0], None
            try:
                return fn(*args, **kwargs)
            finally:
                self._calls += 1
                self._region = (label, self._calls)

        return eager

    @contextlib.contextmanager
    def running(self, part: str):
        """Operators dispatched in the block (outside backward's nodes) are ``part``'s; as a decorator, each call's."""
        before, self.part = self.part, part
        try:
            yield
        finally:
            self.part = before


@dataclasses.dataclass
class RealStep:
    ops: list[Op]  # every operator of one train_step
    hook_calls: int  # Python hook calls during it (autograd hooks, module hooks)

    @property
    def rest(self) -> list[Op]:
        return [op for op in self.ops if op.phase == "step"]


def real_step_overrides(scratch: Path, quick: bool, micro_batch: int = 1) -> list[str]:
    """A real step at gpt2.yaml's parameter count (micro-batch 1: DeepSpeed's work does not depend on it)."""
    corpus = scratch / "corpus.txt"
    if not corpus.exists():
        corpus.write_text("\n".join(f"line {i} of a corpus for a traced step" for i in range(64)) + "\n")
    return [
        *(GPT2_SHRUNK if quick else []), "feature_model.pretrained=false", "training.precision=bf16",
        f"data.path={corpus}", "data.min_eval_samples=1", "data.eval_fraction=0.1", f"data.cache_dir={scratch}/c",
        f"training.micro_batch_size={micro_batch}", "training.max_steps=3", f"logging.run_dir={scratch}/run",
        *QUIET_RUN, "logging.print_samples=0", "checkpoint.save_final=false", "training.device=cpu",
        "optimizer.fused=on",  # what CUDA runs (torch's fused AdamW, one pass per group): the CPU has it too
    ]  # fmt: skip


class HookCalls:
    """Python hook calls (``sys.setprofile``): the autograd engine's direct Python callees other than
    custom Functions, and the hook functions registered on the modules."""

    def __init__(self, module: torch.nn.Module):
        self.calls = 0
        self.hook_codes = {getattr(hook, "__code__", None) for m in module.modules() for hooks in
                           (m._forward_pre_hooks, m._forward_hooks, m._backward_hooks, m._backward_pre_hooks)
                           for hook in hooks.values()}  # fmt: skip

    def _profile(self, frame, event, _arg):
        if event != "call":
            return
        caller, code = frame.f_back, frame.f_code
        from_engine = caller is not None and caller.f_code.co_name == "_engine_run_backward"
        # (the engine also calls custom Functions' backward through ``apply``, and logging for a warning)
        hook = from_engine and code.co_name != "apply" and not code.co_filename.startswith(STDLIB)
        if hook or code in self.hook_codes:
            self.calls += 1

    def __enter__(self):
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


def real_step(overrides: list[str]) -> RealStep:
    """One ``train_step`` of a trainer of gpt2.yaml with ``overrides`` in this process (after an untraced one)
    under a :class:`StepTracer`, its parts marked; the hook calls counted in a step of their own (the tracer's
    dispatch runs Python too)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with started_trainer(load_config(GPT2, overrides), source=str(GPT2)) as trainer:
        trainer.train_step()
        with HookCalls(trainer.engine.module) as hooks:
            trainer.train_step()
        tracer, engine = StepTracer(), trainer.engine
        engine.module.forward = tracer.model_call(engine.module.forward)
        engine.backward = tracer.running("backward")(engine.backward)
        engine.step = tracer.running("optimizer")(engine.step)
        try:
            with tracer.running("trainer"), tracer:
                trainer.train_step()
        finally:
            del engine.module.forward, engine.backward, engine.step
    return RealStep(tracer.ops, hooks.calls)


def _traced_rank(scratch: str, quick: bool) -> RealStep:
    return real_step([*real_step_overrides(Path(scratch), quick), "parallel.tensor_parallel=1"])


def real_step_on_ranks(world: int, quick: bool) -> RealStep:
    """Rank 0's :func:`real_step` with ``world`` data-parallel gloo ranks (spawned processes)."""
    with tempfile.TemporaryDirectory(prefix="bench-projection-ranks.") as scratch:
        real_step_overrides(Path(scratch), quick)  # the corpus, before any rank reads it
        return on_ranks(world, _traced_rank, scratch, quick)
