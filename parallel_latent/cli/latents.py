"""``parallel-latent encode-corpus``: a whole corpus to a latent dataset (the corpus-scale form of
``encode``), in one process, under a launcher, or as ``--nproc`` local ranks.

    parallel-latent encode-corpus --checkpoint runs/tiny --data corpus.txt --out latents/ --nproc 2 \\
        parallel.tensor_parallel=2 export.batch_size=64

The same command continues an export that was killed; see :mod:`parallel_latent.latents`.
"""

from __future__ import annotations

import argparse
import shutil
import signal
from pathlib import Path

from parallel_latent.cli.bounds import MAX_LOCAL_PROCESSES, check_range
from parallel_latent.cli.train import PER_RANK
from parallel_latent.errors import ExitStatus, UsageError


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _rank_argv(args: argparse.Namespace) -> list[str]:
    """What each launched rank runs: this command without --nproc."""
    return ["encode-corpus", "--checkpoint", args.checkpoint, "--data", args.data, "--out", args.out, *args.overrides]


def cmd_encode_corpus(args: argparse.Namespace) -> int:
    check_range("--nproc", args.nproc, 1, MAX_LOCAL_PROCESSES)
    from parallel_latent.latents import WORK_DIR, index_summary, output_state, plan_export
    from parallel_latent.launching.cluster import under_launcher
    from parallel_latent.launching.local import launch_local
    from parallel_latent.training.world import dp_size

    plan = plan_export(args.checkpoint, args.data, args.overrides)
    out = Path(args.out)
    if not under_launcher():
        # Checked here, in one process, so that bad input costs one line and no launch.
        output_state(out)
        nproc = args.nproc or 1
        dp_size(plan.cfg, nproc, "encode-corpus")  # TP must divide the processes
        if nproc > 1:
            # The ranks' logs go under DIR/.export/ (never into the export itself); once the export
            # is complete the launcher removes them with the rest of the work files.
            status = launch_local(nproc, _rank_argv(args), out / WORK_DIR)
            if status == ExitStatus.OK:
                shutil.rmtree(out / WORK_DIR, ignore_errors=True)
                from parallel_latent.latents import open_latents

                print(f"wrote {out}: {index_summary(open_latents(out).index)}")
            return status
        if plan.tensor_parallel > 1:
            raise UsageError(
                f"encode-corpus: parallel.tensor_parallel={plan.tensor_parallel} needs that many processes: "
                f"add --nproc {plan.tensor_parallel} (or a multiple of it)"
            )
    from parallel_latent.zero.version import prefer_cpu_accelerator

    prefer_cpu_accelerator()
    # A forwarded Ctrl-C (`--nproc`'s launcher sends the ranks SIGTERM) or a launcher's stop: the
    # export has nothing to save (a rerun continues it), so every rank ends as Ctrl-C ends it, "interrupted".
    signal.signal(signal.SIGTERM, _interrupt)
    from parallel_latent.api import encode_corpus
    from parallel_latent.coordination import is_main

    setattr(args, PER_RANK, True)  # from here on every rank reports its failure (launching.reports.report_failure)
    index = encode_corpus(args.checkpoint, args.data, out, args.overrides)
    if is_main() and not under_launcher():
        print(f"wrote {out}: {index_summary(index)}")
    return ExitStatus.OK


def add_subcommands(sub) -> None:
    encode = sub.add_parser(
        "encode-corpus",
        help="encode a whole corpus into a latent dataset (sharded, resumable, memory-mapped)",
        description="Encode every sample of a corpus with a trained autoencoder into Arrow shards that "
        "datasets.load_from_disk and parallel_latent.latents.open_latents memory-map. Rerun the same "
        "command to continue an export that was stopped. key=value: export.batch_size, export.shard_size, "
        "export.precision (fp32 | bf16), data.* (how to read the corpus), parallel.tensor_parallel, "
        "parallel.backend, training.device, training.hang_timeout_s / hang_long_phase_s (the hang watchdog), "
        "logging.progress_bar.",
    )
    encode.add_argument(
        "--checkpoint",
        required=True,
        help="a run directory, a checkpoints directory, a training checkpoint, a portable or save-pretrained "
        "directory, or a Hugging Face hub repository id",
    )
    encode.add_argument("--data", required=True, help="the corpus: anything data.path accepts")
    encode.add_argument("--out", required=True, help="the output directory (new, empty, or this export unfinished)")
    encode.add_argument("overrides", nargs="*", metavar="key=value", help="export.*, data.*, parallel.* settings")
    encode.add_argument(
        "--nproc", type=int, default=None, help="processes to start here (TP x DP); leave out under a launcher"
    )
    encode.set_defaults(handler=cmd_encode_corpus)
