"""Portable checkpoint vs ``torch.save`` of the full state dict: save time, load time, bytes on disk;
and the training loop's stall per training checkpoint written in the background against one written
synchronously.

The model is the ``configs/gpt2.yaml`` autoencoder (d=768, 6+6 Perceiver blocks, vocabulary 50259
padded, and its GPT-2 cut to hidden state -3) with random weights (``feature_model.pretrained`` is
switched off: no hub needed; the shapes are GPT-2 small's). One process, TP=1, CPU.

Both contenders do the same job end to end:

* save: portable = ``save_portable`` (safetensors + manifest, an XXH3-128 checksum of every tensor, fsync, atomic
  rename); baseline = ``torch.save(model.state_dict(), path)`` then fsync (so both pay the flush);
* load into an existing model: portable = ``load_portable`` (manifest and size checks, every
  checksum verified; also reported without verification); baseline = ``torch.load(weights_only=True)``
  then ``model.load_state_dict``.

The stall per save: a DeepSpeed engine of the same model (the project's own, ZeRO-2, the config's
precision, one process) saves a training checkpoint with its portable weights, synchronously
(``save_training_checkpoint``: the loop waits for every file) and in the background
(``start_background_save``: the loop waits only for the copy off the training tensors; the files
are written on a thread, and waited for before the next save, as the trainer does).

Repeats are interleaved (portable, baseline, portable, ...) so drifting machine load hits both
alike; the medians are reported. Files are read from the page cache (both were just written);
dropping the cache would need root and disturb other users of the machine.

    python -m benchmarks.bench_checkpoint [--repeats 5] [--dir /tmp/x] [--json out.json]
    python -m benchmarks.bench_checkpoint --quick     # seconds: configs/tiny.yaml's model, 2 repeats
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import REPO, Report, add_common_arguments, run


def build_model(config: str = "gpt2.yaml"):
    import dataclasses
    import logging

    from parallel_latent.config import load_config
    from parallel_latent.model import LatentAutoencoder

    logging.getLogger("parallel_latent.model.features").setLevel(logging.ERROR)
    cfg = load_config(REPO / "configs" / config)
    feature_cfg = dataclasses.replace(cfg.feature_model, pretrained=False)
    return cfg, LatentAutoencoder(cfg.model, feature_cfg, seed=cfg.training.seed), feature_cfg


def tree_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def save_stalls(cfg, model, scratch: Path, repeats: int) -> tuple[float, float, float]:
    """Medians of (the synchronous save, the background save's stall, the background save's whole
    write), seconds, for a training checkpoint of ``model`` under the project's DeepSpeed engine."""
    import dataclasses

    from parallel_latent.checkpoint import finish_background_save, save_training_checkpoint, start_background_save
    from parallel_latent.checkpoint.background import HostCopies
    from parallel_latent.launching.rendezvous import join_job
    from parallel_latent.training.engine_setup import initialize_engine

    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tensor_parallel=1))
    join_job(1, "gloo")
    engine = initialize_engine(model, cfg, 1).engine
    arguments = dict(model=model, cfg=cfg, keep_last=1, export_portable=True)
    sync, stall, whole, copies = [], [], [], HostCopies()  # reused from save to save, as the trainer does
    for repeat in range(repeats):
        t0 = time.perf_counter()
        save_training_checkpoint(engine, scratch / "sync", 2 * repeat + 1, {}, **arguments)
        sync.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        pending = start_background_save(engine, scratch / "background", 2 * repeat + 2, {}, copies=copies, **arguments)
        stall.append(time.perf_counter() - t0)
        finish_background_save(pending)
        whole.append(time.perf_counter() - t0)
    return statistics.median(sync), statistics.median(stall), statistics.median(whole)


def body(args, report: Report) -> None:
    if args.quick:
        args.repeats, args.config = 2, "tiny.yaml"
    from parallel_latent.checkpoint import load_portable, save_portable
    from parallel_latent.model import LatentAutoencoder

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    started = time.perf_counter()
    cfg, model, feature_cfg = build_model(args.config)
    target = LatentAutoencoder(cfg.model, feature_cfg, seed=cfg.training.seed + 1)
    n_params = sum(t.numel() for t in model.state_dict().values())
    print(
        f"model: {n_params / 1e6:.1f}M elements in the state dict "
        f"({sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20:.0f} MiB), "
        f"built in {time.perf_counter() - started:.1f}s"
    )

    scratch = Path(args.dir or tempfile.mkdtemp(prefix="bench-checkpoint-"))
    scratch.mkdir(parents=True, exist_ok=True)
    times: dict[str, list[float]] = {
        k: [] for k in ("portable_save", "torch_save", "portable_load", "portable_load_unverified", "torch_load")
    }
    sizes = {}
    try:
        for repeat in range(args.repeats):
            portable_dir, torch_file = scratch / f"portable-{repeat}", scratch / f"state-{repeat}.pt"

            t0 = time.perf_counter()
            save_portable(model, portable_dir, cfg)
            times["portable_save"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            torch.save(model.state_dict(), torch_file)
            fsync_file(torch_file)
            times["torch_save"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            load_portable(portable_dir, target)
            times["portable_load"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            target.load_state_dict(torch.load(torch_file, weights_only=True))
            times["torch_load"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            load_portable(portable_dir, target, verify_checksums=False)
            times["portable_load_unverified"].append(time.perf_counter() - t0)

            sizes = {"portable": tree_bytes(portable_dir), "torch_save": tree_bytes(torch_file)}
            shutil.rmtree(portable_dir)
            torch_file.unlink()
        # The last load must have produced the saved weights exactly.
        pairs = zip(model.state_dict().values(), target.state_dict().values(), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)

    medians = {k: statistics.median(v) for k, v in times.items()}
    ratios = {
        "save": medians["portable_save"] / medians["torch_save"],
        "load": medians["portable_load"] / medians["torch_load"],
        "load_unverified": medians["portable_load_unverified"] / medians["torch_load"],
        "bytes": sizes["portable"] / sizes["torch_save"],
    }
    print(f"{'':28}{'portable':>12}{'torch.save':>12}{'ratio':>8}")
    print(f"{'save (s, median)':28}{medians['portable_save']:12.3f}{medians['torch_save']:12.3f}{ratios['save']:8.2f}")
    print(
        f"{'load (s, median, verified)':28}{medians['portable_load']:12.3f}{medians['torch_load']:12.3f}"
        f"{ratios['load']:8.2f}"
    )
    print(
        f"{'load (s, median, no checksums)':28}{medians['portable_load_unverified']:12.3f}"
        f"{medians['torch_load']:12.3f}{ratios['load_unverified']:8.2f}"
    )
    print(f"{'bytes on disk':28}{sizes['portable']:12,d}{sizes['torch_save']:12,d}{ratios['bytes']:8.4f}")
    report.figure(f"portable save / torch.save, {args.config}", ratios["save"], "x")
    report.figure(f"portable load (checksums verified) / torch.load, {args.config}", ratios["load"], "x", at_most=1.0)
    report.figure(f"portable load (no checksums) / torch.load, {args.config}", ratios["load_unverified"], "x")
    report.figure(f"portable bytes / torch.save bytes, {args.config}", ratios["bytes"], "x", at_most=1.02)

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    scratch = Path(tempfile.mkdtemp(prefix="bench-checkpoint-saves-"))
    try:
        sync, stall, whole = save_stalls(cfg, model, scratch, args.repeats)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(
        f"training checkpoint with portable weights: synchronous {sync:.2f} s; background: the loop waits "
        f"{stall:.2f} s, the files take {whole:.2f} s"
    )
    report.figure(
        f"training loop stall per save, background / synchronous, {args.config}", stall / sync, "x", at_most=0.2
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--config", default="gpt2.yaml", help="the model of this file under configs/")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    add_common_arguments(parser)
    return run("bench_checkpoint", parser, body)


if __name__ == "__main__":
    sys.exit(main())
