import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def pool4():
    """Four gloo ranks shared by the tests of one module."""
    from tests.distributed import DistributedPool

    pool = DistributedPool(4)
    yield pool
    pool.close()
