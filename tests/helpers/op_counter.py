"""Counting what a piece of code asks the device to do, with a dispatch mode (used by the step tests
and benchmarks/bench_model.py): operators dispatched, and tensors built from Python data
(``torch.tensor([...])`` and friends dispatch ``aten.lift_fresh``; on a GPU each such tensor is a
copy from pageable host memory that waits for the device), with the frame of the package that
asked for them.

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
from torch.utils._python_dispatch import TorchDispatchMode

PACKAGE = str(Path(__file__).resolve().parents[2] / "parallel_latent")
FROM_PYTHON_DATA = ("aten.lift_fresh", "aten.lift_fresh_copy")
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


def package_caller(package: str = PACKAGE) -> str | None:
    """``file:line`` of the code that asked, if it is ``package``'s: the innermost frame outside
    torch itself and this module (None when that frame is a third party's, e.g. DeepSpeed's)."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if "/torch/" in frame.filename or frame.filename == __file__:
            continue
        return f"{Path(frame.filename).name}:{frame.lineno}" if frame.filename.startswith(package) else None
    return None


def any_caller() -> str:
    """``file:line`` of the innermost frame outside torch and this module, whoever's it is
    (``deepspeed/runtime/utils.py:887``, ``train.py:415``)."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if "/torch/" in frame.filename or frame.filename == __file__:
            continue
        parts = Path(frame.filename).parts
        return f"{'/'.join(parts[-3:])}:{frame.lineno}"
    return "?"


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.from_python_data: list[str | None] = []  # the package's frame for each such tensor

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.ops[name] += 1
        if name.startswith(FROM_PYTHON_DATA):
            self.from_python_data.append(package_caller())
        return func(*args, **(kwargs or {}))


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
