"""The frozen feature model at realistic sizes (benchmarks/published_decoders.py's MODELS, built on the
meta device): bytes and the frozen pass's projected H200 time per rank, replicated (each TP rank runs
1/tp of the micro-batch through the whole decoder) against sharded (the whole micro-batch through 1/tp
of each layer), at TP 1, 2, 4 and 8; a degree that ``shard`` refuses is shown as refused.

Usage: python -m benchmarks.bench_feature_models [--quick] [--batch 32] [--length 64] [--json PATH]
"""

from __future__ import annotations

from benchmarks.harness import Report, command
from benchmarks.published_decoders import MODELS, QUICK_MODELS, TP_DEGREES, frozen_rows, frozen_seconds, held_on_meta


def body(args, report: Report) -> None:
    names, shape = QUICK_MODELS if args.quick else tuple(MODELS), (args.batch, args.length)
    print(f"frozen feature model (hidden state -3), bf16, micro-batch {args.batch} x {args.length} tokens per step")
    header = " ".join(f"{'TP' + str(tp):>17}" for tp in TP_DEGREES)
    print(f"{'model':>16} {'layout':>9} {header}   (GiB per rank / ms per rank)")
    for name in names:
        held, cells, gib = held_on_meta(name), {}, {}  # gib: (layout, TP) -> GiB per rank, None where refused
        for layout, tp, refusal, size, ms in frozen_rows(held, *shape):
            gib[layout, tp] = size
            cells.setdefault(layout, []).append(f"{'refused':>17}" if refusal else f"{size:>8.2f} / {ms:>6.2f}")
        for layout, row in cells.items():
            print(f"{name:>16} {layout:>9} " + " ".join(row))
        tp = max(t for t in TP_DEGREES if gib["shard", t] is not None)
        report.figure(f"{name}: frozen GiB per rank, replicate", gib["replicate", 1], "GiB")
        if tp == 1:  # not sharded at all
            continue
        report.figure(f"{name}: frozen GiB per rank, shard at TP={tp}", gib["shard", tp], "GiB")
        ratio = gib["shard", tp] / gib["replicate", tp]
        report.figure(f"{name}: frozen bytes per rank, shard / replicate at TP={tp}", ratio, "x")
        shard, replicate = (frozen_seconds(held, tp, layout, *shape) for layout in ("shard", "replicate"))
        report.figure(f"{name}: frozen pass time per rank, shard / replicate at TP={tp}", shard / replicate, "x")


def arguments(parser) -> None:
    parser.add_argument("--batch", type=int, default=32, help="samples per micro-batch")
    parser.add_argument("--length", type=int, default=64, help="tokens per sample")


main = command("bench_feature_models", __doc__, body, arguments, __name__)
