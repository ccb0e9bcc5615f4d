"""``parallel-latent config --list``: every config key, its default and what it means (the training
config's, then the ``export.*`` settings of ``encode-corpus``)."""

from __future__ import annotations

import argparse
import json

from parallel_latent.errors import ExitStatus, UsageError


def cmd_config(args: argparse.Namespace) -> int:
    from parallel_latent.config import EXPORT_SECTION, Config, ExportConfig, schema_keys

    if not args.list:
        raise UsageError("config: give --list (every key with its default and meaning)")
    rows = [
        (key, json.dumps(default), doc + (f" ({bound.must})" if bound else ""))
        for key, default, doc, bound in schema_keys(Config) + schema_keys(ExportConfig, EXPORT_SECTION)
    ]
    key_width, default_width = (max(len(row[column]) for row in rows) for column in (0, 1))
    for key, default, meaning in rows:
        print(f"{key:<{key_width}}  {default:<{default_width}}  {meaning}")
    return ExitStatus.OK


def add_subcommands(sub) -> None:
    config = sub.add_parser(
        "config",
        help="list every config key with its default and meaning",
        description="Print every key of the YAML config (section.key), its default and what it means; "
        "any of them can be overridden on the command line as section.key=value.",
    )
    config.add_argument("--list", action="store_true", help="list every key (the only action)")
    config.set_defaults(handler=cmd_config)
