"""Checkpoint subcommands of ``parallel-latent``: export, consolidate, inspect, reshard.

All run in one process without a process group or DeepSpeed engine. A damaged or unsuitable
checkpoint raises :class:`CheckpointError` (bad input: one line, exit status 2); an output that
cannot be written, :class:`CheckpointSaveError` (status 4).
"""

import argparse
from pathlib import Path


def _read_whole(path: str) -> Path:
    """``path`` as given, a training checkpoint it names checked whole first (every file against its
    record and its schema: :func:`~parallel_latent.checkpoint.require_intact`), as a resume checks
    it: a damaged one is one line naming the file before anything is read or written."""
    from parallel_latent.checkpoint import require_intact, resolve_checkpoint
    from parallel_latent.checkpoint.layout import MANIFEST_NAME

    if not (Path(path) / MANIFEST_NAME).is_file():  # a portable directory checks itself as it is read
        require_intact(resolve_checkpoint(path))
    return Path(path)


def cmd_export(args: argparse.Namespace) -> int:
    from parallel_latent.checkpoint.universal import export_portable

    _read_whole(args.checkpoint)
    print(f"portable checkpoint written to {export_portable(args.checkpoint, args.out)}")
    return 0


def cmd_consolidate(args: argparse.Namespace) -> int:
    from parallel_latent.checkpoint import consolidate

    out = consolidate(_read_whole(args.checkpoint), args.out)
    print(f"consolidated checkpoint written to {out} (model.safetensors, config.json, manifest.json)")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from parallel_latent.checkpoint.describe import inspect_checkpoint

    print(inspect_checkpoint(_read_whole(args.checkpoint), max_rows=None if args.all else 40))
    return 0


def cmd_reshard(args: argparse.Namespace) -> int:
    from parallel_latent.zero.version import prefer_cpu_accelerator

    prefer_cpu_accelerator()  # (DeepSpeed's guess would be a warning on stdout)
    from parallel_latent.checkpoint import convert_to_universal, resolve_checkpoint

    out = convert_to_universal(resolve_checkpoint(_read_whole(args.checkpoint)), args.out)
    print(f"universal optimizer state written to {out}")
    if args.out is None:
        print("resume at any TP x DP x ZeRO layout: checkpoint.resume=<this checkpoint> (it is used automatically)")
    return 0


def add_subcommands(subparsers) -> None:
    """Called by :func:`parallel_latent.cli.build_parser` with its subparsers."""

    def command(name: str, handler, help: str, description: str, checkpoint: str):
        parser = subparsers.add_parser(name, help=help, description=description)
        parser.add_argument("checkpoint", help=checkpoint)
        parser.set_defaults(handler=handler)
        return parser

    command(
        "export",
        cmd_export,
        "write the portable safetensors shards of a checkpoint",
        "Write a portable checkpoint (one safetensors file per TP rank + manifest.json) from a "
        "training checkpoint, a checkpoints directory (its latest) or a run's checkpoint.",
        "training checkpoint, checkpoints directory, or portable directory",
    ).add_argument("out", help="output directory (must not exist)")
    command(
        "consolidate",
        cmd_consolidate,
        "gather a checkpoint into one safetensors file",
        "Gather all TP shards into OUT/model.safetensors (full, unpadded tensors) with "
        "OUT/config.json; loads in a single process.",
        "portable directory, or a training checkpoint with model/",
    ).add_argument("out", help="output directory (must not exist or be empty)")
    command(
        "inspect",
        cmd_inspect,
        "print what a checkpoint holds",
        "Step, config, TP/DP/ZeRO layout, files, tensor table and sizes of a portable or training checkpoint.",
        "portable directory, training checkpoint or checkpoints directory",
    ).add_argument("--all", action="store_true", help="list every tensor (default: the first 40)")
    command(
        "reshard",
        cmd_reshard,
        "add a layout-free optimizer state to a training checkpoint",
        "Convert DeepSpeed's ZeRO shards (any stage, any TP x DP) into the universal state (fp32 weights "
        "+ Adam moments per parameter, safetensors) that resuming at another TP x DP x ZeRO layout "
        "reads. Resuming does this by itself when needed.",
        "training checkpoint or checkpoints directory",
    ).add_argument("--out", default=None, help="output directory (default: CHECKPOINT/universal)")
