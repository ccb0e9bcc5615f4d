"""``parallel-latent train``: one rank of a training job, or the launcher of ``--nproc`` local ranks
(started and watched by :func:`parallel_latent.launching.local.launch_local`).

A failure inside training is met by every rank of the job: :func:`report_rank_failure` hands it to
the per-rank writer (:func:`parallel_latent.launching.reports.report_failure`), which says it once.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
from pathlib import Path

from parallel_latent.cli.bounds import MAX_LOCAL_PROCESSES, MAX_RESTARTS, MAX_WAIT_FOR_LOCK_S, check_range
from parallel_latent.errors import ExitStatus, UsageError, require_file

# Set on the parsed arguments once training has started on this rank: from then on a failure is
# reported per rank, and the process groups are torn down at the end.
PER_RANK = "reports_per_rank"


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


def accept_job(cfg, args: argparse.Namespace):
    """The acceptance phase of ``train --nproc N``: the run directory's lock first (torch-free: a
    second job on it is refused in seconds, before any work), then the job's plan in this one
    process (:func:`~parallel_latent.training.preflight.preflight`: the checks, the checkpoint to
    resume read whole), which the ranks carry out. Returns the lock (None where the file system
    cannot hold one: preflight has said why) and the plan; a refusal raises with one line and leaves
    the run directory as it was: the lock's file put back, a directory it made removed."""
    from parallel_latent.training.run_lock import acquire_run_lock
    from parallel_latent.training.watchdog import bounded_phase

    run_dir = Path(cfg.logging.run_dir)
    existed = run_dir.exists()
    lock = None

    def undo() -> None:
        if lock is not None:
            lock.release(undo=True)
        if not existed:
            with contextlib.suppress(OSError):
                run_dir.rmdir()  # only if empty

    try:
        lock = acquire_run_lock(run_dir, args.wait_for_lock)
    except (NotADirectoryError, FileExistsError):
        pass  # a file in the way: preflight says so
    except OSError as error:
        if error.errno != errno.EROFS:
            raise  # (a read-only file system: preflight says so)
    watched = cfg.training.hang_long_phase_s if cfg.training.hang_timeout_s > 0 else 0.0
    try:
        with bounded_phase("acceptance", watched, "training.hang_long_phase_s", undo):
            from parallel_latent.training.preflight import preflight

            plan = preflight(cfg, args.nproc, args.config, processes_per_node=args.nproc)
            if cfg.feature_model.pretrained:  # (transformers imported for it alone)
                from parallel_latent.training.decoder_plan import with_planned_decoder

                plan = with_planned_decoder(cfg, plan)
            _check_local_devices(plan.device, args.nproc)
            return lock or acquire_run_lock(run_dir, args.wait_for_lock), plan
    except BaseException:
        undo()
        raise


def _validate_and_launch(cfg, args: argparse.Namespace) -> int:
    """``train --nproc N``: the job accepted (:func:`accept_job`: bad input costs one line and no
    launch, and leaves nothing behind), then the ranks."""
    from parallel_latent.launching.local import launch_local
    from parallel_latent.training.preflight import PLAN_ENV
    from parallel_latent.training.run_lock import HELD_BY_LAUNCHER_ENV

    run_dir = Path(cfg.logging.run_dir)
    existed = run_dir.exists()
    lock, plan = accept_job(cfg, args)  # (its notices are in the plan: rank 0 says them)
    rank_env = {PLAN_ENV: plan.to_json()}
    if lock is not None:
        rank_env[HELD_BY_LAUNCHER_ENV] = str(lock.path.resolve())  # rank 0 takes none of its own
    return launch_local(args.nproc, _rank_argv(args), run_dir, lock, existed, args.max_restarts, rank_env)


def _rank_argv(args: argparse.Namespace) -> list[str]:
    """The command line each launched rank runs: this one without --nproc (which torchrun's own
    parser would take for an abbreviation of its --nproc-per-node)."""
    argv = ["train", "--config", args.config]
    if args.deepspeed_overrides:
        argv += ["--deepspeed-overrides", args.deepspeed_overrides]
    return argv + list(args.overrides)


def cmd_train(args: argparse.Namespace) -> int:
    from parallel_latent.launching.cluster import under_launcher

    deepspeed_overrides = _parse_overrides_json(args.deepspeed_overrides)
    check_range("--nproc", args.nproc, 1, MAX_LOCAL_PROCESSES)
    check_range("--wait-for-lock", args.wait_for_lock, 0, MAX_WAIT_FOR_LOCK_S, "seconds, at most a week")
    check_range("--max-restarts", args.max_restarts, 0, MAX_RESTARTS)
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

    from parallel_latent.zero.version import prefer_cpu_accelerator

    prefer_cpu_accelerator()
    from parallel_latent.launching.worker_logs import quiet_repeated_notices
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
    from parallel_latent.launching.cluster import under_launcher
    from parallel_latent.launching.reports import report_failure

    if status is ExitStatus.FAILURE and not under_launcher():
        raise error
    return report_failure(error, status)


def _check_local_devices(device: str, nproc: int) -> None:
    """``--nproc N`` on a GPU host (``device``: preflight's answer) needs N GPUs: refused here, before
    any worker starts, instead of NCCL's "Duplicate GPU detected" after the whole start-up."""
    from parallel_latent.parallel.state import check_processes_fit_devices

    if device == "cuda":
        import torch

        check_processes_fit_devices(nproc, torch.cuda.device_count())


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
