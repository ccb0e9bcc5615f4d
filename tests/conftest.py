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
