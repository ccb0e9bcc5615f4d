"""Writing a training checkpoint: now (:func:`save_training_checkpoint`), or in the background while
training goes on (:func:`start_background_save`, then :func:`finish_background_save`).

Every rank writes into ``.tmp-step_N`` (:mod:`.layout`): DeepSpeed's files, its RNG states, the
portable weights of its TP rank, and on rank 0 the trainer's state; then rank 0 writes
``checkpoint.json`` (which marks the directory complete), publishes the directory by one rename,
moves ``latest`` and prunes to the last K. DeepSpeed's own ``latest`` is not used: it would be
written before our files exist. Like DeepSpeed's, these checkpoints assume a file system shared by
all ranks. The files are the same bytes whichever way they are written.

What a rank writes is taken first (:func:`_capture`: DeepSpeed's state dicts, the RNG states, the
portable shards), as jobs that write it; a synchronous save runs them at once, a background save
runs them on a thread (:mod:`.background`) from copies of the state. A write that fails on any rank
is not raised where it happens: the ranks agree that it failed, rank 0 removes the staging
directory, and every rank raises one :class:`CheckpointSaveError` naming the step, the reason and
the last complete checkpoint (for a background save: in :func:`finish_background_save`, which the
trainer calls at the step after any rank's writer failed, or where the next save or the end of
training waits for it; only then, with every rank's writer stopped, is the staging directory removed).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from parallel_latent.coordination import all_gather_value, barrier, is_main
from parallel_latent.zero.checkpoint_files import OWN_NAME_KEY, OWN_STEP_KEY, save_keeping_errno
from parallel_latent.zero.patches import checkpoint_writes
from parallel_latent.zero.version import import_deepspeed

from . import layout
from .background import BackgroundSave, HostCopies, snapshot
from .engine_state import _rank, _rng_file, _tensor_facts, capture_rng_state, engine_layout
from .integrity import file_record
from .layout import CheckpointSaveError
from .portable import capture_portable, plain

logger = logging.getLogger(__name__)

__all__ = ["PendingSave", "finish_background_save", "save_training_checkpoint", "start_background_save"]

# Test hook: seconds to wait after everything is written and before the rename that publishes
# (``SECONDS`` or ``SECONDS@STEP``), leaving PAUSE_MARKER in the staging directory meanwhile; removing
# the marker ends the wait early (a test releases the save when it has seen what it waits for).
PAUSE_BEFORE_PUBLISH_ENV = "PARALLEL_LATENT_PAUSE_BEFORE_PUBLISH"
PAUSE_MARKER = "PAUSED_BEFORE_PUBLISH"


@dataclass
class SaveRequest:
    """What one checkpoint of ``engine`` at ``step`` holds (see :func:`save_training_checkpoint`)."""

    engine: object
    checkpoint_dir: Path
    step: int
    client_state: dict | None = None
    model: object = None
    cfg: object = None
    tokenizer_facts: dict | None = None
    # A tokenizer whose files go beside the portable weights, so that the checkpoint decodes by itself
    # (None: the built-in offline GPT-2 BPE, which every installation has).
    tokenizer: object = None
    keep_last: int = 0
    export_portable: bool = False
    tp_group: object = None
    record_keywords: dict | None = None  # what the saver measured of the model (model_record's keywords)

    def __post_init__(self) -> None:
        self.checkpoint_dir = Path(self.checkpoint_dir)
        self.model = self.model if self.model is not None else self.engine.module

    @property
    def tag(self) -> str:
        return layout.checkpoint_tag(self.step)

    @property
    def staging(self) -> Path:
        return self.checkpoint_dir / f"{layout.STAGING_PREFIX}{self.tag}"


def _pause_before_publish(staging: Path, step: int) -> None:
    seconds, _, at_step = os.environ.get(PAUSE_BEFORE_PUBLISH_ENV, "").partition("@")
    if seconds and (not at_step or int(at_step) == step):
        marker = staging / PAUSE_MARKER
        marker.write_text(str(os.getpid()))
        deadline = time.monotonic() + float(seconds)
        while marker.exists() and time.monotonic() < deadline:  # a test may end the pause early
            time.sleep(0.05)
        marker.unlink(missing_ok=True)


def _client_state_record(request: SaveRequest) -> dict:
    """``client_state.json``: the trainer's state, the engine's counters, the LR schedule, the
    tokenizer's facts and the config."""
    engine = request.engine
    scheduler = getattr(engine, "lr_scheduler", None)
    return {
        "step": request.step,
        "client": plain(request.client_state or {}),
        "engine": {key: int(getattr(engine, key)) for key in ("global_steps", "global_samples", "skipped_steps")},
        "lr_scheduler": plain(scheduler.state_dict()) if scheduler is not None else None,
        "tokenizer": plain(request.tokenizer_facts),
        "config": plain(request.cfg) if request.cfg is not None else None,
    }


def deferred_writes(engine, failures: list[str], jobs: list, step: int, copies: HostCopies | None = None):
    """Inside the block, each file DeepSpeed's save writes becomes a job appended to ``jobs`` (its
    state taken now with ``copies``: a :func:`.background.snapshot`, so training may go on), and a
    write it fails (a directory, the recovery script) appends the reason to ``failures`` instead of
    raising, so that DeepSpeed's save still reaches the barriers the other ranks wait at. Each state
    says which file and which ``step`` it was written as: a file copied in from another step or
    name is damage (:func:`~parallel_latent.zero.checkpoint_files.state_file_problem`)."""

    def save(state_dict, path: str, zipfile: bool) -> None:
        if isinstance(state_dict, dict):
            state_dict = {**state_dict, OWN_NAME_KEY: Path(path).name, OWN_STEP_KEY: step}
        state = snapshot(state_dict, copies, (Path(path).name,)) if copies is not None else state_dict
        jobs.append(lambda: save_keeping_errno(state, path, zipfile))

    def recorded(write):
        return lambda *args, **kwargs: layout.attempt(failures, lambda: write(*args, **kwargs))

    return checkpoint_writes(engine, save, recorded, layout.write_converting_note)


def _capture(request: SaveRequest, copies: HostCopies | None) -> tuple[list[str], list[Callable], Callable[[], None]]:
    """This rank's part of the checkpoint, taken now (collective: DeepSpeed's save, ZeRO-3's
    gathers; with ``copies``, into host memory training does not change): (the failures already
    met, the jobs that write its files, and on rank 0 what completes the checkpoint once every
    rank's files are written)."""
    engine, staging, step = request.engine, request.staging, request.step
    own_layout = engine_layout(engine)
    facts = _tensor_facts(engine, request.model, own_layout["tensor_parallel"], request.record_keywords)
    failures: list[str] = []
    jobs: list[Callable] = []
    if copies is not None:
        copies.begin()
    with deferred_writes(engine, failures, jobs, step, copies):
        engine.save_checkpoint(
            str(request.checkpoint_dir), tag=staging.name, client_state={"step": step}, save_latest=False
        )
    # Each state names its rank and step: a state moved from another rank's file or another checkpoint is found
    # before a resume.
    rng_file, rng_state = (
        _rng_file(staging, _rank()),
        {**capture_rng_state(request.model), "rank": _rank(), "step": step},
    )
    jobs += [lambda: rng_file.parent.mkdir(exist_ok=True), lambda: layout.write_json(rng_file, rng_state, indent=None)]
    portable = None
    if request.export_portable:
        portable = capture_portable(
            request.model, staging / layout.PORTABLE_DIR, request.cfg, request.tokenizer_facts, request.tp_group,
            step=step, copies=copies, record_keywords=request.record_keywords,
        )  # fmt: skip
        if portable.writes:
            jobs.append(portable.write_file_and_record)
    if is_main():
        state = _client_state_record(request)
        jobs.append(lambda: layout.write_json(staging / layout.CLIENT_STATE_FILE, state))

    def finish() -> None:
        if portable is not None:
            portable.write_manifest_from_records()
            if request.tokenizer is not None:
                request.tokenizer.save_pretrained(str(staging / layout.PORTABLE_DIR))
        info = {
            "tag": request.tag, "step": step, "layout": own_layout, "portable": request.export_portable,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "deepspeed_version": import_deepspeed().__version__,
            **facts,
            "files": file_record(staging),  # what the files are: a resume checks them first
        }  # fmt: skip
        layout.write_json(staging / layout.INFO_FILE, info)  # written last: marks the directory complete
        _pause_before_publish(staging, step)
        layout.publish_checkpoint(request.checkpoint_dir, staging, request.tag)
        try:
            layout.prune_checkpoints(request.checkpoint_dir, request.keep_last)
        except OSError as error:  # the checkpoint is published and complete: only the old ones stay
            logger.warning(
                "checkpoint at step %d written; pruning older checkpoints in %s failed: %s",
                step, request.checkpoint_dir, layout.error_reason(error),
            )  # fmt: skip

    return failures, jobs, finish


def _not_written(request: SaveRequest, failure: str) -> CheckpointSaveError:
    latest = layout.find_latest_checkpoint(request.checkpoint_dir)
    last = f"step {layout.read_info(latest)['step']}" if latest is not None else "none"
    where = f"({request.checkpoint_dir}); the last complete checkpoint is {last}"
    return CheckpointSaveError(f"checkpoint at step {request.step} not written: {failure} {where}")


def save_training_checkpoint(engine, checkpoint_dir: str | Path, step: int, client_state: dict | None = None, **rest):
    """Save a training checkpoint of ``engine`` at ``step``, publish it atomically and return its
    directory. Collective. Adds to the JSON-serializable ``client_state`` the engine's counters,
    LR scheduler and every rank's RNG states; ``export_portable`` also writes ``model/``. The other
    keywords: ``model``, ``cfg``, ``tokenizer_facts``, ``keep_last``, ``tp_group``, ``record_keywords``
    (:class:`SaveRequest`)."""
    request = SaveRequest(engine, checkpoint_dir, step, client_state, **rest)
    captured: list = []

    def write(failures: list[str]) -> None:
        found, jobs, finish = _capture(request, None)
        failures += found
        for job in jobs:
            layout.attempt(failures, job)
        captured.append(finish)

    def finish() -> None:
        captured[0]()

    failure = layout.save_collectively(request.staging, write, finish)
    if failure is not None:
        raise _not_written(request, failure)
    return request.checkpoint_dir / request.tag


@dataclass
class PendingSave:
    """A checkpoint being written in the background (:func:`start_background_save`)."""

    request: SaveRequest
    save: BackgroundSave | None  # None: the staging directory could not even be made
    failure: str | None = None

    @property
    def path(self) -> Path:
        return self.request.checkpoint_dir / self.request.tag

    def outcome(self) -> str:
        """This rank's part, known without waiting: ``"writing"``, ``"written"`` or ``"failed"``
        (:meth:`.background.BackgroundSave.outcome`)."""
        return self.save.outcome() if self.save is not None else "failed"


def start_background_save(
    engine, checkpoint_dir: str | Path, step: int, client_state: dict | None = None, *, timeout_s: float = 3600.0,
    copies: HostCopies | None = None, **rest,
) -> PendingSave:  # fmt: skip
    """Take a checkpoint of ``engine`` at ``step`` off the training tensors and write it on a thread
    (collective; the arguments as :func:`save_training_checkpoint`'s). Training may go on at once;
    :func:`finish_background_save` waits for it. Rank 0 waits up to ``timeout_s`` for the other
    ranks' files before it gives the save up. ``copies``: the host buffers of the previous save,
    reused (a fresh set otherwise); the save before must be finished."""
    request = SaveRequest(engine, checkpoint_dir, step, client_state, **rest)
    failure = layout.begin_save(request.staging)
    if failure is not None:
        return PendingSave(request, None, failure)
    found, jobs, finish = _capture(request, copies or HostCopies())
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    return PendingSave(
        request, BackgroundSave(request.staging, step, _rank(), world_size, jobs, finish, timeout_s, found)
    )


def finish_background_save(pending: PendingSave, given_up: bool = False) -> Path:
    """Wait for ``pending`` and agree on its outcome (collective): its published directory, or
    :class:`CheckpointSaveError` on every rank, the last complete checkpoint left as it was.
    ``given_up`` (the same on every rank): the ranks know already that some rank's part failed, so
    every writer skips what it has left (:meth:`.background.BackgroundSave.give_up`)."""
    if given_up and pending.save is not None:
        pending.save.give_up()
    own, peers = pending.save.wait() if pending.save is not None else (pending.failure, None)
    reports = all_gather_value((own, peers))
    failure = next((o for o, _ in reports if o), None) or next((p for _, p in reports if p), None)
    if failure is None and given_up:
        failure = "given up after another rank's failure"  # never published: not a success either way
    if failure is not None:
        if is_main():
            # Only here, with every rank's writer stopped (each joined its own before the gather),
            # can nothing write into the staging directory any more: no thread removes it, so no
            # marker of a slower rank is left behind, and no rank ends before it has gone.
            layout.discard(pending.request.staging)
        barrier()
        raise _not_written(pending.request, failure)
    return pending.path
