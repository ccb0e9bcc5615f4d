"""Corpus export (``parallel-latent encode-corpus``) on configs/tiny.yaml's model at TP=1: 1. export against
a bare encode loop over the same prepared batches (goal >= 0.9; ``--throughput-only``, ``--device``,
``--config``: gpu.sh's encode-corpus row); 2. the command's peak RSS, bundled corpus against ``--lines``
lines (goal + 100 MB); 3. a rerun after a SIGKILL at half of the shards against the whole run (goal <= 0.6).

    python -m benchmarks.bench_export [--quick]       # 200k lines (minutes on 2 cores); --quick: 1k lines
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_data import write_corpus
from benchmarks.harness import BUNDLED, TINY, Report, command, config_with_tokenizer
from benchmarks.processes import child_environment, watched_run

SETTINGS = ["parallel.tensor_parallel=1", "logging.progress_bar=false"]


def make_checkpoint(directory: Path, config: Path = TINY) -> Path:
    """``config``'s model with its initial weights (the speed does not depend on them), saved portable."""
    from parallel_latent.checkpoint import save_portable
    from parallel_latent.feature_model.tokenizer import tokenizer_facts
    from parallel_latent.model import build_model

    cfg, tokenizer = config_with_tokenizer(config, ["parallel.tensor_parallel=1", "feature_model.pretrained=false"])
    save_portable(build_model(cfg), directory, cfg, tokenizer_facts(tokenizer))
    return directory


def prepare(checkpoint: Path, corpus: Path, cache: Path, shard_size: int):
    """The prepared copy of ``corpus`` that the export reads (made once: no measured run pays for tokenising)."""
    from parallel_latent.data import open_for_training
    from parallel_latent.feature_model.tokenizer import load_tokenizer
    from parallel_latent.latents import plan_export

    plan = plan_export(checkpoint, corpus, [*SETTINGS, f"data.cache_dir={cache}", f"export.shard_size={shard_size}"])
    return open_for_training(plan.cfg, load_tokenizer(plan.cfg.tokenizer), announce=False)


def bench_throughput(checkpoint: Path, corpus: Path, cache: Path, work: Path, args) -> dict:
    import numpy as np
    import torch

    from parallel_latent.api import TextAutoencoder
    from parallel_latent.data import open_for_training
    from parallel_latent.latents import export_latents, plan_export
    from parallel_latent.launching.rendezvous import join_job
    from parallel_latent.model import eval_mode

    device, shard_size = args.device, args.shard_size
    plan = plan_export(checkpoint, corpus, [*SETTINGS, f"data.cache_dir={cache}", f"export.shard_size={shard_size}"])
    join_job(1, "gloo")
    autoencoder = TextAutoencoder.from_checkpoint(plan.directory, device=device)
    data = open_for_training(plan.cfg, autoencoder.tokenizer, announce=False)
    batch_size, model = plan.export.batch_size, autoencoder.model

    def bare() -> float:
        started = time.perf_counter()
        with torch.no_grad(), eval_mode(model):
            for start in range(0, len(data), batch_size):
                batch = data.rows(np.arange(start, min(start + batch_size, len(data))))
                ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
                model.encode(ids, mask).float().cpu().numpy()
        return time.perf_counter() - started

    def export() -> float:
        out = work / "throughput"
        shutil.rmtree(out, ignore_errors=True)
        started = time.perf_counter()
        export_latents(autoencoder, plan, out, progress=False)
        elapsed = time.perf_counter() - started
        shutil.rmtree(out, ignore_errors=True)
        return elapsed

    bare()  # warm: the first pass pages the prepared copy in and warms the allocator
    rounds = [(bare(), export()) for _ in range(args.repeats)]
    fastest_bare, fastest_export = min(b for b, _ in rounds), min(e for _, e in rounds)
    return {"samples": len(data), "bare_per_s": len(data) / fastest_bare, "export_per_s": len(data) / fastest_export,
            "ratio": fastest_bare / fastest_export}  # fmt: skip


def run_export(checkpoint: Path, corpus: Path, cache: Path, out: Path, shard_size: int, kill_at_shards=None) -> dict:
    """One run of the command (seconds, peak RSS in MB), SIGKILLed once ``kill_at_shards`` shards are published."""
    args = [sys.executable, "-m", "parallel_latent", "encode-corpus", "--checkpoint", str(checkpoint), "--data",
            str(corpus), "--out", str(out), *SETTINGS, f"data.cache_dir={cache}",
            f"export.shard_size={shard_size}"]  # fmt: skip
    killed = []

    def kill_when_published(process) -> bool:
        if kill_at_shards is not None and out.is_dir() and len(list(out.glob("data-*.arrow"))) >= kill_at_shards:
            process.send_signal(signal.SIGKILL)
            killed.append(True)
        return bool(killed)

    started = time.perf_counter()
    peak, status, output = watched_run(args, child_environment(os.cpu_count() or 1, TOKENIZERS_PARALLELISM="false"),
                                       kill_when_published)  # fmt: skip
    elapsed = time.perf_counter() - started
    if not killed and status != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {output[-2000:]}")
    return {"seconds": elapsed, "rss": peak}


def body(args, report: Report) -> None:
    if args.quick:
        args.lines, args.repeats, args.shard_size = 1_000, 1, 128
    with tempfile.TemporaryDirectory(prefix="bench-export-") as scratch:
        work, cache = Path(scratch), Path(scratch) / "cache"
        print(f"work directory {work}; {os.cpu_count()} CPUs; device {args.device}", flush=True)
        checkpoint, large = make_checkpoint(work / "checkpoint", Path(args.config)), work / f"corpus-{args.lines}.txt"
        write_corpus(large, args.lines)
        large_samples = len(prepare(checkpoint, large, cache, args.shard_size))

        print(f"\n1. throughput, {args.lines:,} lines, export.batch_size=64:", flush=True)
        speed = bench_throughput(checkpoint, large, cache, work, args)
        print(f"bare encode loop {speed['bare_per_s']:,.0f} samples/s; export {speed['export_per_s']:,.0f} "
              f"samples/s ({speed['samples']:,} samples)", flush=True)  # fmt: skip
        report.figure("export / bare encode loop, samples per second", speed["ratio"], "x", at_least=0.9)
        report.figure("export samples/s", speed["export_per_s"], "samples/s")
        report.figure("bare encode samples/s", speed["bare_per_s"], "samples/s")
        if args.throughput_only:
            return
        # The baseline: the bundled corpus; in --quick a quarter of --lines (not encoding the whole bundled one).
        base, base_name, base_label = BUNDLED, "bundled corpus", "bundled (4,874)"
        if args.quick:
            base_lines = max(1, args.lines // 4)
            base, base_name = work / f"corpus-{base_lines}.txt", f"{base_lines:,} lines"
            base_label = base_name
            write_corpus(base, base_lines)
        prepare(checkpoint, base, cache, args.shard_size)

        print("\n2. peak RSS of encode-corpus, one process:", flush=True)
        runs = {}
        for name, corpus in ((base_label, base), (f"{args.lines:,} lines", large)):
            out = work / "rss"
            shutil.rmtree(out, ignore_errors=True)
            runs[name] = run_export(checkpoint, corpus, cache, out, args.shard_size)
            print(f"  {name:>16}: {runs[name]['rss']:.0f} MB, {runs[name]['seconds']:.1f} s", flush=True)
        bundled, larger = runs[base_label], runs[f"{args.lines:,} lines"]
        growth = larger["rss"] - bundled["rss"]
        report.figure(f"peak RSS, {args.lines:,} lines - {base_name}", growth, "MB", at_most=100)

        print(f"\n3. resume after SIGKILL at half of the shards, {args.lines:,} lines:", flush=True)
        shards, out, uninterrupted = -(-large_samples // args.shard_size), work / "resume", larger
        shutil.rmtree(out, ignore_errors=True)
        # One process publishes the shards in order: after `half` of them, half of the samples are done.
        half = -(-large_samples // (2 * args.shard_size))
        killed = run_export(checkpoint, large, cache, out, args.shard_size, kill_at_shards=max(1, half))
        published = len(list(out.glob("data-*.arrow")))
        rerun = run_export(checkpoint, large, cache, out, args.shard_size)
        complete = run_export(checkpoint, large, cache, out, args.shard_size)
        print(f"  uninterrupted {uninterrupted['seconds']:.1f} s; killed after {killed['seconds']:.1f} s with "
              f"{published} of {shards} shards published; rerun {rerun['seconds']:.1f} s; a rerun of the complete "
              f"export {complete['seconds']:.1f} s", flush=True)  # fmt: skip
        ratio = rerun["seconds"] / uninterrupted["seconds"]
        report.figure("rerun after a kill at 50% / uninterrupted run, time", ratio, "x", at_most=0.6)
        fixed = complete["seconds"]
        net = (rerun["seconds"] - fixed) / (uninterrupted["seconds"] - fixed)
        report.figure("the same, less the fixed cost of a run", net, "x")
        report.figure("uninterrupted encode-corpus run", uninterrupted["seconds"], "s")
        report.figure("a rerun that finds the export complete (start-up, checks, exit)", fixed, "s")


def arguments(parser) -> None:
    parser.add_argument("--lines", type=int, default=200_000, help="lines of the large corpus")
    parser.add_argument("--repeats", type=int, default=3, help="alternated rounds of the throughput part")
    parser.add_argument("--shard-size", type=int, default=8192, help="export.shard_size (the resume's granularity)")
    parser.add_argument("--throughput-only", action="store_true", help="part 1 alone (benchmarks/gpu.sh's row)")
    parser.add_argument("--device", default="cpu", help="where the model encodes (part 1): cpu or cuda")
    parser.add_argument("--config", default=str(TINY), help="the model's config (default configs/tiny.yaml)")


main = command("bench_export", __doc__, body, arguments, __name__)
