"""The export: every sample of a corpus's prepared copy, in row order, encoded in fixed-size batches
by the model's own ``encode`` and written as shards (:mod:`.writer`), then the index (:mod:`.format`).

Work is split by shards: data-parallel rank ``r`` takes every ``dp``-th shard still missing, its
tensor-parallel group encodes each batch together, and the group's first rank writes. A rerun of the
same command (with any ``--nproc``) encodes only the shards that are missing. The batches, and so the
bytes, depend on ``export.batch_size`` and the corpus alone. ``DIR/.export/`` goes when the export is
complete.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from parallel_latent import coordination, files
from parallel_latent.data import open_for_training, resolve_source
from parallel_latent.data.sources import read_split, samples_per_file
from parallel_latent.errors import os_reason
from parallel_latent.files import load_json_file
from parallel_latent.launching.worker_logs import WORKER_LOGS_ENV
from parallel_latent.model import eval_mode
from parallel_latent.parallel import get_parallel_state

from .format import (
    INDEX_FILE,
    LOCK_FILE,
    LOGS_DIR,
    RECORDS_DIR,
    RUN_FILE,
    TMP_PREFIX,
    WORK_DIR,
    ExportError,
    ExportWriteError,
    datasets_files,
    export_identity,
    index_record,
    read_json,
    shard_name,
)
from .plan import ExportPlan, identity_difference, output_state
from .writer import Moments, ShardWriter

__all__ = ["export_latents", "remove_work_files"]


def _completed_shards(out: Path, num_shards: int) -> list[dict]:
    """Records of the shards already published, less their statistics (d floats each: they are
    merged from the files at the end, so that no rank holds them all); the rest, and their
    leftovers, are removed."""
    work, done = out / WORK_DIR, []
    for index in range(num_shards):
        final, record_path = out / shard_name(index, num_shards), work / RECORDS_DIR / f"{index:05d}.json"
        record = None
        if record_path.is_file():
            with contextlib.suppress(ValueError, OSError):
                record = load_json_file(record_path)
        if record and final.is_file() and final.stat().st_size == record.get("bytes"):
            done.append({key: value for key, value in record.items() if key != "moments"})
            continue
        final.unlink(missing_ok=True)
        record_path.unlink(missing_ok=True)
    return done


def _start(plan: ExportPlan, out: Path, data, lock_stack: contextlib.ExitStack) -> tuple[str, list[dict]]:
    """Rank 0: check the directory against this export, take its lock, record the export and
    clear a dead run's staging files. ("complete" | "go", the shards already done)."""
    identity = export_identity(plan, data)
    state, found = output_state(out)
    if state != "new":
        difference = identity_difference(found or {}, identity)
        if difference:
            raise ExportError(f"{out}: holds an export of {difference}; choose another --out, or delete it")
    if state == "complete":
        return "complete", []
    work = out / WORK_DIR
    work.mkdir(parents=True, exist_ok=True)
    lock = files.ExclusiveLock(work / LOCK_FILE)  # dropped with the process: a killed export never blocks its rerun
    if lock.try_acquire() is not None:
        raise ExportError(f"{out}: another export is writing into it (one export at a time per directory)")
    lock_stack.callback(lock.release)
    state, found = output_state(out)  # as it is now that no one else writes
    if state == "complete":
        return "complete", []
    for leftover in work.glob(f"{TMP_PREFIX}*"):
        leftover.unlink(missing_ok=True)
    (work / RECORDS_DIR).mkdir(exist_ok=True)
    if state == "new":
        files.replace_file(work / RUN_FILE, json.dumps(identity, indent=1) + "\n")
    return "go", _completed_shards(out, math.ceil(len(data) / plan.export.shard_size))


def _progress_bar(enabled: bool, total: int, initial: int):
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        initial=initial,
        unit="samples",
        desc="encoding",
        disable=not enabled or not coordination.is_main(),
        dynamic_ncols=True,
        mininterval=1.0,
        file=sys.stderr,
    )


def _stop_together(failed: bool, state) -> bool:
    """Whether the writer of this tensor-parallel group has failed, on every rank of the group (the
    others must stop encoding with it, or they would wait for it in the next collective)."""
    if state.tp_size == 1:
        return failed
    import torch.distributed as dist

    flag = torch.tensor([1 if failed else 0], dtype=torch.int32, device=state.device)
    dist.broadcast(flag, src=state.tp_ranks[0], group=state.tp_group)
    return bool(flag.item())


def _encode_shards(autoencoder, data, shards, plan: ExportPlan, out: Path, state, progress, watching=None) -> None:
    """This rank's share of the missing shards, encoded batch by batch and (on the first rank of
    its tensor-parallel group) written; ExportWriteError when writing fails."""

    export, model, device = plan.export, autoencoder.model, autoencoder.device
    num_shards = math.ceil(len(data) / export.shard_size)
    writer = ShardWriter(out, num_shards, data.max_length, export.precision) if state.tp_rank == 0 else None
    try:
        with torch.no_grad(), eval_mode(model):
            for index in shards:
                first = index * export.shard_size
                end = min(first + export.shard_size, len(data))
                if watching is not None:
                    watching.progress.enter("encoding", index)  # the shard being encoded
                if writer is not None:
                    writer.begin(index, first, end - first)
                for start in range(first, end, export.batch_size):
                    if watching is not None:
                        watching.progress.enter("encoding", index)
                    rows = np.arange(start, min(start + export.batch_size, end))
                    batch = data.rows(rows)
                    mask = batch["attention_mask"]
                    latents = model.encode(batch["input_ids"].to(device), mask.to(device))
                    if _stop_together(writer is not None and writer.failed.is_set(), state):
                        return
                    if writer is not None:
                        writer.put(_stored(latents), mask.numpy(), rows, mask.sum(1).numpy(), data.truncated[rows])
                    if watching is not None:  # past the first batch (its allocations): the short allowance
                        watching.progress.finished_step()
                    # Rank 0 counts the other data-parallel ranks' batches as its own (they run abreast).
                    progress.update(max(0, min(len(rows) * state.dp_size, progress.total - progress.n)))
                if writer is not None:
                    writer.end()
    except BaseException:
        # Interrupted (Ctrl-C, a forwarded SIGTERM): not waiting for the writer thread (a daemon)
        # leaves its shard unpublished in the work directory, as a kill would, for the rerun to remove.
        writer = None
        raise
    finally:
        if writer is not None:
            writer.close()


def _stored(latents: torch.Tensor) -> np.ndarray:
    """What a shard holds: float32, or a bfloat16's 16 bits as uint16."""
    latents = latents.detach().cpu()
    if latents.dtype == torch.bfloat16:
        return latents.contiguous().view(torch.int16).numpy().view(np.uint16)
    return latents.float().contiguous().numpy()


def _rows_of_files(plan: ExportPlan, num_samples: int) -> list[dict] | None:
    """Which rows come from which part of the source: row ``first_row`` + k is the part's k-th
    sample, by the preparation's rules (see :func:`parallel_latent.data.sources.samples_per_file`).
    Files: one entry per file, ``format`` its format. A saved or hub dataset: one entry for all of
    it, ``file`` its location (the directory, or ``hf:NAME[:CONFIG]``), ``format`` ``saved`` or
    ``hub``, ``split`` the split read (null for a saved ``Dataset``, which has none), first_row 0
    and every row. None where the source cannot be read now, or its counts do not add up to the
    prepared copy's rows (it changed since it was prepared)."""
    data = plan.cfg.data
    source = resolve_source(data.path, data.format)
    counts = samples_per_file(source, data.text_field, data.sample_unit, data.split)
    if counts is None or sum(counts) != num_samples:
        return None
    if source.kind in ("saved", "hub"):
        location = source.location if source.kind == "hub" else str(Path(source.location).resolve())
        split = read_split(source, data.split)
        return [{"file": location, "format": source.kind, "split": split, "first_row": 0, "rows": num_samples}]
    starts = np.cumsum([0, *counts[:-1]]).tolist()
    return [
        {"file": path, "format": fmt, "first_row": int(first), "rows": count}
        for (path, fmt), first, count in zip(source.files, starts, counts, strict=True)
    ]


def _merged_moments(out: Path, num_shards: int) -> Moments:
    """The shards' statistics merged in shard order, one record at a time: the same bits every run."""
    moments = None
    for index in range(num_shards):
        part = Moments.from_dict(read_json(out / WORK_DIR / RECORDS_DIR / f"{index:05d}.json")["moments"])
        moments = part if moments is None else moments.merged(part)
    return moments


def _finish(plan: ExportPlan, out: Path, data) -> dict:
    """Rank 0, every shard published: the datasets files and the index, then the work files go."""
    num_shards = math.ceil(len(data) / plan.export.shard_size)
    records = _completed_shards(out, num_shards)
    if len(records) != num_shards:
        missing = sorted(set(range(num_shards)) - {r["first"] // plan.export.shard_size for r in records})
        raise ExportWriteError(f"{out}: shard {missing[0]} is missing after every rank finished; rerun to continue")
    shapes = {tuple(r["latent_shape"]) for r in records}
    if len(shapes) != 1:
        raise RuntimeError(f"{out}: the shards hold latents of several shapes {sorted(shapes)}")
    (latent_shape,) = shapes
    shards = [{key: r[key] for key in ("file", "first", "count", "num_tokens", "bytes", "xxh3_128")} for r in records]
    moments = _merged_moments(out, num_shards)
    index = index_record(plan, data, shards, latent_shape, moments, _rows_of_files(plan, len(data)))
    storage = "uint16" if plan.export.precision == "bf16" else "float32"
    state, info = datasets_files(shards, len(data), latent_shape, storage, data.max_length)
    files.replace_file(out / "state.json", json.dumps(state, indent=2) + "\n")
    files.replace_file(out / "dataset_info.json", json.dumps(info, indent=2) + "\n")
    files.replace_file(out / INDEX_FILE, json.dumps(index, indent=1) + "\n")  # last: the export is complete
    # The logs of the --nproc launcher that runs this job stay for it to close; a dead job's go.
    remove_work_files(out, keep_logs=WORKER_LOGS_ENV in os.environ)
    return index


def remove_work_files(out: Path, keep_logs: bool) -> None:
    """``.export/`` of a complete export (its ``logs/`` kept for the launcher that writes them)."""
    work = out / WORK_DIR
    if not work.is_dir():
        return
    for entry in work.iterdir():
        if keep_logs and entry.name == LOGS_DIR:
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        work.rmdir()  # only if empty


def export_latents(autoencoder, plan: ExportPlan, out: str | Path, *, progress: bool | None = None, watch=None) -> dict:
    """Encode every sample of ``plan``'s corpus with ``autoencoder`` (a
    :class:`parallel_latent.api.TextAutoencoder` loaded from ``plan.directory`` at the job's TP
    degree, in ``export.precision``) into the latent dataset ``out`` (see :mod:`parallel_latent.latents`);
    returns its index. Collective over the process groups of :mod:`parallel_latent.parallel.state`
    (world = TP x DP; every rank calls it). A directory holding this very export, partly or wholly,
    is continued (nothing done twice); one holding another export or anything else is refused
    (ExportError, one line), as is a second export into it while one runs. ``watch(directory)``: a
    hang watchdog started over the export once its work directory is taken (its records go there),
    returning what has ``progress.enter(phase, step)`` and ``stop()``."""

    out, cfg = Path(out), plan.cfg
    wanted = torch.bfloat16 if plan.export.precision == "bf16" else torch.float32
    if next(autoencoder.model.parameters()).dtype != wanted:
        raise ExportError(f"export.precision={plan.export.precision} but the model holds other than {wanted} weights")
    coordination.decided_by_main(output_state, out)  # a file, or someone else's directory: refused before any work
    prepared = open_for_training(cfg, autoencoder.tokenizer, announce=coordination.is_main())
    with contextlib.ExitStack() as lock:
        status, done = coordination.decided_by_main(_start, plan, out, prepared, lock)
        if status == "complete":
            return read_json(out / INDEX_FILE)
        watching = watch(out / WORK_DIR) if watch is not None else None
        try:
            _encode_all(autoencoder, prepared, plan, out, done, progress, watching)
        finally:
            if watching is not None:
                watching.stop()  # every rank, before rank 0 removes the work files (and the records in them)
        index = _finish_on_main(plan, out, prepared)
    return index if index is not None else read_json(out / INDEX_FILE)


def _encode_all(autoencoder, prepared, plan: ExportPlan, out: Path, done: list[dict], progress, watching) -> None:
    """This rank's share of the missing shards; every rank learns whether any rank failed (any error
    at all: none may go on to wait for an index that will not come)."""
    state = get_parallel_state()
    num_shards = math.ceil(len(prepared) / plan.export.shard_size)
    finished = {record["first"] // plan.export.shard_size for record in done}
    mine = [index for index in range(num_shards) if index not in finished][state.dp_rank :: state.dp_size]
    enabled = plan.cfg.logging.progress_bar if progress is None else progress
    error = None
    with _progress_bar(enabled, len(prepared), sum(record["count"] for record in done)) as bar:
        try:
            _encode_shards(autoencoder, prepared, mine, plan, out, state, bar, watching)
        except Exception as caught:
            error = caught
    if watching is not None:
        watching.progress.enter("writing")
    coordination.fail_together(error, ExportWriteError)


def _finish_on_main(plan: ExportPlan, out: Path, prepared) -> dict | None:
    """Rank 0 writes the index (collective: every rank learns whether it could)."""
    index, error = None, None
    if coordination.is_main():
        try:
            index = _finish(plan, out, prepared)
        except OSError as caught:
            error = ExportWriteError(f"{out}: index not written: {os_reason(caught)}")
    message = coordination.broadcast_value(None if error is None else str(error))
    if error is not None:
        raise error
    if message is not None:
        raise ExportWriteError(message)
    return index
