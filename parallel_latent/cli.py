"""``parallel-latent``: the command line.

    parallel-latent train --config configs/tiny.yaml --nproc 2 [section.key=value ...]
    parallel-latent reconstruct --checkpoint runs/tiny "Some text to reconstruct."
    parallel-latent plot runs/tiny

``train --nproc N`` (N > 1) started from a plain shell re-executes itself under
``torch.distributed.run --standalone --nproc_per_node N``; under a launcher (torchrun, the
deepspeed launcher, accelerate launch, srun) it is one rank of the launcher's job.

Bad input (an unknown config key, an impossible parallel layout, a missing corpus, ...) prints
one line on stderr and exits with status 2 before anything is written.  Exit statuses:
0 done (or stopped cleanly by SIGTERM/SIGINT with a checkpoint), 1 unexpected failure,
2 bad input, 3 stopped after too many consecutive non-finite steps, 4 a checkpoint could not be
written (a full disk, an I/O error: the last complete checkpoint is intact, and a rerun resumes
from it).

Heavy imports (torch, DeepSpeed, transformers) happen inside the commands, so ``--help`` and
argument errors are instant.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from parallel_latent import inference, pretrained
from parallel_latent.checkpoint import CheckpointSaveError
from parallel_latent.checkpoint import cli as checkpoint_cli
from parallel_latent.data import cli as data_cli
from parallel_latent.errors import (
    PATH_ERRORS,
    UsageError,
    describe_path_error,
    require_dir,
    require_file,
    require_output_dir,
)

EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT, EXIT_NONFINITE, EXIT_SAVE_FAILED = 0, 1, 2, 3, 4
PROG = "parallel-latent"


def _error(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)


def _under_launcher() -> bool:
    """Started by torchrun / the deepspeed launcher / accelerate launch / mpirun (they set RANK
    or OMPI_*).  A bare SLURM allocation does not count: its batch step is a plain shell."""
    return "RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ


# --------------------------------------------------------------------------- #
# train
# --------------------------------------------------------------------------- #


def _parse_overrides_json(text: str | None) -> dict | None:
    """``--deepspeed-overrides``: inline JSON or the path of a JSON file."""
    if not text:
        return None
    source = "--deepspeed-overrides"
    if not text.lstrip().startswith("{"):
        text = require_file(text, source).read_text(encoding="utf-8")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise UsageError(f"{source}: invalid JSON: {error.msg} at line {error.lineno}") from None
    if not isinstance(value, dict):
        raise UsageError(f"{source}: expected a JSON object")
    return value


def _load_train_config(args: argparse.Namespace):
    from parallel_latent.config import load_config

    return load_config(args.config, args.overrides)


def _torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """torchrun through the agent of :mod:`parallel_latent.console` (one line per failure)."""
    return [
        sys.executable,
        "-m",
        "parallel_latent.console",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "parallel_latent",
        *argv,
    ]


def _children(pid: int) -> list[int]:
    """Direct child processes of ``pid`` (Linux /proc scan; empty elsewhere)."""
    children = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            children.append(int(entry.name))
    return children


def _die_with_parent() -> None:
    """preexec_fn: the launched torchrun gets SIGTERM if this process dies (Linux only)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def _launch_local(nproc: int, argv: list[str], run_dir: Path) -> int:
    """Run ``argv`` as ``nproc`` ranks on this machine under torchrun; return the exit status of
    the first rank that failed (0 if none did).

    torchrun runs in its own session so a terminal's Ctrl-C reaches only this process, which
    forwards SIGTERM to the ranks themselves (not to the torchrun agent): they finish the step,
    write a checkpoint and exit 0, and torchrun then exits 0 as well.  (Signalling the agent
    instead makes it tear the ranks down and exit non-zero.)  A second Ctrl-C kills the ranks.

    Rank 0 keeps the terminal; the other ranks, torchrun's messages and any traceback go to
    ``RUN_DIR/logs/<time>/`` (see :mod:`parallel_latent.console`), and a failure ends with its
    one line. Bad input (status 2) leaves no logs behind, nor a run directory made only for them.
    """
    from parallel_latent.console import WORKER_LOGS_ENV, close_worker_logs, open_worker_logs

    log_dir, run_dir_existed = open_worker_logs(run_dir)
    env = dict(os.environ)
    env[WORKER_LOGS_ENV] = str(log_dir.resolve())
    # One compute thread per rank unless told otherwise: ranks share the machine's cores.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    process = subprocess.Popen(
        _torchrun_command(nproc, argv),
        env=env,
        start_new_session=True,
        # A single prctl() call, and this process has started no thread.
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,  # noqa: PLW1509
    )
    signals_seen = 0

    def forward(signum, frame):
        nonlocal signals_seen
        signals_seen += 1
        ranks = _children(process.pid)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM if signals_seen == 1 else signal.SIGKILL)
        if not ranks:  # not Linux, or the ranks have not started yet: the agent handles it
            process.send_signal(signal.SIGTERM)
        elif signals_seen > 1:  # the user asked for it: no report of ranks "killed by SIGKILL"
            process.kill()

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                status = process.wait()
                break
            except InterruptedError:
                continue
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    close_worker_logs(log_dir, run_dir_existed, status, EXIT_BAD_INPUT)
    return 128 - status if status < 0 else status  # killed by a signal: the shell's convention


def _rank_argv(args: argparse.Namespace) -> list[str]:
    """The command line each launched rank runs: this one without --nproc (which torchrun's own
    parser would take for an abbreviation of its --nproc-per-node)."""
    argv = ["train", "--config", args.config]
    if args.deepspeed_overrides:
        argv += ["--deepspeed-overrides", args.deepspeed_overrides]
    return argv + list(args.overrides)


def cmd_train(args: argparse.Namespace) -> int:
    deepspeed_overrides = _parse_overrides_json(args.deepspeed_overrides)
    if args.nproc is not None and args.nproc < 1:
        raise UsageError(f"--nproc={args.nproc} must be >= 1")
    cfg = _load_train_config(args)
    if not _under_launcher():
        if args.nproc and args.nproc > 1:
            # Validate here, in one process, so bad input costs one line and no launch.
            from parallel_latent.train import preflight

            preflight(cfg, args.nproc, args.config, processes_per_node=args.nproc)
            _check_local_devices(cfg, args.nproc)
            return _launch_local(args.nproc, _rank_argv(args), Path(cfg.logging.run_dir))
        tp = cfg.parallel.tensor_parallel
        if tp > 1:  # one process from a shell: say how to get the processes the config needs
            raise UsageError(
                f"{args.config}: parallel.tensor_parallel={tp} needs {tp} processes: add --nproc {tp} "
                "(or a multiple of it), or set parallel.tensor_parallel=1"
            )

    _prefer_cpu_accelerator()
    from parallel_latent.console import quiet_repeated_notices, report_failure
    from parallel_latent.train import NonFiniteTrainingError, train

    quiet_repeated_notices()
    try:
        train(cfg, deepspeed_overrides, source=args.config)
    except NonFiniteTrainingError as error:
        return report_failure(error, EXIT_NONFINITE)
    except CheckpointSaveError as error:  # raised on every rank alike: one line
        return report_failure(error, EXIT_SAVE_FAILED)
    except (ValueError, *PATH_ERRORS) as error:
        # Deterministic input problems (ConfigError, DataError, CheckpointError, a path of the wrong
        # kind) hit every rank alike.
        return report_failure(error, EXIT_BAD_INPUT)
    except Exception as error:
        if not _under_launcher():
            raise  # one process: Python's own traceback
        return report_failure(error, EXIT_FAILURE)
    finally:
        _shutdown_process_groups()
    return EXIT_OK


def _check_local_devices(cfg, nproc: int) -> None:
    """``--nproc N`` on a GPU host needs N GPUs: refused here, before any worker starts, instead of
    NCCL's "Duplicate GPU detected" after the whole start-up."""
    from parallel_latent.engine import resolve_device
    from parallel_latent.parallel.state import check_processes_fit_devices

    if resolve_device(cfg) == "cuda":
        import torch

        check_processes_fit_devices(nproc, torch.cuda.device_count())


def _prefer_cpu_accelerator() -> None:
    """Without CUDA, tell DeepSpeed its accelerator is the CPU (instead of a warning per rank
    that it guessed so)."""
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


def _shutdown_process_groups() -> None:
    from parallel_latent.parallel import destroy_distributed

    # A broken group (a peer died) must not mask the real error.
    with contextlib.suppress(RuntimeError, ValueError):
        destroy_distributed()


# --------------------------------------------------------------------------- #
# plot
# --------------------------------------------------------------------------- #


def cmd_plot(args: argparse.Namespace) -> int:
    from parallel_latent.plot import plot_run

    run_dir = require_dir(args.run_dir, "run directory")
    out = require_output_dir(args.out) if args.out else None
    for path in plot_run(run_dir, out):
        print(path)
    return EXIT_OK


# --------------------------------------------------------------------------- #
# Parser and entry point.
# --------------------------------------------------------------------------- #


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Perceiver text autoencoder over a frozen GPT-2, "
        "trained with tensor parallelism and DeepSpeed ZeRO.",
    )
    # The deepspeed launcher inserts --local_rank=N before the command; the rank comes from the
    # environment (LOCAL_RANK) anyway.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    train = sub.add_parser(
        "train",
        help="train a model from a YAML config",
        description="Train from a YAML config; key=value arguments override it "
        "(e.g. training.max_steps=50 parallel.zero_stage=3).",
    )
    train.add_argument("--config", required=True, help="YAML config file (see configs/)")
    train.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    train.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="processes to start on this machine (re-runs itself under torchrun --standalone); "
        "leave out under a launcher",
    )
    train.add_argument(
        "--deepspeed-overrides",
        default=None,
        metavar="JSON|FILE",
        help="DeepSpeed config entries merged into the generated config "
        '(e.g. \'{"zero_optimization": {"reduce_bucket_size": 5e7}}\')',
    )
    train.set_defaults(handler=cmd_train)

    plot = sub.add_parser("plot", help="write PNG curves of a run's metrics (needs matplotlib)")
    plot.add_argument("run_dir", help="the run directory (holds metrics.jsonl)")
    plot.add_argument("--out", default=None, help="output directory (default RUN_DIR/plots)")
    plot.set_defaults(handler=cmd_plot)

    checkpoint_cli.add_subcommands(sub)
    inference.add_subcommands(sub)
    pretrained.add_subcommands(sub)
    data_cli.add_subcommands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except PATH_ERRORS as error:  # a path of the wrong kind that a check above did not foresee
        _error(describe_path_error(error))
        return EXIT_BAD_INPUT
    except CheckpointSaveError as error:  # export, consolidate, reshard on a full disk: one line
        _error(str(error))
        return EXIT_SAVE_FAILED
    except ValueError as error:  # ConfigError, DataError, CheckpointError, UsageError: one line each
        _error(str(error).splitlines()[0] if str(error) else type(error).__name__)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        _error("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
