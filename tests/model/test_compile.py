"""training.compile: the Perceiver blocks and the loss's chunks through torch.compile are the same
model as eager, within the bound of another summation order (inductor fuses and reorders)."""

from __future__ import annotations

import pytest
import torch

from parallel_latent.model import LatentAutoencoder
from parallel_latent.model.autoencoder import compile_regions
from tests.model.test_autoencoder import reduction_length_of_model, tiny_batch, tiny_configs
from tests.tp_compare import max_abs, order_bound, terms_scale


def loss_and_grads(model: LatentAutoencoder, ids, mask, step: int):
    model.dropout_rng.step = step
    out = model(ids, mask)
    out.loss_sum.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return out.loss_sum.detach(), grads


@pytest.mark.slow
def test_compiled_regions_equal_eager_with_dropout_across_steps():
    eager = LatentAutoencoder(*tiny_configs(dropout=0.1), seed=5).train()
    compiled = compile_regions(LatentAutoencoder(*tiny_configs(dropout=0.1), seed=5).train())
    blocks = [*compiled.encoder.stack.blocks, *compiled.decoder.stack.blocks]
    ids, mask = tiny_batch()
    n = reduction_length_of_model()
    graphs = []
    with torch._inductor.config.patch(compile_threads=1):  # no worker pool to start on a small machine
        for step in (0, 1, 2, 3):  # new dropout keys every step, the same masks as eager
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
            want_loss, want = loss_and_grads(eager, ids, mask, step)
            got_loss, got = loss_and_grads(compiled, ids, mask, step)
            assert abs(got_loss - want_loss).item() <= order_bound(n, terms_scale(abs(want_loss).item(), n))
            for name, grad in want.items():
                assert max_abs(got[name] - grad) <= order_bound(n, terms_scale(max_abs(grad), n)), name
    # The keys enter as inputs: after the first change of value (made dynamic) no step recompiles.
    assert graphs[3] == graphs[2] > 0, graphs
    assert all(block.forward.failure is None and block.forward.compiled is not None for block in blocks)
    assert compiled.loss_kernels.grad.failure is None
