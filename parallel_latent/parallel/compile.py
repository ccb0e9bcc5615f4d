"""torch.compile with a fallback: a function compiled where the machine can, run eagerly where
compiling fails (no Triton, no host C compiler, an unsupported driver), with one warning."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

__all__ = ["CompileOutcome", "CompiledWithFallback", "raised_by_compiler"]


@dataclass
class CompileOutcome:
    """Whether compiling failed, shared by the wrappers of one kind (a model's blocks): one failure
    is one warning, and the others run eagerly without trying to compile again. The fallback is
    shared too: once one wrapper of the outcome falls back, at its first compile or a later one,
    every wrapper of it runs eagerly from its next call on."""

    failure: str | None = None


class _RecordingBackend:
    """A torch.compile backend (inductor by default) that remembers whether it raised: an error
    that passed through it was raised while compiling (AOT autograd, inductor's lowering, its C++
    or Triton compilers), whatever dynamo wraps it in. The backward graph is compiled with the
    forward (not lazily at the first backward, outside the wrapped call), so that its failure is
    one of the wrapped call's too."""

    def __init__(self, backend: str | Callable):
        self.backend = backend
        self.raised: Exception | None = None  # during the current call

    def __call__(self, graph_module, example_inputs):
        import torch._dynamo
        import torch._functorch.config

        backend = torch._dynamo.lookup_backend(self.backend) if isinstance(self.backend, str) else self.backend
        try:
            with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                return backend(graph_module, example_inputs)
        except Exception as error:
            self.raised = error
            raise


def raised_by_compiler(error: BaseException) -> bool:
    """Whether ``error`` is one of the compiler's own: dynamo's (tracing, graph breaks under
    fullgraph, a backend's failure wrapped as BackendCompilerFailed), inductor's, or Triton's (whose
    kernels may compile at their first launch). An out-of-memory or shape error raised by a compiled
    graph's kernels is none of these."""
    import torch._dynamo.exc

    if isinstance(error, torch._dynamo.exc.TorchDynamoException):
        return True
    return type(error).__module__.split(".")[0] == "triton" or type(error).__module__ == "torch._inductor.exc"


class CompiledWithFallback:
    """``fn`` through ``torch.compile`` (compiled at its first call), or eager if that fails.

    Compiling can fail where the code is right and the machine is not: no Triton, no host C
    compiler, an unsupported driver. Training must not die for that: a failure while compiling,
    at the first call or at a later one that compiles again (new shapes, a value made dynamic),
    logs one warning naming the cause, and ``fn`` runs eagerly from then on, that call included
    (the same operations, so the same results up to the fusion's rounding; bit-identical for
    integer work such as the dropout hash). Before the first compiled call has succeeded, any error
    counts as the compiler's. After it, only an error raised inside the compiler backend or of the
    compiler's own types (:func:`raised_by_compiler`) does: an error raised by an already-compiled
    graph's execution (out of memory, a bad input) is the computation's and is raised, not retried.
    (An input that dynamo's tracing rejects is the one case in between: it falls back, and the
    eager call then raises the computation's own error.)

    ``compile_if`` (no arguments), where given, chooses per call: false runs ``fn`` eagerly without
    compiling a variant for it (evaluation, which would add graphs that training never uses)."""

    def __init__(
        self,
        fn: Callable,
        what: str,
        outcome: CompileOutcome | None = None,
        compile_if: Callable[[], bool] | None = None,
        backend: str | Callable = "inductor",
        **compile_options,
    ):
        self.fn, self.what = fn, what
        self.compile_if = compile_if
        self.backend = _RecordingBackend(backend)
        self.compile_options = {"fullgraph": True, **compile_options}
        self.compiled: Callable | None = None
        self.succeeded = False
        self.outcome = outcome if outcome is not None else CompileOutcome()

    @property
    def failure(self) -> str | None:
        return self.outcome.failure

    def __call__(self, *args, **kwargs):
        if self.outcome.failure is None and (self.compile_if is None or self.compile_if()):
            self.backend.raised = None
            try:
                if self.compiled is None:
                    self.compiled = torch.compile(self.fn, backend=self.backend, **self.compile_options)
                result = self.compiled(*args, **kwargs)
            except Exception as error:
                compiler_error = self.backend.raised
                if self.succeeded and compiler_error is None and not raised_by_compiler(error):
                    raise
                self._fall_back(error if compiler_error is None else compiler_error)
            else:
                self.succeeded = True
                return result
        return self.fn(*args, **kwargs)

    def _fall_back(self, error: Exception) -> None:
        while getattr(error, "inner_exception", None) is not None:  # dynamo's wrappers: the cause
            error = error.inner_exception
        message = str(error).strip()
        self.outcome.failure = f"{type(error).__name__}: {message.splitlines()[0] if message else ''}"
        logger.warning("torch.compile of %s failed (%s); running it eagerly", self.what, self.failure)
