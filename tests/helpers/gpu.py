"""The mark of a test that needs a CUDA device: ``pytest -m gpu`` selects them (benchmarks/gpu.sh runs
them first on a lent GPU, before its rows); on a machine without one they are skipped, with the reason."""

from __future__ import annotations

import pytest
import torch

NO_CUDA = "needs a CUDA device: none is visible (a CPU run; the CPU path has its own tests)"


def gpu_test(test):
    """``test`` marked ``gpu`` and skipped where no CUDA device is visible."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)(test))
