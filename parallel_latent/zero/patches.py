"""Every patch of DeepSpeed's private API, each checked against the releases it was written for
(:data:`.version.SUPPORTED`).

DeepSpeed has no public hook for what these do, so they reach into its classes:

- :func:`sync_free_zero_step`: the bf16 ZeRO-1/2 optimizer step without host synchronisations (two of
  its methods rebound on one optimizer instance, and its model-parallel all-reduce). Outside the
  range, DeepSpeed's own step is still correct, only slower: one warning, and it runs as shipped.
- :func:`bulk_zero_gradients`: ZeRO-1/2's gradient handling (its per-parameter hooks removed, its
  reduction epilogue rebound on one optimizer instance) so that gradients reach the step in one
  multi-tensor copy and one reduction. Outside the range: one warning, DeepSpeed's hooks run.
- :func:`skip_unused_cpu_comm_kernel`: DeepSpeed's compatible-ops table, so that the CPU accelerator
  does not JIT-build a kernel training never calls. Outside the range: one warning, the build happens.
- :func:`zero_optimizer_check_without_muon`: the engine's "is this a ZeRO-tested optimizer" check,
  answered from DeepSpeed's list without importing its Muon optimizer (whose import compiles kernels:
  seconds of every rank's start-up). Outside the range: one warning, DeepSpeed's check runs.
- :func:`checkpoint_reads` and :func:`checkpoint_writes`: the engine's checkpoint engine (its
  ``load``, ``save`` and ``makedirs``) and its recovery-script copy, so that checkpoints load without
  running pickled code and a failed write is reported by every rank instead of hanging the others.
  Skipping these would change what is safe to load and how a full disk ends a run, so outside the
  range the job stops before any work: :func:`.version.require_supported_deepspeed` (one line, exit
  status 2).
- :func:`relink_optimizer_state`, :func:`has_zero_master`, :func:`report_grad_norm`: the private
  attributes through which DeepSpeed's ZeRO-1/2 optimizer maps parameters to its flat partitions, and
  its engine reads an optimizer's gradient norm.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from types import MethodType

import torch

from .version import require_supported_deepspeed, usable

__all__ = [
    "bulk_zero_gradients",
    "checkpoint_reads",
    "checkpoint_writes",
    "has_zero_master",
    "relink_optimizer_state",
    "report_grad_norm",
    "skip_unused_cpu_comm_kernel",
    "sync_free_zero_step",
    "zero_optimizer_check_without_muon",
]


# --------------------------------------------------------------------------- #
# The bf16 ZeRO-1/2 step without host synchronisations.
# --------------------------------------------------------------------------- #


def sync_free_zero_step(optimizer, version: str | None = None) -> bool:
    """Make the bf16 step of one ZeRO-1/2 optimizer (``DeepSpeedZeroOptimizer``) free of host
    synchronisations and of tensors built from Python data; True if it applied.

    DeepSpeed 0.19's step (``stage_1_and_2.py: step``) at bf16 without the overflow scan
    (``check_grad_overflow: False``) computes the global gradient norm, clips, runs our AdamW on each
    group's flat fp32 partition, copies it back to the bf16 weights and all-gathers them over the
    data-parallel group. Two of its per-step helpers, called once per parameter group, wait for the
    device, and one launches a kernel per parameter:

    - ``get_grad_norm_direct``: one ``vector_norm`` of ``g.to(fp64)`` per gradient tensor (2 kernels
      per tensor), then ``mask_nan_or_inf_with_val_inplace``, whose ``torch.tensor(-1.0,
      device=...)`` is a blocking host-to-device copy. Replaced by :func:`_grad_norm_direct`: the
      same tensors (the model-parallel filter: split parameters on every TP rank, replicated ones
      on TP rank 0 only), one ``torch._foreach_norm`` in DeepSpeed's norm dtype, the same
      stack/pow/sum, all-reduces and root, and the NaN/inf -> -1 mask as a scalar ``masked_fill_``.
    - ``unscale_and_clip_grads``: ``is_invalid_grad_norm(norm)`` is ``bool(tensor)``, a device read
      (DeepSpeed then substitutes an infinite norm). Replaced by :func:`_unscale_and_clip_grads`:
      the substitution as a ``masked_fill`` on the device, then DeepSpeed's own arithmetic,
      ``clamp(((norm / scale) + 1e-6) / clip, min=1) * scale`` and ``grad.mul_(1 / that)``.

    Everything else is DeepSpeed's: the step, the partitioning, the optimizer state and its
    checkpoints (one format for every layout), the skip decision (under bf16 without the scan,
    ``overflow`` stays the Python ``False``, so ``engine.was_step_applied()`` reads no device
    value), and the gradient norm (a device tensor, read only on log lines).

    Numbers: on the CPU ``_foreach_norm`` runs ``vector_norm`` per tensor in the requested dtype,
    which is DeepSpeed's own computation: the weights are bit-identical (tested). On CUDA its
    multi-tensor kernel accumulates each tensor's sum of squares in fp32 (written as fp64) where
    DeepSpeed's ``vector_norm`` of the fp64 copy accumulates in fp64: a sum of ``n`` positive
    terms in fp32 is within ``n * u`` (``u = eps_fp32 / 2``) of the exact one, so the global norm
    differs from DeepSpeed's by a relative ``n * eps_fp32 / 2`` at most (half that on the root,
    plus the final roundings), ``n`` the element count of the largest gradient tensor. The norm
    reaches the weights only through the clip coefficient: a step that does not clip (the
    coefficient clamps to 1) gives DeepSpeed's weights bit for bit on CUDA too.

    Only for the bf16 ZeRO-1/2 optimizer without CPU offload: fp16 decides on its loss scale on
    the host by design; ZeRO-3 (``stage3.py``) keeps its own helpers, and ZeRO stage 0 under bf16
    runs DeepSpeed's ``BF16_Optimizer``, whose norm and clip also read the device. The methods are
    bound to this instance only. Outside :data:`.version.SUPPORTED` it is skipped with one warning.
    """
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if type(optimizer) is not DeepSpeedZeroOptimizer:
        return False
    if optimizer.dtype != torch.bfloat16 or optimizer.check_grad_overflow or optimizer.cpu_offload:
        return False
    if not usable("sync-free bf16 ZeRO-1/2 step", version):
        return False
    optimizer.get_grad_norm_direct = MethodType(_grad_norm_direct, optimizer)
    optimizer.unscale_and_clip_grads = MethodType(_unscale_and_clip_grads, optimizer)
    return True


def _grad_norm_direct(self, gradients, params, norm_type=2):
    """DeepSpeedZeroOptimizer.get_grad_norm_direct (L2) with one multi-tensor norm and no host
    round trip; any other norm type goes to DeepSpeed's own."""
    from deepspeed import comm as dist
    from deepspeed.runtime.utils import is_model_parallel_parameter
    from deepspeed.runtime.zero.utils import get_norm_dtype

    if float(norm_type) != 2.0:
        return type(self).get_grad_norm_direct(self, gradients, params, norm_type)
    # DeepSpeed's selection: padding gradients dropped (zip then pairs the rest with their
    # parameters, as DeepSpeed's does: strict=False), a pipeline-replicated parameter not counted,
    # a replicated one counted on TP rank 0 only, a split one on every TP rank.
    unpadded = (g for g in gradients if not getattr(g, "_zero_padding", False))
    counted = [
        g.data
        for g, p in zip(unpadded, params, strict=False)
        if not getattr(p, "ds_pipe_replicated", False)
        and (is_model_parallel_parameter(p) or self.model_parallel_rank == 0)
    ]
    if counted:
        norms = torch._foreach_norm(counted, 2, dtype=get_norm_dtype())
        total = torch.stack(norms).to(self.device).pow(2.0).sum().float()
    else:  # nothing of this group is counted on this rank
        total = torch.zeros((), dtype=torch.float32, device=self.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
    total = total.pow(0.5)
    return total.masked_fill_(~torch.isfinite(total), -1.0)  # DeepSpeed's "invalid" sentinel


def _unscale_and_clip_grads(self, grad_groups_flat, total_norm):
    """DeepSpeedZeroOptimizer.unscale_and_clip_grads with the invalid-norm test on the device."""
    if not torch.is_tensor(total_norm) or (self.clip_grad == 0.0 and self.loss_scale == 1.0):
        return type(self).unscale_and_clip_grads(self, grad_groups_flat, total_norm)
    combined_scale = self.loss_scale
    if self.clip_grad > 0.0:
        # An invalid norm (non-finite, or DeepSpeed's -1 sentinel) clips as an infinite one.
        clip_norm = total_norm.masked_fill(~torch.isfinite(total_norm) | (total_norm < 0), math.inf)
        clip = ((clip_norm / self.loss_scale) + 1e-6) / self.clip_grad
        combined_scale = torch.clamp(clip, min=1.0) * self.loss_scale
    for grad in grad_groups_flat:
        for g in grad if isinstance(grad, list) else [grad]:
            g.data.mul_(1.0 / combined_scale)


# --------------------------------------------------------------------------- #
# ZeRO-1/2's gradients in bulk.
# --------------------------------------------------------------------------- #


def bulk_zero_gradients(optimizer, version: str | None = None) -> bool:
    """Hand one ZeRO-1/2 optimizer (``DeepSpeedZeroOptimizer``) its gradients in bulk after backward
    instead of parameter by parameter during it; True if it applied.

    DeepSpeed 0.19 registers a Python hook on every parameter's gradient accumulator. Each call
    copies that gradient into a reduction bucket, and at every bucket boundary and at the end of
    backward the bucket is cast to the communication dtype, reduced (a one-rank all-reduce at DP=1),
    cast back and copied, parameter by parameter, into the rank's partition; the step then flattens
    the partition and casts it to fp32 again. At configs/gpt2.yaml's size that is 455 kernels, about
    42 bytes moved per parameter and 217 Python calls per step, most of them at DP=1 where nothing
    is communicated. Its options do not remove them: ``overlap_comm`` only moves the copies to a
    side stream, ``contiguous_gradients: false`` trades them for per-bucket flattens, and the hooks
    are registered unconditionally.

    Here the hooks are removed and the reduction epilogue DeepSpeed's engine calls after backward
    (``overlapping_partition_gradients_reduce_epilogue`` at ZeRO-2, after every backward;
    ``reduce_gradients`` at ZeRO-1, at the accumulation boundary only) is rebound, on this instance
    only, to :class:`_BulkGradients`: one multi-tensor copy casts every gradient of the backward into
    a flat buffer laid out as DeepSpeed's flat parameter group (its round-robin order and padding;
    a later micro-batch of the step is added to it), and at the accumulation boundary the buffer is
    reduced with one all-reduce over the data-parallel group (none at DP=1) and divided by its
    size; the rank's slice of it is the step's gradient partition, handed over as DeepSpeed's own
    pre-flattened partition (``averaged_gradients`` with ``flat_partition``), with per-parameter
    views for the gradient norm. DeepSpeed's step, clipping, optimizer state, checkpoints and
    partitioning are unchanged.

    Numbers: at DP=1 without accumulation the step sees DeepSpeed's gradients bit for bit (its
    copies and one-rank reduction are exact there), and at ZeRO-1 with accumulation too (micro-
    batches sum in the parameters' bf16 ``.grad`` in both); at ZeRO-2 micro-batches sum in the fp32
    buffer where DeepSpeed sums them in bf16. At DP>1 the reduction runs in the communication dtype
    and, when that is the master dtype (fp32 under ``parallel.grad_reduce_dtype: fp32``), its
    result is kept unrounded where DeepSpeed rounds the reduced gradient back to bf16. Memory: each
    backward's bf16 gradients until its end (ZeRO-2 frees the other ranks' share during backward);
    between steps the rank's partition in fp32 (at DP>1 the whole group's buffer lives from a
    step's first backward to its reduction), where DeepSpeed keeps its buckets and a bf16 partition.

    Not applied (DeepSpeed's own path runs) with CPU offload, fp16 (its overflow checks read the
    per-bucket state), MoE or ZenFlow groups, gradients kept in a separate accumulation attribute,
    a non-default gradient pre-divide or averaging, or outside :data:`.version.SUPPORTED` (one warning).
    """
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if type(optimizer) is not DeepSpeedZeroOptimizer or optimizer.dtype == torch.float16:
        return False
    unsupported = (
        optimizer.cpu_offload,
        optimizer.has_moe_layers,
        optimizer.zenflow,
        optimizer.use_grad_accum_attribute,
        optimizer.gradient_predivide_factor != 1.0,
        not optimizer.gradient_average,
        any(optimizer._is_muon_group(group) for group in optimizer.bit16_groups if group),
    )
    if any(unsupported) or not usable("bulk ZeRO-1/2 gradient path", version):
        return False
    for hook in optimizer._grad_acc_hooks:
        hook.remove()
    optimizer._grad_acc_hooks = []
    bulk = _BulkGradients(optimizer)
    optimizer.overlapping_partition_gradients_reduce_epilogue = bulk.after_backward
    optimizer.reduce_gradients = lambda pipeline_parallel=False: bulk.after_backward()
    optimizer.bulk_gradients = bulk
    return True


class _BulkGradients:
    """The flat gradient buffers of one ZeRO-1/2 optimizer and the work after each backward.

    At DP=1 the flat buffer of a group is its partition, kept from step to step. At DP>1 the whole
    group's flat buffer lives from a step's first backward to its reduction only; the rank's slice
    of the reduced mean goes into a partition buffer of its own, kept (ZeRO-2 keeps no more than
    its share of the gradients between steps)."""

    def __init__(self, optimizer):
        from deepspeed import comm as dist
        from deepspeed.runtime.zero.stage_1_and_2 import GradPartitionBufferGroup

        self.optimizer, self.dist = optimizer, dist
        self.group_of = GradPartitionBufferGroup
        self.world = [dist.get_world_size(group=group) for group in optimizer.real_dp_process_group]
        groups = len(optimizer.bit16_groups)
        self.flats: list[torch.Tensor | None] = [None] * groups  # this step's landing buffers
        self.param_views: list[list[torch.Tensor]] = [[] for _ in range(groups)]  # round-robin order
        self.partitions: list = [None] * groups  # DeepSpeed's pre-flattened partition, kept
        self.fresh = True  # the next backward is the first of a step

    def _dtype(self, index: int) -> torch.dtype:
        """The master dtype where nothing is communicated, else the communication dtype."""
        master = self.optimizer.single_partition_of_fp32_groups[index].dtype
        return master if self.world[index] == 1 else self.optimizer.communication_data_type

    def _flat(self, index: int) -> torch.Tensor:
        """Group ``index``'s landing buffer for this step (zero where DeepSpeed pads: never written)."""
        if self.flats[index] is None:
            optimizer = self.optimizer
            size = int(optimizer.partition_size[index])
            flat = torch.zeros(size * self.world[index], dtype=self._dtype(index), device=optimizer.device)
            self.flats[index], self.param_views[index] = flat, self._views(index, flat)
            if self.partitions[index] is None:  # at DP=1 the landing buffer is the partition itself
                partition = flat if self.world[index] == 1 else torch.zeros(size, dtype=flat.dtype, device=flat.device)
                self.partitions[index] = self._partition_views(index, partition)
        return self.flats[index]

    def _views(self, index: int, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped as group ``index``'s parameters, where DeepSpeed's flat group holds them."""
        optimizer = self.optimizer
        params, offsets = optimizer.round_robin_bit16_groups[index], optimizer.round_robin_bit16_offsets[index]
        return [flat.narrow(0, o, p.numel()).view(p.shape) for p, o in zip(params, offsets, strict=True)]

    def _start(self, index: int) -> int:
        size = int(self.optimizer.partition_size[index])
        return self.dist.get_rank(group=self.optimizer.real_dp_process_group[index]) * size

    def _partition_views(self, index: int, flat: torch.Tensor):
        """``flat`` (this rank's slice of the group, or all of it at DP=1) as DeepSpeed's pre-flattened
        gradient partition: the views of the parameters it holds (part of one at either end), in
        ``params_in_partition`` order, with the padding between them marked as DeepSpeed marks it."""
        optimizer = self.optimizer
        size, start = int(optimizer.partition_size[index]), self._start(index)
        flat = flat.narrow(0, 0, size)
        offset_of = {id(p): o for p, o in zip(optimizer.round_robin_bit16_groups[index],
                                              optimizer.round_robin_bit16_offsets[index], strict=True)}  # fmt: skip
        views, covered = [], 0
        for param in optimizer.params_in_partition[index]:
            first = max(offset_of[id(param)] - start, 0)
            last = min(offset_of[id(param)] + param.numel() - start, size)
            if first > covered:
                views.append(_padding(flat.narrow(0, covered, first - covered)))
            view = flat.narrow(0, first, last - first)
            views.append(view.view(param.shape) if last - first == param.numel() else view)
            covered = last
        if covered < size:
            views.append(_padding(flat.narrow(0, covered, size - covered)))
        return self.group_of(views, flat)

    def after_backward(self) -> None:
        """Every gradient of this backward into the landing buffers (the first micro-batch of a step
        copied, later ones added in the buffer's dtype), the parameters' ``.grad`` released; at the
        accumulation boundary, the buffers reduced and handed to the step."""
        optimizer = self.optimizer
        for index, params in enumerate(optimizer.round_robin_bit16_groups):
            self._land(index, params)
        self.fresh = optimizer.is_gradient_accumulation_boundary()
        if not self.fresh:
            return
        for index, flat in enumerate(self.flats):
            partition = self.partitions[index]
            if self.world[index] > 1:
                self.dist.all_reduce(flat, group=optimizer.real_dp_process_group[index])
                size = partition.flat_partition.numel()
                torch.div(flat.narrow(0, self._start(index), size), self.world[index], out=partition.flat_partition)
                self.flats[index] = None  # the whole group's buffer lives for one step only
            optimizer.averaged_gradients[index] = partition

    def _land(self, index: int, params: list) -> None:
        flat, views = self._flat(index), self.param_views[index]
        # Later micro-batches land in a zeroed scratch flat (its padding must stay 0), added at once.
        target = flat if self.fresh else torch.zeros_like(flat)
        targets = views if self.fresh else self._views(index, target)
        landed = [(view, p.grad) for view, p in zip(targets, params, strict=True) if p.grad is not None]
        if landed:
            torch._foreach_copy_([view for view, _ in landed], [grad for _, grad in landed])
        if self.fresh and len(landed) < len(params):  # a parameter not reached: its gradient is 0
            torch._foreach_zero_([view for view, p in zip(views, params, strict=True) if p.grad is None])
        for param in params:
            param.grad = None
        if not self.fresh:
            flat.add_(target)


def _padding(view: torch.Tensor) -> torch.Tensor:
    view._zero_padding = True  # DeepSpeed's mark: left out of the gradient norm
    return view


# --------------------------------------------------------------------------- #
# The CPU accelerator's communication kernel.
# --------------------------------------------------------------------------- #


def skip_unused_cpu_comm_kernel(version: str | None = None) -> None:
    """On the CPU accelerator, keep DeepSpeed from JIT-compiling its shared-memory all-reduce
    kernel (``deepspeed_shm_comm``).

    DeepSpeed builds it when its communication backend starts, but only its *inference*
    all-reduce calls it; training collectives go through torch.distributed (gloo). The build
    needs a C++ toolchain, takes tens of seconds on a small machine, holds a machine-wide lock
    that serialises every starting rank, and is redone whenever another environment sharing
    ~/.cache/torch_extensions builds it with other paths. Marking the op incompatible makes
    DeepSpeed skip it, exactly as on a machine without a compiler.
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu" or not usable("skip of the unused CPU communication kernel", version):
        return
    builder = accelerator.create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def zero_optimizer_check_without_muon(version: str | None = None) -> contextlib.AbstractContextManager:
    """Inside the block, ``deepspeed.initialize`` asks whether the optimizer is one ZeRO was tested
    with by looking it up in DeepSpeed's list only.

    DeepSpeed's own check first imports its Muon optimizer to add it to that list, and that import
    runs ``torch.compile`` on Muon's kernels (which loads TorchDynamo): 2-5 s of every rank's
    start-up on a small machine, for an optimizer this trainer never builds (its AdamW and SGD are
    answered by the list alone, as before). The answer is the same; only the import is skipped.
    """
    if not usable("ZeRO optimizer check without the Muon import", version):
        return contextlib.nullcontext()
    import deepspeed.runtime.engine as ds_engine
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS

    def tested_with_zero(optimizer) -> bool:
        return type(optimizer) in ZERO_SUPPORTED_OPTIMIZERS

    return _replaced(ds_engine, is_zero_supported_optimizer=tested_with_zero)


# --------------------------------------------------------------------------- #
# The checkpoint engine.
# --------------------------------------------------------------------------- #


@contextlib.contextmanager
def _replaced(target, **attributes) -> Iterator[None]:
    originals = {name: getattr(target, name) for name in attributes}
    vars(target).update(attributes)
    try:
        yield
    finally:
        vars(target).update(originals)


def checkpoint_reads(engine, load: Callable) -> contextlib.AbstractContextManager:
    """Inside the block, the engine's checkpoint reads go through ``load(path, map_location=None)``
    (DeepSpeed's own calls ``torch.load(weights_only=False)``)."""
    require_supported_deepspeed()
    return _replaced(engine.checkpoint_engine, load=load)


@contextlib.contextmanager
def checkpoint_writes(
    engine, save: Callable, wrap: Callable[[Callable], Callable], recovery: Callable[[str], None]
) -> Iterator[None]:
    """Inside the block, the engine's checkpoint engine hands each file it writes to ``save(state_dict,
    path, zipfile)`` (``zipfile``: the engine's serialization setting) instead of writing it, and its
    ``makedirs`` runs through ``wrap(makedirs)``. Where DeepSpeed would copy its recovery scripts
    (``zero_to_fp32.py``, ``zero_to_torch.py``) beside the checkpoints, ``wrap(recovery)(directory)``
    runs instead: those scripts read one model-parallel rank's files, and stop on a TP > 1 checkpoint
    with a message that reads as damage."""
    require_supported_deepspeed()
    checkpoint_engine = engine.checkpoint_engine
    zipfile = getattr(checkpoint_engine, "zipfile_serialization", True)
    with (
        _replaced(
            checkpoint_engine,
            save=lambda state_dict, path: save(state_dict, path, zipfile),
            makedirs=wrap(checkpoint_engine.makedirs),
        ),
        _replaced(engine, _copy_recovery_script=wrap(recovery)),
    ):
        yield


# --------------------------------------------------------------------------- #
# ZeRO's private bookkeeping.
# --------------------------------------------------------------------------- #


def has_zero_master(param: torch.Tensor) -> bool:
    """Whether ZeRO-1/2 or the bf16 optimizer keeps ``param``'s fp32 master in a flat partition
    (``_hp_mapping`` exists, possibly None, on every parameter they manage)."""
    return hasattr(param, "_hp_mapping")


def relink_optimizer_state(optimizer) -> None:
    """Make DeepSpeed's ZeRO-1/2 optimizer map its per-parameter views onto the optimizer state again
    (after the state was created or replaced outside a step)."""
    link = getattr(optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        optimizer._hp_optimizer_states_linked = False
        link()


def report_grad_norm(optimizer, norm: float | None, overflow: bool) -> None:
    """What DeepSpeed's engine reads from a bare optimizer after its step: whether it skipped
    (``overflow``) and the global gradient norm (``engine.get_global_grad_norm()``)."""
    optimizer.overflow = overflow
    optimizer._global_grad_norm = norm
