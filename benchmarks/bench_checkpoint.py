"""Portable checkpoint vs ``torch.save`` of the full state dict: save time, load time, bytes on disk.

The model is the ``configs/gpt2.yaml`` autoencoder (d=768, 6+6 Perceiver blocks, vocabulary 50259
padded, and its GPT-2 cut to hidden state -3) with random weights (``feature_model.pretrained`` is
switched off: no hub needed; the shapes are GPT-2 small's). One process, TP=1, CPU.

Both contenders do the same job end to end:

* save: portable = ``save_portable`` (safetensors + manifest, sha256 of every tensor, fsync, atomic
  rename); baseline = ``torch.save(model.state_dict(), path)`` then fsync (so both pay the flush);
* load into an existing model: portable = ``load_portable`` (manifest and size checks, every
  checksum verified; also reported without verification); baseline = ``torch.load(weights_only=True)``
  then ``model.load_state_dict``.

Repeats are interleaved (portable, baseline, portable, ...) so drifting machine load hits both
alike; the medians are reported. Files are read from the page cache (both were just written);
dropping the cache would need root and disturb other users of the machine.

    python benchmarks/bench_checkpoint.py [--repeats 5] [--dir /tmp/x] [--json out.json]
    python benchmarks/bench_checkpoint.py --quick     # seconds: configs/tiny.yaml's model, 2 repeats
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

from common import REPO, Report, add_common_arguments, run


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
        f"{'load (s, median, no sha256)':28}{medians['portable_load_unverified']:12.3f}"
        f"{medians['torch_load']:12.3f}{ratios['load_unverified']:8.2f}"
    )
    print(f"{'bytes on disk':28}{sizes['portable']:12,d}{sizes['torch_save']:12,d}{ratios['bytes']:8.4f}")
    report.figure(f"portable save / torch.save, {args.config}", ratios["save"], "x")
    report.figure(f"portable load (checksums verified) / torch.load, {args.config}", ratios["load"], "x", at_most=1.0)
    report.figure(f"portable load (no checksums) / torch.load, {args.config}", ratios["load_unverified"], "x")
    report.figure(f"portable bytes / torch.save bytes, {args.config}", ratios["bytes"], "x", at_most=1.02)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--config", default="gpt2.yaml", help="the model of this file under configs/")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    add_common_arguments(parser)
    return run("bench_checkpoint", parser, body)


if __name__ == "__main__":
    sys.exit(main())
