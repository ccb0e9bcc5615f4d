"""Counting what a piece of code asks the device to do (bench_model.py, tests/helpers/op_counter.py):
operators dispatched, and tensors built from Python data (``aten.lift_fresh``: on a GPU each a copy from
pageable host memory that waits for the device), with the frame of the package that asked for them."""

from __future__ import annotations

import collections
import traceback
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.harness import REPO

PACKAGE = str(REPO / "parallel_latent")
FROM_PYTHON_DATA = ("aten.lift_fresh", "aten.lift_fresh_copy")


def package_caller(instruments: tuple[str, ...] = (__file__,), package: str = PACKAGE) -> str | None:
    """``file:line`` of the innermost frame outside torch and the ``instruments`` if ``package``'s, else None."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if "/torch/" in frame.filename or frame.filename in instruments:
            continue
        return f"{Path(frame.filename).name}:{frame.lineno}" if frame.filename.startswith(package) else None
    return None


class OpCounter(TorchDispatchMode):
    """Operators dispatched while it is entered, and the package's frame that asked for each tensor
    built from Python data (None: not the package's). A subclass written in another file adds that
    file to :attr:`instruments`, so that its own frames are never taken for the caller."""

    instruments: tuple[str, ...] = (__file__,)

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
            self.from_python_data.append(package_caller(self.instruments))
        return func(*args, **(kwargs or {}))
