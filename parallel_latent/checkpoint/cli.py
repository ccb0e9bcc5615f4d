"""Checkpoint subcommands of ``parallel-latent``: export, consolidate, inspect, reshard.

All run in one process without a process group or DeepSpeed engine. A damaged or unsuitable
checkpoint raises :class:`CheckpointError` (a ``ValueError``), which the main CLI prints as one
line with exit status 2.
"""

from __future__ import annotations

import argparse

from .describe import inspect_checkpoint
from .layout import resolve_checkpoint
from .portable import consolidate
from .universal import convert_to_universal, export_portable


def cmd_export(args: argparse.Namespace) -> int:
    out = export_portable(args.checkpoint, args.out)
    print(f"portable checkpoint written to {out}")
    return 0


def cmd_consolidate(args: argparse.Namespace) -> int:
    out = consolidate(args.checkpoint, args.out)
    print(f"consolidated checkpoint written to {out} (model.safetensors, config.json, manifest.json)")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    print(inspect_checkpoint(args.checkpoint, max_rows=None if args.all else 40))
    return 0


def cmd_reshard(args: argparse.Namespace) -> int:
    out = convert_to_universal(resolve_checkpoint(args.checkpoint), args.out)
    print(f"universal optimizer state written to {out}")
    if args.out is None:
        print("resume at any TP x DP x ZeRO layout: checkpoint.resume=<this checkpoint> (it is used automatically)")
    return 0


def add_subcommands(subparsers) -> None:
    """Called by ``parallel_latent.cli.build_parser`` with its subparsers."""
    export = subparsers.add_parser(
        "export",
        help="write the portable safetensors shards of a checkpoint",
        description="Write a portable checkpoint (one safetensors file per TP rank + manifest.json) from a "
        "training checkpoint, a checkpoints directory (its latest) or a run's checkpoint.",
    )
    export.add_argument("checkpoint", help="training checkpoint, checkpoints directory, or portable directory")
    export.add_argument("out", help="output directory (must not exist)")
    export.set_defaults(handler=cmd_export)

    consolidate = subparsers.add_parser(
        "consolidate",
        help="gather a checkpoint into one safetensors file",
        description="Gather all TP shards into OUT/model.safetensors (full, unpadded tensors) with "
        "OUT/config.json; loads in a single process.",
    )
    consolidate.add_argument("checkpoint", help="portable directory, or a training checkpoint with model/")
    consolidate.add_argument("out", help="output directory (must not exist or be empty)")
    consolidate.set_defaults(handler=cmd_consolidate)

    inspect = subparsers.add_parser(
        "inspect",
        help="print what a checkpoint holds",
        description="Step, config, TP/DP/ZeRO layout, files, tensor table and sizes of a portable or "
        "training checkpoint.",
    )
    inspect.add_argument("checkpoint", help="portable directory, training checkpoint or checkpoints directory")
    inspect.add_argument("--all", action="store_true", help="list every tensor (default: the first 40)")
    inspect.set_defaults(handler=cmd_inspect)

    reshard = subparsers.add_parser(
        "reshard",
        help="add a layout-free optimizer state to a training checkpoint",
        description="Convert DeepSpeed's ZeRO shards (any stage, any TP x DP) into the universal state "
        "(fp32 weights + Adam moments per parameter, safetensors) that resuming at another "
        "TP x DP x ZeRO layout reads. Resuming does this by itself when needed.",
    )
    reshard.add_argument("checkpoint", help="training checkpoint or checkpoints directory")
    reshard.add_argument("--out", default=None, help="output directory (default: CHECKPOINT/universal)")
    reshard.set_defaults(handler=cmd_reshard)
