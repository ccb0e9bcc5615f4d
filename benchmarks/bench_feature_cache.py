"""The feature cache (``feature_model.cache``): configs/smollm2.yaml's training step reading a warm cache
against the same step running the frozen decoder, interleaved in one trainer (goal >= 1.8x), with the
cache's build time beside it; and the private memory of a process that reads every row of a cache of
the bundled corpus and of one 10x its size (goal: the 10x cache adds <= 20 MB).

    python -m benchmarks.bench_feature_cache [--part speed|memory] [--quick] [overrides...]
"""

from __future__ import annotations

import contextlib
import io
import re
import tempfile
from pathlib import Path

import numpy as np

from benchmarks import harness
from benchmarks.bench_data import write_corpus
from benchmarks.harness import BUNDLED, QUIET_RUN, TINY, Report, add_repeat_arguments, command, interleaved
from parallel_latent.config import load_config

SMOLLM2 = TINY.with_name("smollm2.yaml")
WIDE = ["feature_model.n_embd=576", "feature_model.n_head=6", "feature_model.n_layer=3", "model.d_model=576",
        "model.n_heads=6", "model.n_encoder_layers=1", "model.n_decoder_layers=1"]  # fmt: skip


def private_bytes() -> int:
    """This process's anonymous resident memory (RssAnon): what a memory map's pages never count in."""
    return next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("RssAnon:"))  # fmt: skip


def bench_speed(args, report: Report, work: Path) -> None:
    base = TINY if args.quick else SMOLLM2
    overrides = ["parallel.tensor_parallel=1", "feature_model.cache=on", f"feature_model.cache_dir={work}/cache",
                 f"logging.run_dir={work}/run", *QUIET_RUN, *args.overrides]  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), harness.started_trainer(load_config(base, overrides)) as trainer:
        built = re.search(r"feature cache built in ([\d.]+) s: ([\d,]+) samples, ([\d,.]+) MiB", printed.getvalue())
        cached = trainer.train_set
        sets = {"decoder": cached.with_features(None), "cache": cached}

        def step(name: str) -> None:
            if trainer.train_set is not sets[name]:
                trainer._stop_prefetcher()  # the next step reads from this set
                trainer.train_set = sets[name]
            trainer.train_step()

        samples = interleaved({name: lambda n=name: step(n) for name in sets}, args.repeats, warmup=1,
                              ratios=[("decoder", "cache")], most=args.most_repeats)  # fmt: skip
    report.ratio("step time, frozen decoder run / feature cache read", samples, "decoder", "cache", at_least=1.8)
    report.figure("build of the cache, every sample once", float(built.group(1)), "s")
    report.figure("size of the cache", float(built.group(3).replace(",", "")), "MiB")


def read_everything(lines: int, work: Path, shape: list[str]) -> tuple[int, int]:
    """(rows, private bytes added) reading every training row of the cache of a ``lines``-line corpus
    in batches of 16, in the training order's random rows."""
    from parallel_latent.data import build_datasets
    from parallel_latent.feature_model.cache import job_cache
    from parallel_latent.feature_model.tokenizer import apply_tokenizer_facts, load_tokenizer, tokenizer_facts
    from parallel_latent.model import build_model

    corpus = work / f"corpus-{lines}.txt"
    write_corpus(corpus, lines)
    cfg = load_config(TINY, [*shape, f"data.path={corpus}", f"data.cache_dir={work}/data", "feature_model.cache=on"])
    cfg = apply_tokenizer_facts(cfg, tokenizer_facts(tokenizer := load_tokenizer(cfg.tokenizer)))
    train, held = build_datasets(cfg, tokenizer, announce=False)
    cache = job_cache(cfg, build_model(cfg).feature_model, train.data, len(train) + len(held), announce=False)
    train = train.with_features(cache)
    order = np.random.default_rng(0).permutation(len(train))
    before = private_bytes()
    for start in range(0, len(order), 16):
        train.batch(order[start : start + 16])
    return len(train), private_bytes() - before


def bench_memory(args, report: Report, work: Path) -> None:
    lines = 600 if args.quick else len(BUNDLED.read_text(encoding="utf-8").splitlines())
    shape = [] if args.quick else WIDE  # quick: tiny.yaml's 64-wide decoder
    small_rows, small = read_everything(lines, work, shape)
    large_rows, large = read_everything(10 * lines, work, shape)
    print(f"  read {small_rows:,} rows: +{small / 2**20:.1f} MB private; {large_rows:,} rows: +{large / 2**20:.1f} MB")
    report.figure("private memory added by the 10x corpus's cache", (large - small) / 2**20, "MB", at_most=20)


def body(args, report: Report) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-feature-cache-") as work:
        for part in ("speed", "memory") if args.part == "all" else (args.part,):
            (bench_speed if part == "speed" else bench_memory)(args, report, Path(work))


def arguments(parser) -> None:
    parser.add_argument("--part", choices=("all", "speed", "memory"), default="all")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="overrides of the speed part")
    add_repeat_arguments(parser, repeats=4, most=12)


main = command("bench_feature_cache", __doc__, body, arguments, __name__)
