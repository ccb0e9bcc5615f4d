import atexit
import compileall
import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from parallel_latent.cli import GC_THRESHOLD

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor's CPU code generator stands in for CUDA's in the tests (tests/helpers/inductor.py), which
# has no SIMD: without it, the first compile of every process in a fresh environment also builds and
# runs a test program per SIMD instruction set (9 of its 12 s; the cache that keeps the answer is new
# in every installation). Inherited by every subprocess and rank.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
torch.set_num_threads(1)
gc.set_threshold(*GC_THRESHOLD)  # as the command's processes collect (the pools' ranks too)

# Prepared corpora go to a cache of this session only (inherited by every subprocess and rank):
# no test reads or writes the user's ~/.cache, and every run starts from an empty cache.
_DATA_CACHE = tempfile.mkdtemp(prefix="parallel-latent-test-data-cache-")
os.environ["PARALLEL_LATENT_DATA_CACHE"] = _DATA_CACHE
atexit.register(shutil.rmtree, _DATA_CACHE, ignore_errors=True)


def pytest_configure(config):
    """Once, in the process that starts the others (xdist's controller, or the serial run): the
    repository's Python files compiled into the ``__pycache__`` directories Python itself writes
    (git ignores them). Under PYTHONDONTWRITEBYTECODE (set on these machines) nothing writes them,
    and each of the suite's few hundred processes (the ranks of every launched job) compiled the
    package again from source: 0.5-0.7 s of CPU a process, 1.5 s a ``train --nproc 2`` launch."""
    if not hasattr(config, "workerinput") and sys.dont_write_bytecode:
        root = Path(__file__).resolve().parent.parent
        for directory in ("parallel_latent", "benchmarks", "tests", "tools"):
            compileall.compile_dir(root / directory, quiet=1)


@pytest.fixture(scope="session")
def pool4(request):
    """Four gloo ranks, started once for this pytest process (the serial run, or one xdist worker) and
    shared by every module that runs tasks on them (tests/helpers/pool_training.shared_pool)."""
    from tests.helpers.pool_training import shared_pool

    return shared_pool(request, 4)


@pytest.fixture(scope="session")
def pool2(request):
    """Two gloo ranks, shared as :func:`pool4`'s four are."""
    from tests.helpers.pool_training import shared_pool

    return shared_pool(request, 2)


def pytest_collection_modifyitems(config, items):
    """The modules with the most end-to-end (``slow``) runs first: the two xdist workers each take a
    whole module (``--dist loadscope``), so a long module started last would run alone at the end."""
    weight: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        weight[module] = weight.get(module, 0) + (30 if item.get_closest_marker("slow") else 1)
    order = {module: rank for rank, module in enumerate(sorted(weight, key=lambda m: -weight[m]))}
    items.sort(key=lambda item: order[item.nodeid.split("::", 1)[0]])  # stable within a module
