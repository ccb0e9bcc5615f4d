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
from tests.helpers.tiny_model import B, reduction_length_of_model, tiny_batch, tiny_configs
from tests.helpers.tp_compare import max_abs, order_bound, terms_scale


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


def micro_batch_step(model: LatentAutoencoder, ids, mask, step: int) -> None:
    """One training step of two accumulated micro-batches, keyed as train.py keys them (no
    optimizer: the parameters stay those of the seed)."""
    model.dropout_rng.step = step
    half = ids.shape[0] // 2
    for micro_step in range(2):
        model.dropout_rng.sample_offset = micro_step * half
        rows = slice(micro_step * half, (micro_step + 1) * half)
        model(ids[rows], mask[rows]).loss_sum.backward()
    model.zero_grad(set_to_none=True)


@pytest.mark.slow
def test_training_steps_neither_break_graphs_nor_recompile_and_evaluation_runs_eagerly(caplog):
    """Under training.compile the dropout keys are tensors read inside the blocks' graphs: no graph
    break in a step, no recompile after step 0 for new steps and sample offsets; evaluation (eval
    mode, no_grad, a partial batch) runs the blocks eagerly, so it adds no graph (and no recompile
    towards dynamo's limit) and equals the eager model bit for bit."""
    configs = tiny_configs(dropout=0.1, n_encoder_layers=1, n_decoder_layers=1)
    compiled = compile_regions(LatentAutoencoder(*configs, seed=5).train())
    eager = LatentAutoencoder(*configs, seed=5)
    ids, mask = tiny_batch()
    torch._dynamo.reset()
    counters.clear()
    with caplog.at_level(logging.WARNING), torch._inductor.config.patch(compile_threads=1):
        micro_batch_step(compiled, ids, mask, step=0)
        graphs_after_step_0 = counters["stats"]["unique_graphs"]
        micro_batch_step(compiled, ids, mask, step=1)
        with eval_mode(compiled), eval_mode(eager), torch.no_grad():
            got = compiled(ids[: B - 1], mask[: B - 1], return_latents=True).latents
            want = eager(ids[: B - 1], mask[: B - 1], return_latents=True).latents
        for step in (2, 3):
            micro_batch_step(compiled, ids, mask, step)
    assert torch.equal(got, want)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == graphs_after_step_0 > 0
    assert not [r.getMessage() for r in caplog.records if "recompile" in r.getMessage()]
    blocks = [*compiled.encoder.stack.blocks, *compiled.decoder.stack.blocks]
    assert all(block.forward.failure is None and block.forward.succeeded for block in blocks)


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
