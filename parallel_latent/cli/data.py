"""``parallel-latent prepare``: tokenise a corpus into the cache ahead of training; ``parallel-latent
feature-cache build|show|remove``: the frozen decoder's features of that corpus, computed once.

    parallel-latent prepare --config configs/gpt2.yaml data.path=/data/corpus.jsonl
    parallel-latent feature-cache build --config configs/smollm2.yaml

``prepare`` prepares exactly what ``parallel-latent train`` with the same config and overrides would
read (same fingerprint), prints where the copy is, how many samples it holds, how many were truncated
and its fingerprint; a second run finds the copy and does nothing. ``feature-cache`` names the cache
the same training would read (same key), builds it in this one process (training builds it over all
its ranks), says where it is and whether it is complete, or removes it.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_subcommands", "cmd_feature_cache", "cmd_prepare"]


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


def cmd_feature_cache(args: argparse.Namespace) -> int:
    import torch

    from parallel_latent.config import load_config
    from parallel_latent.data import build_datasets
    from parallel_latent.feature_model import cache
    from parallel_latent.feature_model.tokenizer import apply_tokenizer_facts, load_tokenizer, tokenizer_facts
    from parallel_latent.model import build_model

    # One process: the decoder whole, whatever layout training uses (the key does not depend on it).
    layout = ["parallel.tensor_parallel=1", "feature_model.parallel=replicate"]
    cfg = load_config(args.config, [*args.overrides, *layout])
    tokenizer = load_tokenizer(cfg.tokenizer)
    cfg = apply_tokenizer_facts(cfg, tokenizer_facts(tokenizer))
    train_set, eval_set = build_datasets(cfg, tokenizer)
    feature_model = build_model(cfg).feature_model
    # DeepSpeed runs the decoder in the training precision: its features, its cache.
    feature_model.to({"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.training.precision, torch.float32))
    rows = len(train_set) + len(eval_set)
    spec = cache.job_spec(cfg, feature_model, train_set.data, rows)
    if args.action == "build":
        cache.job_cache(cfg, feature_model, train_set.data, rows)
    elif args.action == "remove":
        size = sum(p.stat().st_size for p in spec.directory.glob("*") if p.is_file()) if spec.directory.is_dir() else 0
        gone = cache.removed(spec.directory)
        print(
            f"removed {spec.directory} ({size / 2**20:,.1f} MiB)" if gone else f"{spec.directory}: no cache to remove"
        )
        return 0
    print(cache.status(spec), flush=True)
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
    feature_cache = sub.add_parser(
        "feature-cache",
        help="build, show or remove the frozen decoder's feature cache of a config's corpus",
        description="The feature cache that train reads with the same config and overrides (feature_model.cache).",
    )
    actions = feature_cache.add_subparsers(dest="action", metavar="ACTION", required=True)
    for action, words in (
        ("build", "compute the features of every sample once, in this process"),
        ("show", "say where the cache is and whether it is complete"),
        ("remove", "delete the cache"),
    ):
        parser = actions.add_parser(action, help=words, description=f"{words[0].upper()}{words[1:]}.")
        parser.add_argument("--config", required=True, help="YAML config file (see configs/)")
        parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
        parser.set_defaults(handler=cmd_feature_cache)
