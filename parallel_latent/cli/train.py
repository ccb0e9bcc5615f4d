"""``parallel-latent train``: one rank of a training job, or the launcher of ``--nproc`` local ranks.

A failure inside training is met by every rank of the job: :func:`report_rank_failure` hands it to
the per-rank writer (:func:`parallel_latent.console.report_failure`), which says it once.
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

from parallel_latent.errors import ExitStatus, UsageError, require_file

# Set on the parsed arguments once training has started on this rank: from then on a failure is
# reported per rank, and the process groups are torn down at the end.
PER_RANK = "reports_per_rank"


def under_launcher() -> bool:
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


def _torchrun_command(nproc: int, argv: list[str], max_restarts: int = 0) -> list[str]:
    """torchrun through the agent of :mod:`parallel_latent.console` (one line per failure), which
    restarts the ranks up to ``max_restarts`` times when one fails."""
    return [
        sys.executable,
        "-m",
        "parallel_latent.console",
        "--standalone",
        f"--nproc_per_node={nproc}",
        f"--max-restarts={max_restarts}",
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


def _launch_local(
    nproc: int, argv: list[str], run_dir: Path, lock=None, run_dir_existed: bool | None = None, max_restarts: int = 0
) -> int:
    """Run ``argv`` as ``nproc`` ranks on this machine under torchrun; return the exit status of
    the first rank that failed (0 if none did).

    torchrun runs in its own session so a terminal's Ctrl-C reaches only this process, which
    forwards SIGTERM to the ranks themselves (not to the torchrun agent): they finish the step,
    write a checkpoint and exit 0, and torchrun then exits 0 as well.  (Signalling the agent
    instead makes it tear the ranks down and exit non-zero.)  A second Ctrl-C kills the ranks.

    Rank 0 keeps the terminal; the other ranks, torchrun's messages and any traceback go to
    ``RUN_DIR/logs/<time>/`` (see :mod:`parallel_latent.console`), and a failure ends with its
    one line. Bad input (status 2) leaves no logs behind, nor a run directory made only for them.

    ``lock``: the run directory's (:mod:`parallel_latent.training.run_lock`), held for the ranks (across
    restarts), then released. ``max_restarts``: how often torchrun restarts every rank when one fails;
    each restart resumes from the newest complete checkpoint, and says so in one line.
    """
    from parallel_latent.console import WORKER_LOGS_ENV, close_worker_logs, open_worker_logs
    from parallel_latent.training.run_lock import HELD_BY_LAUNCHER_ENV

    log_dir, existed = open_worker_logs(run_dir)
    env = {**os.environ, WORKER_LOGS_ENV: str(log_dir.resolve())}
    env.update({HELD_BY_LAUNCHER_ENV: str(lock.path.resolve())} if lock is not None else {})
    # One compute thread per rank unless told otherwise: ranks share the machine's cores.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    process = subprocess.Popen(
        _torchrun_command(nproc, argv, max_restarts),
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
        if lock is not None:
            lock.release(remove=process.returncode == ExitStatus.BAD_INPUT)
    close_worker_logs(log_dir, existed if run_dir_existed is None else run_dir_existed, status, ExitStatus.BAD_INPUT)
    return 128 - status if status < 0 else status  # killed by a signal: the shell's convention


def _validate_and_launch(cfg, args: argparse.Namespace) -> int:
    """``train --nproc N``: the run directory's lock first (torch-free: a second job on it is
    refused in seconds, before any work), then the checks in this one process (bad input costs one
    line and no launch, and leaves nothing behind), then the ranks."""
    from parallel_latent.training.run_lock import acquire_run_lock

    run_dir = Path(cfg.logging.run_dir)
    existed = run_dir.exists()
    lock = None
    with contextlib.suppress(NotADirectoryError, FileExistsError):  # a file in the way: preflight says so
        lock = acquire_run_lock(run_dir, args.wait_for_lock)
    try:
        from parallel_latent.training.preflight import preflight

        preflight(cfg, args.nproc, args.config, processes_per_node=args.nproc)
        _check_local_devices(cfg, args.nproc)
        lock = lock or acquire_run_lock(run_dir, args.wait_for_lock)
    except BaseException:
        if lock is not None:
            lock.release(remove=True)
        if not existed:
            with contextlib.suppress(OSError):
                run_dir.rmdir()  # only if empty
        raise
    return _launch_local(args.nproc, _rank_argv(args), run_dir, lock, existed, args.max_restarts)


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
    if args.wait_for_lock < 0:
        raise UsageError(f"--wait-for-lock={args.wait_for_lock:g} must be >= 0")
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts={args.max_restarts} must be >= 0")
    if args.max_restarts and (under_launcher() or not args.nproc or args.nproc < 2):
        raise UsageError(
            "--max-restarts restarts the ranks that --nproc N (N > 1) starts; under a launcher use its own "
            "(torchrun --max-restarts, a SLURM requeue)"
        )
    cfg = _load_train_config(args)
    if not under_launcher():
        if args.nproc and args.nproc > 1:
            return _validate_and_launch(cfg, args)
        tp = cfg.parallel.tensor_parallel
        if tp > 1:  # one process from a shell: say how to get the processes the config needs
            raise UsageError(
                f"{args.config}: parallel.tensor_parallel={tp} needs {tp} processes: add --nproc {tp} "
                "(or a multiple of it), or set parallel.tensor_parallel=1"
            )

    _prefer_cpu_accelerator()
    from parallel_latent.console import quiet_repeated_notices
    from parallel_latent.training.trainer import train

    quiet_repeated_notices()
    setattr(args, PER_RANK, True)
    train(cfg, deepspeed_overrides, source=args.config, wait_for_lock_s=args.wait_for_lock)
    return ExitStatus.OK


def reports_per_rank(args: argparse.Namespace) -> bool:
    return getattr(args, PER_RANK, False)


def report_rank_failure(error: Exception, status: ExitStatus) -> int:
    """Deterministic input problems (ConfigError, DataError, CheckpointError, a path of the wrong
    kind), non-finite steps and a failed save hit every rank alike: one line. An unexpected failure
    in one process keeps Python's own traceback; under a launcher the rank names itself."""
    from parallel_latent.console import report_failure

    if status is ExitStatus.FAILURE and not under_launcher():
        raise error
    return report_failure(error, status)


def _check_local_devices(cfg, nproc: int) -> None:
    """``--nproc N`` on a GPU host needs N GPUs: refused here, before any worker starts, instead of
    NCCL's "Duplicate GPU detected" after the whole start-up."""
    from parallel_latent.parallel.state import check_processes_fit_devices
    from parallel_latent.training.preflight import resolve_device

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


def shutdown_process_groups(args: argparse.Namespace) -> None:
    if not reports_per_rank(args):
        return
    from parallel_latent.parallel import destroy_distributed

    # A broken group (a peer died) must not mask the real error.
    with contextlib.suppress(RuntimeError, ValueError):
        destroy_distributed()


def add_subcommands(sub) -> None:
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
    train.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="with --nproc: when a rank fails, restart every rank up to N times, each time resuming from the newest "
        "complete checkpoint (default 0: the job ends with the failing rank's one line)",
    )
    train.add_argument(
        "--wait-for-lock",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="if another training job holds the run directory, wait up to this long for it to end before "
        "giving up (for requeued jobs); default: give up at once",
    )
    train.set_defaults(handler=cmd_train)
