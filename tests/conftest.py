import atexit
import os
import shutil
import tempfile

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

# Prepared corpora go to a cache of this session only (inherited by every subprocess and rank):
# no test reads or writes the user's ~/.cache, and every run starts from an empty cache.
_DATA_CACHE = tempfile.mkdtemp(prefix="parallel-latent-test-data-cache-")
os.environ["PARALLEL_LATENT_DATA_CACHE"] = _DATA_CACHE
atexit.register(shutil.rmtree, _DATA_CACHE, ignore_errors=True)


@pytest.fixture(scope="module")
def pool4():
    """Four gloo ranks shared by the tests of one module."""
    from tests.helpers.distributed import DistributedPool

    pool = DistributedPool(4)
    yield pool
    pool.close()


def pytest_collection_modifyitems(config, items):
    """The modules with the most end-to-end (``slow``) runs first: the two xdist workers each take a
    whole module (``--dist loadscope``), so a long module started last would run alone at the end."""
    weight: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        weight[module] = weight.get(module, 0) + (30 if item.get_closest_marker("slow") else 1)
    order = {module: rank for rank, module in enumerate(sorted(weight, key=lambda m: -weight[m]))}
    items.sort(key=lambda item: order[item.nodeid.split("::", 1)[0]])  # stable within a module
