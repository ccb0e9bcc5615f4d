"""Start-up of a training job, on every rank: the job's plan (:mod:`.preflight`: the launcher's, or
rank 0's for every rank), the process groups, the run directory's lock, then the job's acceptance
(the tokenizer and the model once per node, the plan's checkpoint checked against the tokenizer's
vocabulary and the loaded decoder, the data, the DeepSpeed engine), and only then the run's first
files. :func:`start_run` returns a :class:`Run`, which the trainer takes; a job refused at any point
leaves the run directory byte for byte as it found it.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from parallel_latent.checkpoint import checkpoints_dir, move_aside, remove_unfinished_saves
from parallel_latent.checkpoint.layout import read_info
from parallel_latent.config import Config, ConfigError, save_config
from parallel_latent.coordination import broadcast_value, decided_by_main, directory_is_shared, is_main, main_first
from parallel_latent.data import build_datasets
from parallel_latent.feature_model.cache import cache_wanted, job_cache
from parallel_latent.feature_model.features import random_features_unannounced
from parallel_latent.feature_model.tokenizer import apply_tokenizer_facts, load_tokenizer, tokenizer_facts
from parallel_latent.feature_model.weight_files import check_decoder_files
from parallel_latent.launching.cluster import launcher_environment
from parallel_latent.launching.rendezvous import StartupTimeout, join_job
from parallel_latent.launching.reports import restart_line
from parallel_latent.launching.worker_logs import WORKER_LOGS_ENV
from parallel_latent.model import build_model, eval_mode
from parallel_latent.parallel import ParallelState

from .decoder_plan import with_planned_decoder
from .engine_setup import EngineBundle, dump_deepspeed_config, initialize_engine
from .preflight import JobPlan, plan_for_this_run, planned_resume, preflight, require_same_vocabulary, resolve_device
from .run_lock import HELD_BY_LAUNCHER_ENV, LOCK_FILE, RunDirLocked, RunLock, acquire_run_lock
from .watchdog import Progress, Watchdog, clear_progress, collective_timeout_s, previous_job_failure
from .world import validate_world

__all__ = ["Run", "preflight", "start_run"]


# --------------------------------------------------------------------------- #
# Start-up on every rank.
# --------------------------------------------------------------------------- #


def accepted_by_launcher(run_dir: Path) -> bool:
    """Whether the ``train --nproc`` that started this rank accepted the job (it holds the run
    directory's lock for it, and read the checkpoint to resume whole before launching)."""
    return os.environ.get(HELD_BY_LAUNCHER_ENV) == str((run_dir / LOCK_FILE).resolve())


def move_damaged_aside(damaged: tuple[tuple[str, str], ...], intact: Path | None) -> None:
    """Rank 0, once the job is accepted: each damaged checkpoint the plan passed over is renamed
    (never deleted), said in one line."""
    for path, damage in damaged:
        step_dir = Path(path)
        moved = move_aside(step_dir, intact)
        instead = f"resuming from {intact.name}" if intact is not None else "no intact checkpoint left: starting afresh"
        line = f"{damage}: checkpoint {step_dir.name} is truncated or damaged; moved to {moved.name}; {instead}"
        print(line, flush=True)


def require_shared_run_dir(run_dir: Path, source: str) -> None:
    """Checkpoints are written by every rank into one directory tree and published by rank 0; a
    run directory on node-local disks (or a relative path from different working directories)
    would be a different directory per node, and the job would hang at its first save or resume.
    Refuse it at start-up, in seconds, on every rank (collective). Nothing is created: the probe
    goes into the nearest existing ancestor and is removed."""
    probe_dir = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    if not directory_is_shared(probe_dir):
        raise ConfigError(
            f"{source}: logging.run_dir={run_dir} is not one directory for all ranks (node-local disks, or a "
            "relative path from different working directories): put the run directory on a file system "
            "every node shares"
        )


def load_tokenizer_once_per_node(cfg: Config, decoder_config: dict | None = None):
    """The tokenizer, fetched by the first process of each node before the others look for it in
    the (node-local) hub cache: one download per node instead of one per rank. The plan read the
    pretrained decoder's files whole where it was made (and its config, ``decoder_config``, which a
    tokenizer of its own is given); the first process of every other node (a launcher other than
    ``train --nproc``, over several nodes) reads its own node's here."""
    with main_first(per_node=True) as first:
        if cfg.feature_model.pretrained and first and not is_main():
            check_decoder_files(cfg.feature_model.name_or_path)
        own = cfg.feature_model.pretrained and cfg.tokenizer.name_or_path == cfg.feature_model.name_or_path
        return load_tokenizer(cfg.tokenizer, decoder_config=decoder_config if own else None)


def build_model_once_per_node(cfg: Config, tp_group, decoder_config: dict | None = None):
    """The model, a pretrained decoder built from the plan's ``decoder_config``; a pretrained feature model is
    fetched from the hub by the first process of each node before the others read it from the
    cache. Random features are said once, in the banner."""
    with main_first(per_node=True) if cfg.feature_model.pretrained else random_features_unannounced():
        return build_model(cfg, tp_group, decoder_config)


def measure_feature_norm(model, cfg: Config, train_set, state) -> None:
    """A fresh run's feature statistics (``model.feature_norm=standardize``): the tokens of the first
    ``model.feature_norm_samples`` training samples, whatever the seed, each DP rank a share (every
    rank of a TP group the same share), combined so that every rank keeps the same numbers."""
    if model.feature_norm is None:
        return
    mine = list(range(min(cfg.model.feature_norm_samples, len(train_set))))[state.dp_rank :: state.dp_size]
    size = cfg.training.micro_batch_size
    batches = (train_set.batch(mine[i : i + size]) for i in range(0, len(mine), size))
    with eval_mode(model):
        model.measure_feature_norm(batches, state.dp_group)


@dataclass
class Run:
    """What a training job is made of, built once by :func:`start_run` (the same on every rank but
    for each rank's own slices and samples)."""

    cfg: Config  # the tokenizer's facts applied, the checkpoint's global batch kept
    source: str  # where the config came from (named by every one-line error)
    state: ParallelState
    tokenizer: Any
    tokenizer_facts: dict
    resume_path: Path | None  # rank 0's choice, for every rank
    batch_note: str | None  # how the checkpoint's global batch is kept, if that changed anything
    train_set: Any
    eval_set: Any
    bundle: EngineBundle
    device_kind: str  # "cpu" | "cuda"
    started: float  # time.perf_counter() at the start
    progress: Progress = field(default_factory=Progress)  # what the main thread is doing (the trainer moves it)
    watchdog: Watchdog | None = None  # watching every rank's progress (None: one process, or switched off)
    run_lock: RunLock | None = None  # rank 0's hold on the run directory (None: its launcher holds it)

    @property
    def engine(self):
        return self.bundle.engine

    @property
    def model(self):
        return self.bundle.engine.module

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.logging.run_dir)

    @property
    def is_main(self) -> bool:
        return self.state.rank == 0

    def release(self, failure: str | None = None) -> None:
        """This rank is done (``failure``: why, if it failed): the watchdog leaves it out from now
        on, and rank 0 gives the run directory's lock up (if it, not its launcher, holds it)."""
        if self.watchdog is not None:
            self.watchdog.stop(failure)
        if self.run_lock is not None:
            self.run_lock.release()


def start_watchdog(cfg: Config, state: ParallelState, progress: Progress) -> Watchdog | None:
    """This rank's hang watchdog over ``progress`` (:mod:`parallel_latent.training.watchdog`), started; None
    in one process (nothing waits on it) or with ``training.hang_timeout_s=0``. Its records go into
    the run directory, which start-up has checked is one directory for every rank."""
    training = cfg.training
    if not training.hang_timeout_s or state.world_size == 1:
        return None
    run_dir = Path(cfg.logging.run_dir)
    launch_logs = os.environ.get(WORKER_LOGS_ENV)  # train --nproc: this launch's log directory
    stacks = Path(launch_logs) if launch_logs else run_dir / "logs" / time.strftime("stacks-%Y%m%d-%H%M%S")
    watchdog = Watchdog(
        progress, run_dir, state.rank, state.world_size, training.hang_timeout_s, training.hang_long_phase_s,
        stacks, active=dist.is_initialized,
    )  # fmt: skip
    return watchdog.start()


def take_run_directory(run_dir: Path, wait_for_lock_s: float) -> RunLock | None:
    """Rank 0: the run directory's lock (:mod:`parallel_latent.training.run_lock`), unless the ``train
    --nproc`` that started this job holds it. Every rank raises the same one line if another job
    holds the directory (collective). Returns the lock on rank 0, None elsewhere."""
    lock, refusal = None, None
    if is_main() and not accepted_by_launcher(run_dir):
        try:
            lock = acquire_run_lock(run_dir, wait_for_lock_s)
        except RunDirLocked as error:
            refusal = str(error)
    refusal = broadcast_value(refusal)
    if refusal is not None:
        raise RunDirLocked(refusal)
    return lock


@dataclass
class Accepted:
    """A job that every check has accepted, with what it is built of; nothing written yet."""

    cfg: Config
    tokenizer: Any
    facts: dict
    plan: JobPlan
    batch_note: str | None
    train_set: Any
    eval_set: Any
    bundle: EngineBundle

    @property
    def resume_path(self) -> Path | None:
        return self.plan.resume_path


def plan_on_every_rank(cfg: Config, source: str, launcher: dict) -> JobPlan | None:
    """This rank's part of planning before the process groups exist: the launcher's plan where
    ``train --nproc`` made one for this run (nothing checked again), else the checks every rank
    needs to join the job (the world against TP and the batch, the device) and None: rank 0 makes
    the plan once the process groups exist (:func:`plan_by_rank_0`)."""
    plan = plan_for_this_run(Path(cfg.logging.run_dir))
    if plan is None:
        validate_world(cfg, launcher["world_size"], source, launcher["local_world_size"])
        resolve_device(cfg, source)
    return plan


def plan_by_rank_0(cfg: Config, world_size: int, source: str, local_world_size: int | None) -> JobPlan:
    """The job's plan (:func:`preflight`) made by rank 0 alone and taken by every rank, or its
    one-line refusal raised on every rank alike (collective)."""
    return decided_by_main(_plan, cfg, world_size, source, local_world_size)


def _plan(cfg: Config, world_size: int, source: str, local_world_size: int | None) -> JobPlan:
    return with_planned_decoder(cfg, preflight(cfg, world_size, source, local_world_size))


def start_run(
    cfg: Config, deepspeed_overrides: dict | None = None, source: str = "<config>", wait_for_lock_s: float = 0.0
) -> Run:
    """Everything a rank needs before its first step (collective: every rank calls it). Nothing in
    the run directory changes until the job is accepted (:func:`_accept`: every check, the data,
    the model and the engine): a refused job leaves it byte for byte as it was, its lock's record
    included. Until then every wait is a collective bounded by the process groups' timeout; from
    then on the hang watchdog watches."""
    started = time.perf_counter()
    launcher = launcher_environment()
    plan = plan_on_every_rank(cfg, source, launcher)
    training, run_dir = cfg.training, Path(cfg.logging.run_dir)
    timeout_s = collective_timeout_s(training.hang_timeout_s, training.hang_long_phase_s)
    try:
        state = join_job(
            cfg.parallel.tensor_parallel, cfg.parallel.backend, timeout_s, training.hang_long_phase_s or None, launcher
        )
    except StartupTimeout as error:
        raise StartupTimeout(f"{error} (training.hang_long_phase_s)") from None
    require_shared_run_dir(run_dir, source)  # (its probe leaves nothing)
    run_dir_existed = run_dir.exists()
    if plan is None:  # (before the lock, as the launcher's: a run directory in the way is said as such)
        plan = plan_by_rank_0(cfg, state.world_size, source, launcher["local_world_size"])
    run_lock = take_run_directory(run_dir, wait_for_lock_s)
    try:
        accepted = _accept(cfg, deepspeed_overrides, source, state, plan)
        return _commit(accepted, source, state, started, run_lock)
    except BaseException:
        if run_lock is not None:
            run_lock.release(undo=True)
        if not run_dir_existed:
            with contextlib.suppress(OSError):
                run_dir.rmdir()  # only if empty
        raise


def _accept(cfg, deepspeed_overrides, source, state, plan: JobPlan) -> Accepted:
    """The plan carried out up to the first file: the tokenizer, the plan's checkpoint checked for
    what planning could not know (the tokenizer's vocabulary), the data, the model and the engine.
    Writes nothing in the run directory (the data's prepared copy goes to its cache). Every rank
    resumes the plan's checkpoint, with its global batch kept, whatever the new layout: the run
    goes on as the same run."""
    tokenizer = load_tokenizer_once_per_node(cfg, plan.decoder_config)
    facts = tokenizer_facts(tokenizer)
    cfg = apply_tokenizer_facts(cfg, facts)
    resume_path = plan.resume_path
    require_same_vocabulary(cfg, resume_path)
    cfg, batch_note = planned_resume(cfg, state.world_size, plan)
    train_set, eval_set = build_datasets(cfg, tokenizer)
    model = build_model_once_per_node(cfg, state.tp_group, plan.decoder_config)
    bundle = initialize_engine(model, cfg, state.world_size, deepspeed_overrides, device=plan.device)
    if cache_wanted(cfg.feature_model):  # the frozen pass once per sample: batches carry their features
        cache = job_cache(
            cfg, bundle.engine.module.feature_model, train_set.data, len(train_set) + len(eval_set), state,
            bundle.engine.device,
        )  # fmt: skip
        train_set, eval_set = train_set.with_features(cache), eval_set.with_features(cache)
    if resume_path is None:  # a resume reads the statistics from its checkpoint
        measure_feature_norm(bundle.engine.module, cfg, train_set, state)
    return Accepted(cfg, tokenizer, facts, plan, batch_note, train_set, eval_set, bundle)


def _commit(accepted: Accepted, source: str, state, started: float, run_lock: RunLock | None) -> Run:
    """The accepted job takes the run directory: rank 0 reads how the job before ended and clears
    its progress records, moves damaged checkpoints aside, removes what dead saves left (a save
    killed half-way may have left the disk full) and writes the run's config; then every rank's
    watchdog starts (after the records are cleared: they start once all hear back)."""
    cfg, resume_path = accepted.cfg, accepted.resume_path
    run_dir = Path(cfg.logging.run_dir)
    if state.rank == 0:
        before = previous_job_failure(run_dir)
        clear_progress(run_dir)
        accepted.plan.say_notices()
        move_damaged_aside(accepted.plan.passed_over, resume_path)
        for unfinished in remove_unfinished_saves(checkpoints_dir(run_dir)):
            print(f"removed {unfinished}: a checkpoint save that never finished", flush=True)
        if line := restart_line(before, None if resume_path is None else read_info(resume_path)["step"]):
            print(line, flush=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        (run_dir / "deepspeed_config.json").write_text(dump_deepspeed_config(accepted.bundle.config) + "\n")
    broadcast_value(None)  # every rank's watchdog starts after rank 0 cleared the records
    progress = Progress()
    run = Run(
        cfg, source, state, accepted.tokenizer, accepted.facts, resume_path, accepted.batch_note,
        accepted.train_set, accepted.eval_set, accepted.bundle, accepted.plan.device, started, progress,
        start_watchdog(cfg, state, progress), run_lock,
    )  # fmt: skip
    return run
