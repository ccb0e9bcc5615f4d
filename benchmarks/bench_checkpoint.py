"""Portable checkpoints against ``torch.save`` (save, load with and without checksums, bytes on disk), and
the training loop's stall per training checkpoint written in the background against a synchronous one,
on configs/gpt2.yaml's autoencoder with random weights (one process, TP=1, CPU; repeats interleaved).

    python -m benchmarks.bench_checkpoint [--repeats 5] [--quick]   # --quick: configs/tiny.yaml, 2 repeats"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.harness import REPO, Report, command
from parallel_latent.files import fsync, tree_bytes


def save_stalls(cfg, model, scratch: Path, repeats: int) -> tuple[float, float, float]:
    """Medians (s) of a training checkpoint's synchronous save, background save's stall and whole write."""
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
    from parallel_latent.config import load_config
    from parallel_latent.model import LatentAutoencoder

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    logging.getLogger("parallel_latent.feature_model.features").setLevel(logging.ERROR)
    started = time.perf_counter()
    cfg = load_config(REPO / "configs" / args.config)
    feature_cfg = dataclasses.replace(cfg.feature_model, pretrained=False)
    model = LatentAutoencoder(cfg.model, feature_cfg, seed=cfg.training.seed)
    target = LatentAutoencoder(cfg.model, feature_cfg, seed=cfg.training.seed + 1)
    n_params = sum(t.numel() for t in model.state_dict().values())
    print(f"model: {n_params / 1e6:.1f}M elements in the state dict "
          f"({sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20:.0f} MiB), "
          f"built in {time.perf_counter() - started:.1f}s")  # fmt: skip

    # In this order (each load reads what the saves just wrote), given the portable directory and the file.
    contenders = {
        "portable_save": lambda directory, file: save_portable(model, directory, cfg),
        "torch_save": lambda directory, file: (torch.save(model.state_dict(), file), fsync(file)),
        "portable_load": lambda directory, file: load_portable(directory, target),
        "torch_load": lambda directory, file: target.load_state_dict(torch.load(file, weights_only=True)),
        "portable_load_unverified": lambda directory, file: load_portable(directory, target, verify_checksums=False),
    }
    times: dict[str, list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as scratch:
        for repeat in range(args.repeats):
            portable_dir, torch_file = Path(scratch) / f"portable-{repeat}", Path(scratch) / f"state-{repeat}.pt"
            for name, contender in contenders.items():
                t0 = time.perf_counter()
                contender(portable_dir, torch_file)
                times[name].append(time.perf_counter() - t0)
            sizes = {"portable": tree_bytes(portable_dir), "torch_save": tree_bytes(torch_file)}
            shutil.rmtree(portable_dir)
            torch_file.unlink()
        pairs = zip(model.state_dict().values(), target.state_dict().values(), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)
    medians = {k: statistics.median(v) for k, v in times.items()}
    rows = {  # ratio -> (its row of the table, ours, torch's)
        "save": ("save (s, median)", "portable_save", "torch_save"),
        "load": ("load (s, median, verified)", "portable_load", "torch_load"),
        "load_unverified": ("load (s, median, no checksums)", "portable_load_unverified", "torch_load"),
    }
    ratios = {key: medians[ours] / medians[theirs] for key, (_, ours, theirs) in rows.items()}
    ratios["bytes"] = sizes["portable"] / sizes["torch_save"]
    print(f"{'':28}{'portable':>12}{'torch.save':>12}{'ratio':>8}")
    for key, (label, ours, theirs) in rows.items():
        print(f"{label:28}{medians[ours]:12.3f}{medians[theirs]:12.3f}{ratios[key]:8.2f}")
    print(f"{'bytes on disk':28}{sizes['portable']:12,d}{sizes['torch_save']:12,d}{ratios['bytes']:8.4f}")
    report.figure(f"portable save / torch.save, {args.config}", ratios["save"], "x")
    report.figure(f"portable load (checksums verified) / torch.load, {args.config}", ratios["load"], "x", at_most=1.0)
    report.figure(f"portable load (no checksums) / torch.load, {args.config}", ratios["load_unverified"], "x")
    report.figure(f"portable bytes / torch.save bytes, {args.config}", ratios["bytes"], "x", at_most=1.02)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-saves-") as scratch:
        sync, stall, whole = save_stalls(cfg, model, Path(scratch), args.repeats)
    print(f"training checkpoint with portable weights: synchronous {sync:.2f} s; background: the loop waits "
          f"{stall:.2f} s, the files take {whole:.2f} s")  # fmt: skip
    report.figure(f"training loop stall per save, background / synchronous, {args.config}", stall / sync, "x",
                  at_most=0.2)  # fmt: skip


def arguments(parser) -> None:
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--config", default="gpt2.yaml", help="the model of this file under configs/")


main = command("bench_checkpoint", __doc__, body, arguments, __name__)
