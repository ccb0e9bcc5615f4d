"""``parallel-latent prepare``: tokenise a corpus into the cache ahead of training.

    parallel-latent prepare --config configs/gpt2.yaml data.path=/data/corpus.jsonl

It prepares exactly what ``parallel-latent train`` with the same config and overrides would read
(same fingerprint), prints where the copy is, how many samples it holds, how many were truncated
and its fingerprint; a second run finds the copy and does nothing.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_subcommands", "cmd_prepare"]


def cmd_prepare(args: argparse.Namespace) -> int:
    from parallel_latent.config import load_config
    from parallel_latent.data.prepare import describe, make_spec, prepare
    from parallel_latent.data.sampler import held_out_size
    from parallel_latent.errors import DataError
    from parallel_latent.feature_model.tokenizer import apply_tokenizer_facts, load_tokenizer, tokenizer_facts

    cfg = load_config(args.config, args.overrides)
    tokenizer = load_tokenizer(cfg.tokenizer)
    cfg = apply_tokenizer_facts(cfg, tokenizer_facts(tokenizer))
    spec = make_spec(cfg, tokenizer)
    interactive = sys.stdout.isatty()
    if interactive and spec.source.kind != "prepared":
        print(f"preparing {spec.source.location} into {spec.target} ...", flush=True)
    data, created = prepare(spec, progress=interactive)
    took = f" in {data.meta.get('seconds', 0):.1f} s" if created else ""
    print(f"{'prepared' if created else 'up to date'}{took}: {describe(data)}", flush=True)
    count = min(len(data), cfg.data.max_samples) if cfg.data.max_samples else len(data)
    try:
        held_out = held_out_size(count, cfg.data.eval_fraction, cfg.data.min_eval_samples, str(data.path))
        print(f"training would use {count - held_out:,} samples and hold out {held_out:,}", flush=True)
    except DataError as error:  # the copy is fine; training with these settings would not be
        print(f"warning: {error}", file=sys.stderr, flush=True)
    return 0


def add_subcommands(sub) -> None:
    prepare = sub.add_parser(
        "prepare",
        help="tokenize a corpus once into the memory-mapped cache that training reads",
        description="Prepare the corpus of a config (data.*, model.max_length, tokenizer) in the data cache "
        "(data.cache_dir, else $PARALLEL_LATENT_DATA_CACHE, else ~/.cache/parallel-latent/data); "
        "key=value arguments override the config as for train.",
    )
    prepare.add_argument("--config", required=True, help="YAML config file (see configs/)")
    prepare.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    prepare.set_defaults(handler=cmd_prepare)
