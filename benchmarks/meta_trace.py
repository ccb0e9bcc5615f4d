"""The model's forward and backward traced on the **meta** device (benchmarks/step_trace.py's tracer) at a
row's batch: the real model in bf16, no FLOP spent, every device choice the code makes on CUDA (or, for
the CPU check, on the CPU) made as there: attention's kernel, the compiled dropout mask and loss chunks,
``training.compile``'s blocks (a ``torch.compiler.disable`` function inside one runs eagerly and starts
a new graph after it); at TP > 1 one rank's part over a fake process group."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from unittest import mock

import torch
import torch.nn.functional as F

from benchmarks.harness import GPT2, GPT2_SHRUNK
from benchmarks.step_trace import Op, StepTracer
from parallel_latent.config import load_config


def cuda_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
    """What a masked bf16 SDPA runs on CUDA: memory-efficient attention, a boolean mask made a bias by one kernel."""
    bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            zero = torch.zeros((), dtype=query.dtype, device=query.device)
            attn_mask = torch.where(attn_mask, zero, torch.finfo(query.dtype).min)
        bias = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention
    return efficient(query, key, value, bias, needs_grad, dropout_p, is_causal and bias is None, scale=scale)[0]


def cpu_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
    """What SDPA runs on the CPU: a boolean mask turned into an additive one, then its flash kernel."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        zero, minus_inf = (torch.scalar_tensor(v, dtype=query.dtype) for v in (0.0, -math.inf))
        attn_mask = torch.where(attn_mask, zero, minus_inf)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return flash(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


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

    return mock.patch.object(owner, name, marked)


@contextlib.contextmanager
def fake_tp_group(tp: int):
    """A TP group of ``tp`` ranks inside this one process (None at TP=1), for a meta trace at TP > 1: torch's
    ``fake`` backend, whose collectives return at once, dispatched as operators the tracer records."""
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
    """The model's feature model rebuilt from ``recorded`` (a whole transformers config, as a checkpoint's
    record rebuilds it) instead of the random build's few keys (an MLP 4x the width); as is without one."""
    from parallel_latent.feature_model import features
    from parallel_latent.model import autoencoder

    def rebuilt(feature_cfg, vocab_size, _recorded=None, tp_group=None, _planned=None):
        # Built at the model's vocabulary: a token table grown on meta cannot draw its new rows.
        return features.FeatureModel(feature_cfg, vocab_size, {**recorded, "vocab_size": vocab_size}, tp_group)

    return contextlib.nullcontext() if recorded is None else mock.patch.object(autoencoder, "FeatureModel", rebuilt)


def row_config(setting: dict, quick: bool):
    overrides = [*(GPT2_SHRUNK if quick else []), "feature_model.pretrained=false", "training.precision=bf16"]
    return load_config(GPT2, overrides + [f"{k}={v}" for k, v in setting.items()])


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
    scale = mock.patch.object(perceiver, "token_table_scale", lambda table: 1.0)
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


def trace_model(cfg, device: str = "cuda", tp_group=None, recorded: dict | None = None) -> list[Op]:
    """The model's operators in one micro-batch's forward and backward, on meta, as ``device``
    runs them (one rank's over ``tp_group``, its collectives included; the frozen pass's operators,
    the all-gather of split features among them, marked ``features``); the second of two (the first
    fills what the model caches, as a real run's first step does)."""
    from parallel_latent.model import autoencoder

    tracer = StepTracer(on_meta=True)
    model = meta_model(cfg, tracer, device, tp_group, recorded)
    micro, length = cfg.training.micro_batch_size, cfg.model.max_length
    ids = torch.zeros(micro, length, dtype=torch.long, device="meta")
    mask = torch.ones(micro, length, dtype=torch.long, device="meta")
    attention = {"cuda": cuda_attention, "cpu": cpu_attention}[device]
    for _ in range(2):
        tracer.ops.clear()
        with (tracer, mock.patch.object(F, "scaled_dot_product_attention", attention),
              _marked(tracer, autoencoder, "vocab_parallel_cross_entropy", "loss"),
              _marked(tracer, model, "features", "features")):  # fmt: skip
            out = tracer.model_call(model)(ids, mask)
            with tracer.running("trainer"):  # the trainer's weighting of the loss: the rest of the step's
                loss = out.trained_loss_sum * 1.0
            with tracer.running("backward"):
                loss.backward()
        model.zero_grad(set_to_none=True)
    return [op for op in tracer.ops if op.phase != "step"]
