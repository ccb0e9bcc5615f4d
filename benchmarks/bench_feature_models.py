"""The frozen feature model at realistic sizes, on the meta device: bytes per rank and the frozen
pass's projected time on one H200 per rank, replicated (``feature_model.parallel: replicate``, each TP
rank runs 1/tp of the micro-batch through the whole held decoder, one all-gather of the features)
against sharded (``shard``: each rank runs the whole micro-batch through 1/tp of each held layer's
attention and MLP, two all-reduces per layer), at TP 1, 2, 4 and 8.

Nothing is downloaded: each decoder is built from its published ``config.json`` figures
(benchmarks/performance.py's MODELS, whose roofline times the pass with the pinned constants). A TP
degree that ``shard`` refuses (one that does not divide the heads, the kv heads or the MLP width:
model/sharded.py's own check) is shown as refused.

Usage: python -m benchmarks.bench_feature_models [--quick] [--batch 32] [--length 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.harness import Report, add_common_arguments, run
from benchmarks.performance import (
    MODELS,
    QUICK_MODELS,
    TP_DEGREES,
    frozen_bytes,
    frozen_seconds,
    held_on_meta,
    shard_refusal,
)


def body(args, report: Report) -> None:
    names = QUICK_MODELS if args.quick else tuple(MODELS)
    print(f"frozen feature model (hidden state -3), bf16, micro-batch {args.batch} x {args.length} tokens per step")
    header = " ".join(f"{'TP' + str(tp):>17}" for tp in TP_DEGREES)
    print(f"{'model':>16} {'layout':>9} {header}   (GiB per rank / ms per rank)")
    for name in names:
        held = held_on_meta(name)
        for layout in ("replicate", "shard"):
            cells = []
            for tp in TP_DEGREES:
                if layout == "shard" and shard_refusal(held, tp):
                    cells.append(f"{'refused':>17}")
                    continue
                gib = frozen_bytes(held, tp, layout) / 2**30
                ms = frozen_seconds(held, tp, layout, args.batch, args.length) * 1e3
                cells.append(f"{gib:>8.2f} / {ms:>6.2f}")
            print(f"{name:>16} {layout:>9} " + " ".join(cells))
        tp = max(t for t in TP_DEGREES if not shard_refusal(held, t))
        report.figure(f"{name}: frozen GiB per rank, replicate", frozen_bytes(held, 1, "replicate") / 2**30, "GiB")
        if tp == 1:  # not sharded at all
            continue
        report.figure(f"{name}: frozen GiB per rank, shard at TP={tp}", frozen_bytes(held, tp, "shard") / 2**30, "GiB")
        ratio = frozen_bytes(held, tp, "shard") / frozen_bytes(held, tp, "replicate")
        report.figure(f"{name}: frozen bytes per rank, shard / replicate at TP={tp}", ratio, "x")
        slower = frozen_seconds(held, tp, "shard", args.batch, args.length) / frozen_seconds(
            held, tp, "replicate", args.batch, args.length
        )
        report.figure(f"{name}: frozen pass time per rank, shard / replicate at TP={tp}", slower, "x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32, help="samples per micro-batch")
    parser.add_argument("--length", type=int, default=64, help="tokens per sample")
    add_common_arguments(parser)
    return run("bench_feature_models", parser, body)


if __name__ == "__main__":
    sys.exit(main())
