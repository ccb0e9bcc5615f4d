"""Counting what a piece of code asks the device to do, with a dispatch mode (used by the step tests
and benchmarks/bench_model.py): operators dispatched, and tensors built from Python data
(``torch.tensor([...])`` and friends dispatch ``aten.lift_fresh``; on a GPU each such tensor is a
copy from pageable host memory that waits for the device), with the frame of the package that
asked for them."""

from __future__ import annotations

import collections
import traceback
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

PACKAGE = str(Path(__file__).resolve().parents[1] / "parallel_latent")
FROM_PYTHON_DATA = ("aten.lift_fresh", "aten.lift_fresh_copy")


def package_caller(package: str = PACKAGE) -> str | None:
    """``file:line`` of the code that asked, if it is ``package``'s: the innermost frame outside
    torch itself and this module (None when that frame is a third party's, e.g. DeepSpeed's)."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if "/torch/" in frame.filename or frame.filename == __file__:
            continue
        return f"{Path(frame.filename).name}:{frame.lineno}" if frame.filename.startswith(package) else None
    return None


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
