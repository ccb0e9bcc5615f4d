"""CompiledWithFallback: when compiling fails, the wrapped function runs eagerly, and an error after a
compiled call has succeeded is the computation's and is raised. torch.compile is replaced by
stand-ins so that nothing is compiled."""

from __future__ import annotations

import pytest
import torch

from parallel_latent.parallel import CompiledWithFallback, CompileOutcome


def test_an_error_after_a_compiled_success_is_raised_not_retried(monkeypatch):
    eager_calls = []

    def compiled_that_later_runs_out_of_memory(fn, **options):
        calls = iter([None, MemoryError("CUDA out of memory")])

        def run(*args):
            error = next(calls)
            if error is not None:
                raise error
            return fn(*args)

        return run

    monkeypatch.setattr(torch, "compile", compiled_that_later_runs_out_of_memory)
    wrapped = CompiledWithFallback(lambda x: eager_calls.append(x) or x + 1, "a test function")
    assert wrapped(1) == 2  # compiled (the stand-in runs fn once)
    with pytest.raises(MemoryError, match="CUDA out of memory"):
        wrapped(2)
    assert wrapped.failure is None and eager_calls == [1]  # not re-run eagerly, compiling not disabled


def test_one_failure_to_compile_is_shared_by_the_wrappers_of_one_outcome(monkeypatch, caplog):
    attempts = []

    def no_compiler(fn, **options):
        def fails(*args):
            attempts.append(fn)
            raise RuntimeError("no working C compiler")

        return fails

    monkeypatch.setattr(torch, "compile", no_compiler)
    outcome = CompileOutcome()
    blocks = [CompiledWithFallback(lambda x, k=k: x * k, "the blocks", outcome) for k in (2, 3, 4)]
    with caplog.at_level("WARNING"):
        assert [block(5) for block in blocks] == [10, 15, 20]
        assert [block(1) for block in blocks] == [2, 3, 4]
    assert len(attempts) == 1  # the second and third blocks never tried
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "torch.compile of the blocks failed (RuntimeError: no working C compiler); running it eagerly"
    ]
    assert all(block.failure == "RuntimeError: no working C compiler" for block in blocks)
