"""``parallel-latent``: the command line.

    parallel-latent train --config configs/tiny.yaml --nproc 2 [section.key=value ...]
    parallel-latent reconstruct --checkpoint runs/tiny "Some text to reconstruct."
    parallel-latent plot runs/tiny

``train --nproc N`` (N > 1) started from a plain shell re-executes itself under
``torch.distributed.run --standalone --nproc_per_node N``; under a launcher (torchrun, the
deepspeed launcher, accelerate launch, srun) it is one rank of the launcher's job.

Bad input (an unknown config key, an impossible parallel layout, a missing corpus, ...) prints
one line on stderr and exits with status 2 before anything is written. Exit statuses
(:class:`parallel_latent.errors.ExitStatus`): 0 done (or stopped cleanly by SIGTERM/SIGINT with a
checkpoint), 1 unexpected failure, 2 bad input, 3 stopped after too many consecutive non-finite
steps, 4 a checkpoint could not be written (a full disk, an I/O error: the last complete checkpoint
is intact, and a rerun resumes from it).

Each subcommand lives in a module of this package that declares its parser and imports its library
(torch, DeepSpeed, transformers) only inside its handler, so building the parser imports none of
them: ``--help`` and argument errors are instant. :func:`main` is the one place where an error
becomes an exit status.
"""

from __future__ import annotations

import argparse
import gc
import sys

from parallel_latent.errors import PROG, ExitStatus, error_line, exit_status, one_line

from . import checkpoint, config, data, inference, latents, plot, pretrained, train

# CPython collects its youngest generation every 700 allocations: importing torch, transformers and
# DeepSpeed (some 400,000 objects that live as long as the process) runs about 900 collections, 6
# of them over the whole heap, that find next to nothing: half a second of every rank's start-up.
# Every 100,000 allocations, a training step's cyclic garbage is still freed every few steps
# (training frameworks such as torchtitan turn the automatic collector off and collect every N steps).
GC_THRESHOLD = (100_000, 10, 10)

__all__ = ["build_parser", "main"]


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser, whose refusal of a command line is one line (``PROG COMMAND: error: ...``,
    status 2) like every other refusal; the usage stays one ``-h`` away."""

    def error(self, message: str):
        self.exit(ExitStatus.BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="Perceiver text autoencoder over a frozen GPT-2, "
        "trained with tensor parallelism and DeepSpeed ZeRO.",
    )
    # The deepspeed launcher inserts --local_rank=N before the command; the rank comes from the
    # environment (LOCAL_RANK) anyway.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for commands in (train, plot, checkpoint, inference, latents, pretrained, data, config):
        commands.add_subcommands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    gc.set_threshold(*GC_THRESHOLD)
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        if train.reports_per_rank(args):  # a rank of a job: the agent (or rank 0) says it once
            return train.report_rank_failure(KeyboardInterrupt("interrupted"), ExitStatus.INTERRUPTED)
        print(error_line("interrupted"), file=sys.stderr, flush=True)
        return ExitStatus.INTERRUPTED
    except Exception as error:
        status = exit_status(error)
        if train.reports_per_rank(args):  # every rank of a training job meets it: launching.reports says it
            return train.report_rank_failure(error, status)
        if status is ExitStatus.FAILURE:
            raise  # unexpected: Python's own traceback
        print(error_line(one_line(error)), file=sys.stderr, flush=True)
        return status
    finally:
        train.shutdown_process_groups(args)


if __name__ == "__main__":
    sys.exit(main())
