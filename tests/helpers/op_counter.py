"""Counting what a piece of code asks the device to do: benchmarks/op_counter.py's :class:`OpCounter`
(operators dispatched, tensors built from Python data and the package's frame that asked for them),
for the step tests.

:class:`HostSyncCounter` adds the reads that would make the host wait for a GPU. On a CPU every
tensor is a host tensor, so it classifies by what the read would do on CUDA: every tensor is taken
to live on the training device except those declared host-resident (``host_tensors``: e.g. the
step counters of a non-fused torch optimizer, which torch keeps on the CPU on every device)."""

from __future__ import annotations

import collections
import traceback
from collections.abc import Iterable
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from benchmarks.op_counter import FROM_PYTHON_DATA, OpCounter

# Operators whose result the host must wait for: a device scalar read (item(), bool(), float(),
# int() of a tensor), and outputs whose shape depends on the data.
SYNCING_OPS = (
    "aten._local_scalar_dense",
    "aten.is_nonzero",
    "aten.nonzero",
    "aten.masked_select",
    "aten._unique",
    "aten.unique",
    "aten._unique2",
    "aten.repeat_interleave.Tensor",
)
# Indexing with a boolean mask (``x[mask]``, ``x[mask] = v``): dispatched as itself, but on CUDA
# its kernel first turns the mask into indices with a nonzero, which waits for the device.
MASK_INDEXING_OPS = ("aten.index.Tensor", "aten.index_put", "aten._index_put_impl_")
# Tensor methods that copy a device tensor to the host (not dispatched for a CPU tensor, which
# they return as it is, so seen one level up, as torch functions). ``.to(device)`` is not among
# them: on a CPU a copy to the host cannot be told from one to the training device.
HOST_COPIES = ("cpu", "tolist", "numpy")


def any_caller() -> str:
    """``file:line`` of the innermost frame outside torch and this module, whoever's it is
    (``deepspeed/runtime/utils.py:887``, ``train.py:415``)."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if "/torch/" in frame.filename or frame.filename == __file__:
            continue
        parts = Path(frame.filename).parts
        return f"{'/'.join(parts[-3:])}:{frame.lineno}"
    return "?"


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class _HostCopyWatch(TorchFunctionMode):
    """Calls of ``.cpu()``, ``.tolist()`` and ``.numpy()`` on a device tensor."""

    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in HOST_COPIES and args and isinstance(args[0], torch.Tensor) and self.counter.on_device(args[0]):
            self.counter.record(f"Tensor.{name}")
        return func(*args, **kwargs)


def _has_mask_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


class HostSyncCounter(OpCounter):
    """An :class:`OpCounter` that also records, with their callers, the host synchronisations the
    code would cost on CUDA (:data:`SYNCING_OPS` and copies to the host of a device tensor) and every
    tensor built from Python data, whoever asked (``from_python_callers``)."""

    instruments = (*OpCounter.instruments, __file__)

    def __init__(self, host_tensors: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.host_storages = {_storage_key(t) for t in host_tensors}
        self.syncs: collections.Counter = collections.Counter()  # "op at file:line" -> count
        self.from_python_callers: collections.Counter = collections.Counter()
        self._copies = _HostCopyWatch(self)

    def on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type != "meta" and _storage_key(tensor) not in self.host_storages

    def record(self, what: str) -> None:
        self.syncs[f"{what} at {any_caller()}"] += 1

    def __enter__(self):
        self._copies.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._copies.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        reads_device = name.startswith(SYNCING_OPS) and any(
            isinstance(a, torch.Tensor) and self.on_device(a) for a in args
        )
        if reads_device or (name.startswith(MASK_INDEXING_OPS) and _has_mask_index(args)):
            self.record(name)
        if name.startswith(FROM_PYTHON_DATA):
            self.from_python_callers[any_caller()] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)
