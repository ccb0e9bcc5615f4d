"""The operators of one training step, for the performance model (benchmarks/performance.py): every dispatched operator
that launches a kernel, with its FLOPs, the bytes it reads and writes, the compiled region it runs
in, and which part of the step asked for it.

Two traces make one step:

* the model's forward and backward (the loss included), on the **meta** device at the row's batch:
  the real model in bf16, no FLOP spent; every device choice the code makes on CUDA (or, for the
  CPU check, on the CPU) is made as there: attention's kernel, the compiled dropout mask and loss
  chunks, ``training.compile``'s blocks;
* everything else of ``Trainer.train_step``, from a **real** step on the CPU (the DeepSpeed engine
  and all, at gpt2.yaml's parameter count, micro-batch 1): the trainer's own work, DeepSpeed's in
  backward (its gradient hooks or the bulk path of ``parallel_latent/zero/patches.py``) and
  its optimizer step, the Python hook calls among them counted.

Which trace an operator of the real step belongs to is decided the same way in both: inside the
model's ``forward`` call, or run by an autograd node of the backward graph (the model's, the
loss's, AccumulateGrad's), it is the model's; anything else (the trainer, DeepSpeed, the root of
backward) is the rest of the step. A test runs a small config's real CPU step under this tracer and
checks that the meta trace (with the CPU's choices) plus the rest is every operator it dispatched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from benchmarks.harness import GPT2, on_ranks, started_trainer

# Operators that launch nothing: allocation, metadata, aliasing.
NO_KERNEL = {
    "aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default", "aten.new_empty.default",
    "aten.new_empty_strided.default", "aten.detach.default", "aten._unsafe_view.default", "aten.alias.default",
    "aten.lift_fresh.default", "aten.set_.source_Storage_storage_offset", "aten.resize_.default",
}  # fmt: skip
COLLECTIVE_PREFIXES = ("c10d.", "_c10d_functional.", "c10d_functional.")
SHRINK = ["model.d_model=64", "model.n_heads=4", "model.n_encoder_layers=2", "model.n_decoder_layers=2",
          "feature_model.n_layer=4", "feature_model.n_head=4", "feature_model.n_embd=64"]  # fmt: skip


@dataclasses.dataclass
class Op:
    name: str
    kind: str  # "matmul", "collective" or "other"
    flops: float
    reads: list[tuple[int, tuple, int]]  # (storage key, (first element, elements spanned, element size), bytes)
    writes: list[tuple[int, tuple, int]]
    region: tuple[str, int] | None  # the compiled region's label and call it runs in, None: eager
    phase: str  # "forward", "backward" (the model's), "step" (the rest of train_step)
    part: str  # "loss" (the cross-entropy, forward and backward), "model", or the rest's "trainer",
    # "deepspeed backward" (during engine.backward) and "optimizer" (engine.step)
    tensors: list[int] = dataclasses.field(default_factory=list)  # elements of each tensor of a multi-tensor op
    host: bool = False  # only host tensors out of a meta trace (a Python scalar's tensor): no kernel

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
    """Records every operator that launches a kernel, with the compiled region it belongs to (in
    forward the innermost :meth:`region` being run, in backward the region whose forward created
    the autograd node being run) and the part of the step that asked for it (:attr:`part`, set by
    the caller around each part; in backward, an operator an autograd node runs is the model's)."""

    def __init__(self):
        super().__init__()
        self.ops: list[Op] = []
        self.part = "model"  # what the caller is running: "model", "trainer", "backward", "optimizer"
        self.within: str | None = None  # inside the model: "loss" or "features" (the frozen pass), see _marked
        self.on_meta = False  # a meta trace: what it makes on the CPU stays on the host
        self._region: tuple[str, int] | None = None
        self._calls = 0
        self._node_regions: dict = {}
        self._model_nodes: set = set()  # the autograd nodes created inside the model's forward
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
        flops = 0.0
        if func.overloadpacket in flop_registry:
            flops = float(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))
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
        self.ops.append(Op(name, kind, flops, read, written, self._current_region(), phase, part, tensors, host))
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

    def model_call(self, fn):
        """``fn`` as the model's forward: its operators, and the backward of the autograd nodes it
        creates, are the model's."""
        tracer = self

        def model(*args, **kwargs):
            with tracer.running("model"):
                out = fn(*args, **kwargs)
            stop = {t.grad_fn for t in _tensors((args, kwargs)) if t.grad_fn is not None}
            frontier = [t.grad_fn for t in _tensors(vars(out) if dataclasses.is_dataclass(out) else out)]
            while frontier:
                node = frontier.pop()
                if node is None or node in stop or node in tracer._model_nodes:
                    continue
                tracer._model_nodes.add(node)
                frontier.extend(next_node for next_node, _ in node.next_functions)
            return out

        return model

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

    @contextlib.contextmanager
    def running(self, part: str):
        """Operators dispatched inside the block (outside backward's nodes) count as ``part``'s."""
        before, self.part = self.part, part
        try:
            yield
        finally:
            self.part = before


# --------------------------------------------------------------------------- #
# Attention as each device runs it.
# --------------------------------------------------------------------------- #


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


def cpu_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
    """What SDPA runs on the CPU: a boolean mask turned into an additive one, then its flash kernel."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        zero, minus_inf = (torch.scalar_tensor(v, dtype=query.dtype) for v in (0.0, -math.inf))
        attn_mask = torch.where(attn_mask, zero, minus_inf)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )[0]


ATTENTION = {"cuda": cuda_attention, "cpu": cpu_attention}


@contextlib.contextmanager
def _patched(owner, name: str, replacement):
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _marked(tracer: StepTracer, owner, name: str, part: str):
    """``owner.name`` (a function the model calls), its operators marked as ``part``'s: the loss
    (its backward is found by node name), the features (the frozen pass: no backward)."""
    function = getattr(owner, name)

    def marked(*args, **kwargs):
        tracer.within = part
        try:
            return function(*args, **kwargs)
        finally:
            tracer.within = None

    return _patched(owner, name, marked)


def _loss_marked(tracer: StepTracer):
    from parallel_latent.model import autoencoder

    return _marked(tracer, autoencoder, "vocab_parallel_cross_entropy", "loss")


@contextlib.contextmanager
def fake_tp_group(tp: int):
    """A TP group of ``tp`` ranks inside this one process, for a meta trace at TP > 1: torch's
    ``fake`` backend (its collectives return at once, dispatched as operators the tracer records:
    the model's own, at their real shapes), this process its rank 0. None at TP=1 (no group: the
    model in one process)."""
    if tp == 1:
        yield None
        return
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError(f"a meta trace at TP={tp} makes a fake process group, and this process has one already")
    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _feature_model_from(recorded: dict | None):
    """The model's feature model rebuilt from ``recorded`` (a whole transformers config, as a
    checkpoint's record rebuilds it: any MLP width, any kv heads) instead of the random build's few
    keys (whose MLP is 4x the width); nothing changed without one."""
    from parallel_latent.model import autoencoder, features

    if recorded is None:
        return contextlib.nullcontext()

    def rebuilt(feature_cfg, vocab_size, _recorded=None, tp_group=None):
        # Built at the model's vocabulary: a token table grown on meta cannot draw its new rows.
        return features.FeatureModel(feature_cfg, vocab_size, {**recorded, "vocab_size": vocab_size}, tp_group)

    return _patched(autoencoder, "FeatureModel", rebuilt)


# --------------------------------------------------------------------------- #
# The model's forward and backward, on meta.
# --------------------------------------------------------------------------- #


def row_config(setting: dict, quick: bool, config: Path = GPT2):
    from parallel_latent.config import load_config

    overrides = [*(SHRINK if quick else []), "feature_model.pretrained=false", "training.precision=bf16"]
    overrides += [f"{k}={v}" for k, v in setting.items()]
    return load_config(config, overrides)


def meta_model(cfg, tracer: StepTracer, device: str = "cuda", tp_group=None, recorded: dict | None = None):
    """The model of ``cfg`` on the meta device in bf16, its compiled regions as ``device`` runs them;
    this rank's part of it over ``tp_group`` (:func:`fake_tp_group`), its feature model rebuilt from
    ``recorded`` if given (:func:`_feature_model_from`)."""
    from parallel_latent.model import build_model, perceiver
    from parallel_latent.parallel import LossKernels
    from parallel_latent.parallel.dropout import KERNELS

    compile_blocks = cfg.training.compile and device == "cuda"  # (traced as regions below: compiling on meta fails)
    cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, compile=False))
    # The head's scale reads the token table's std (a value meta has not got; it changes no cost).
    dtype = torch.bfloat16 if cfg.training.precision == "bf16" else torch.float32
    scale = _patched(perceiver, "token_table_scale", lambda table: 1.0)
    with torch.device("meta"), scale, _feature_model_from(recorded):
        model = build_model(cfg, tp_group).to(dtype).train()
    kernels = LossKernels.compiled() if compile_blocks else model.loss_kernels.on(torch.device(device))
    rng = model.dropout_rng
    if device in rng.compile_devices:  # the mask kernel, compiled there (training.compile_dropout)
        rng.compile_devices = ("meta",)
        rng._kernels = {name: tracer.region(fn, "dropout mask") for name, fn in KERNELS.items()}
    else:
        rng.compile_devices = ()
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


def trace_model(
    cfg, device: str = "cuda", micro_batch: int | None = None, tp_group=None, recorded: dict | None = None
) -> list[Op]:
    """The model's operators in one micro-batch's forward and backward, on meta, as ``device``
    runs them (one rank's over ``tp_group``, its collectives included; the frozen pass's operators,
    the all-gather of split features among them, marked ``features``); the second of two (the first
    fills what the model caches, as a real run's first step does)."""
    tracer = StepTracer()
    tracer.on_meta = True
    model = meta_model(cfg, tracer, device, tp_group, recorded)
    micro, length = micro_batch or cfg.training.micro_batch_size, cfg.model.max_length
    ids = torch.zeros(micro, length, dtype=torch.long, device="meta")
    mask = torch.ones(micro, length, dtype=torch.long, device="meta")
    for _ in range(2):
        tracer.ops.clear()
        with (
            tracer,
            _patched(F, "scaled_dot_product_attention", ATTENTION[device]),
            _loss_marked(tracer),
            _marked(tracer, model, "features", "features"),
        ):
            out = tracer.model_call(model)(ids, mask)
            with tracer.running("trainer"):  # the trainer's weighting of the loss: the rest of the step's
                loss = out.trained_loss_sum * 1.0
            with tracer.running("backward"):
                loss.backward()
        model.zero_grad(set_to_none=True)
    return [op for op in tracer.ops if op.phase != "step"]


# --------------------------------------------------------------------------- #
# The real step on the CPU: the rest of it.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class RealStep:
    ops: list[Op]  # every operator of one train_step
    hook_calls: int  # Python hook calls during it (autograd hooks, module hooks)

    @property
    def rest(self) -> list[Op]:
        return [op for op in self.ops if op.phase == "step"]


def real_step_overrides(scratch: Path, quick: bool, micro_batch: int = 1) -> list[str]:
    corpus = scratch / "corpus.txt"
    if not corpus.exists():
        corpus.write_text("\n".join(f"line {i} of a corpus for a traced step" for i in range(64)) + "\n")
    return [
        *(SHRINK if quick else []), "feature_model.pretrained=false", "training.precision=bf16",
        f"data.path={corpus}", "data.min_eval_samples=1", "data.eval_fraction=0.1", f"data.cache_dir={scratch}/c",
        f"training.micro_batch_size={micro_batch}", "training.eval_every=0", "training.max_steps=3",
        f"logging.run_dir={scratch}/run", "logging.tensorboard=false", "logging.progress_bar=false",
        "logging.print_samples=0", "checkpoint.save_every=0", "checkpoint.export_portable=false",
        "checkpoint.resume=never", "checkpoint.save_final=false", "training.device=cpu",
        "optimizer.fused=on",  # what CUDA runs (torch's fused AdamW, one pass per group): the CPU has it too
    ]  # fmt: skip


STDLIB = sysconfig.get_paths()["stdlib"]


class HookCalls:
    """Python functions the autograd engine or a module's call runs as hooks (``sys.setprofile``):
    autograd hooks are the engine's direct Python callees other than custom Functions, module hooks
    the registered hook functions a module call runs."""

    def __init__(self, module: torch.nn.Module):
        self.calls = 0
        self.hook_codes = {
            getattr(hook, "__code__", None)
            for m in module.modules()
            for hooks in (m._forward_pre_hooks, m._forward_hooks, m._backward_hooks, m._backward_pre_hooks)
            for hook in hooks.values()
        }

    def _profile(self, frame, event, _arg):
        if event != "call":
            return
        caller, code = frame.f_back, frame.f_code
        from_engine = caller is not None and caller.f_code.co_name == "_engine_run_backward"
        # (the engine also calls custom Functions' backward, through ``apply``, and, when a warning is
        # due, the standard library's logging)
        hook = from_engine and code.co_name != "apply" and not code.co_filename.startswith(STDLIB)
        if hook or code in self.hook_codes:
            self.calls += 1

    def __enter__(self):
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


def traced_train_step(trainer) -> RealStep:
    """One ``train_step`` of a real trainer (after one untraced step: the optimizer's state exists,
    the caches are filled) under a :class:`StepTracer`, its parts marked; the hook calls counted in
    a step of their own (the tracer's dispatch runs Python too)."""
    trainer.train_step()
    with HookCalls(trainer.engine.module) as hooks:
        trainer.train_step()
    tracer, engine = StepTracer(), trainer.engine
    module_forward, backward, step = engine.module.forward, engine.backward, engine.step

    def marked(fn, part):
        def run(*args, **kwargs):
            with tracer.running(part):
                return fn(*args, **kwargs)

        return run

    engine.module.forward = tracer.model_call(module_forward)
    engine.backward, engine.step = marked(backward, "backward"), marked(step, "optimizer")
    try:
        with tracer.running("trainer"), tracer:
            trainer.train_step()
    finally:
        del engine.module.forward, engine.backward, engine.step
    return RealStep(tracer.ops, hooks.calls)


def real_step(overrides: list[str], config: Path = GPT2) -> RealStep:
    """:func:`traced_train_step` of a trainer of ``config`` with ``overrides``, in this process."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from parallel_latent.config import load_config

    with started_trainer(load_config(config, overrides), source=str(config)) as trainer:
        return traced_train_step(trainer)


def _traced_rank(scratch: str, quick: bool) -> RealStep:
    return real_step([*real_step_overrides(Path(scratch), quick), "parallel.tensor_parallel=1"])


def real_step_on_ranks(world: int, quick: bool) -> RealStep:
    """Rank 0's :func:`real_step` with ``world`` data-parallel gloo ranks (spawned processes)."""
    with tempfile.TemporaryDirectory(prefix="bench-projection-ranks.") as scratch:
        real_step_overrides(Path(scratch), quick)  # the corpus, before any rank reads it
        return on_ranks(world, _traced_rank, scratch, quick)
