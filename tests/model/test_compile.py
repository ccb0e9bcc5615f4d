"""training.compile: the Perceiver blocks and the loss's chunks through torch.compile are the same
model as eager, within the bound of another summation order (inductor fuses and reorders)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

from parallel_latent.model import LatentAutoencoder
from parallel_latent.model.autoencoder import compile_regions, eval_mode
from parallel_latent.parallel import CompiledWithFallback
from tests.helpers.inductor import CUDA_LIKE_CPU_KERNELS
from tests.helpers.tiny_model import B, reduction_length_of_model, tiny_batch, tiny_configs
from tests.helpers.tp_compare import max_abs, order_bound, terms_scale


def micro_batch_losses_and_grads(model: LatentAutoencoder, ids, mask, step: int) -> list[tuple]:
    """One training step of two accumulated micro-batches, keyed as the trainer keys them: each
    micro-batch's summed loss and the parameters' gradients after it (no optimizer: the parameters
    stay those of the seed)."""
    model.dropout_rng.step = step
    half = ids.shape[0] // 2
    results = []
    for micro_step in range(2):
        model.dropout_rng.sample_offset = micro_step * half
        rows = slice(micro_step * half, (micro_step + 1) * half)
        out = model(ids[rows], mask[rows])
        out.loss_sum.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((out.loss_sum.detach(), grads))
    model.zero_grad(set_to_none=True)
    return results


@pytest.mark.slow
def test_compiled_regions_equal_eager_across_steps_without_graph_breaks_or_recompiles(caplog):
    """Under training.compile (compiled once here, by inductor's CPU code generator set as close to
    CUDA's as it goes: tests/helpers/inductor.py):

    - each micro-batch's loss and gradients equal the eager model's within the bound of another
      summation order, with dropout on, at every step (new keys, the same masks as eager);
    - the dropout keys are tensors read inside the blocks' graphs: no graph break in a step, and no
      graph is added after step 0 (whose second micro-batch, at a new sample offset, is the first
      change of value) for new steps and sample offsets;
    - evaluation (eval mode, no_grad, a partial batch) runs the blocks eagerly: it adds no graph (and
      no recompile towards dynamo's limit) and equals the eager model bit for bit."""
    configs = tiny_configs(dropout=0.1, n_encoder_layers=1, n_decoder_layers=1)
    compiled = compile_regions(LatentAutoencoder(*configs, seed=5).train())
    eager = LatentAutoencoder(*configs, seed=5).train()
    ids, mask = tiny_batch()
    n = reduction_length_of_model()
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    with caplog.at_level(logging.WARNING), torch._inductor.config.patch(CUDA_LIKE_CPU_KERNELS):
        for step in (0, 1, 2, 3):
            want = micro_batch_losses_and_grads(eager, ids, mask, step)
            got = micro_batch_losses_and_grads(compiled, ids, mask, step)
            graphs.append(counters["stats"]["unique_graphs"])
            for (want_loss, want_grads), (got_loss, got_grads) in zip(want, got, strict=True):
                assert abs(got_loss - want_loss).item() <= order_bound(n, terms_scale(abs(want_loss).item(), n))
                for name, grad in want_grads.items():
                    assert max_abs(got_grads[name] - grad) <= order_bound(n, terms_scale(max_abs(grad), n)), name
            if step == 1:
                with eval_mode(compiled), eval_mode(eager), torch.no_grad():
                    got_latents = compiled(ids[: B - 1], mask[: B - 1], return_latents=True).latents
                    want_latents = eager(ids[: B - 1], mask[: B - 1], return_latents=True).latents
                assert torch.equal(got_latents, want_latents)
    assert dict(counters["graph_break"]) == {}
    assert graphs[0] > 0 and graphs == [graphs[0]] * 4, graphs
    assert not [r.getMessage() for r in caplog.records if "recompile" in r.getMessage()]
    blocks = [*compiled.encoder.stack.blocks, *compiled.decoder.stack.blocks]
    assert all(block.forward.failure is None and block.forward.succeeded for block in blocks)
    assert compiled.loss_kernels.grad.failure is None


def gather_twice(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return table[index] * 2


def test_an_error_of_a_compiled_graphs_execution_propagates():
    """Inductor's compiled gather checks its indices when it runs: that error, after a compiled
    success, is the computation's. It is raised, not taken for the compiler's, and compiling stays
    on."""
    wrapped = CompiledWithFallback(gather_twice, "a gather")
    table = torch.arange(8.0)
    with torch._inductor.config.patch(compile_threads=1):
        assert torch.equal(wrapped(table, torch.tensor([1, 2])), torch.tensor([2.0, 4.0]))
        with pytest.raises(RuntimeError, match="index out of bounds"):
            wrapped(table, torch.tensor([1, 9]))
    assert wrapped.failure is None and wrapped.succeeded


def test_a_failure_at_the_first_compile_falls_back(monkeypatch, caplog):
    """Inductor raising at the first compile (no C compiler): the eager result, one warning."""
    import torch._inductor.compile_fx as compile_fx_module

    def no_compiler(*args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    monkeypatch.setattr(compile_fx_module, "compile_fx", no_compiler)
    torch._dynamo.reset()
    wrapped = CompiledWithFallback(gather_twice, "a gather")
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert torch.equal(wrapped(torch.arange(8.0), torch.tensor([3])), torch.tensor([6.0]))
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "torch.compile of a gather failed (RuntimeError: InvalidCxxCompiler: No working C++ compiler found); "
        "running it eagerly"
    ]
