"""The compression frontier: each point of configs/compressed.yaml's curve over seeds, trained as
bench_quality does: held-out BLEU, exact match, BLEU under noise, length accuracy, and out-of-domain BLEU
(within 5 points of the held-out one), beside LD4LG's points; with --json PATH also PATH's .png plot.

    python -m benchmarks.bench_frontier [--points 16 8] [--seeds 1 2 1234] [--quick]
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.bench_quality import QUICK, out_of_domain, train_once
from benchmarks.harness import Report, command

CONFIG = "configs/compressed.yaml"
# The out-of-domain corpus keeps its share of the held-out BLEU within this many points.
OUT_OF_DOMAIN_GAP = 5.0
WALL_S = 900.0  # every run within 15 minutes on 2 cores
LD4LG = {32: 97.6, 16: 92.4}

# Training with noise costs the narrower points their clean BLEU (at k = 16, step 250: BLEU 45 with
# latent_noise 0.5 against 77 without), and only the 32 x 32 point has a noise goal.
CLEAN = ["model.latent_noise=0"]


@dataclass
class Point:
    """One point of the curve: configs/compressed.yaml with ``overrides``; goals on the worst seed."""

    name: str  # N x k
    floats_per_token: int
    overrides: list[str]
    goals: dict[str, float] = field(default_factory=dict)


POINTS = [Point("32 x 32", 32, [], {"bleu": 99.5, "bleu_noise_0.5": 90.0}),
          Point("16 x 64", 32, ["model.num_latents=16", "model.latent_dim=64", *CLEAN], {"bleu": 97.6}),
          Point("32 x 16", 16, ["model.latent_dim=16", *CLEAN], {"bleu": 95.0}),
          Point("32 x 8", 8, ["model.latent_dim=8", *CLEAN], {"bleu": 90.0})]  # fmt: skip
# The quick run's model (bench_quality's, 8 tokens of width 32): fewer and narrower latents.
QUICK_POINTS = [Point("4 x 16", 8, ["model.num_latents=4", "model.latent_dim=16"])]
COLUMNS = ("bleu", "exact_match", "bleu_noise_0.1", "bleu_noise_0.3", "bleu_noise_0.5", "length_accuracy")


def measure(point: Point, seed: int, args, scratch: Path) -> dict:
    """One seed of ``point`` trained, then its final checkpoint's BLEU on the out-of-domain corpus."""
    overrides = [*(QUICK if args.quick else []), *point.overrides, "checkpoint.export_portable=true"]
    nproc = 1 if args.quick else args.nproc
    row = train_once(CONFIG, seed, nproc, overrides, scratch / point.name.replace(" ", ""))
    row = {"seed": seed, "wall_s": row["wall_s"], "bleu": row["bleu"], "exact_match": row["exact_match"],
           **{k: v for k, v in row["latent"].items() if k in COLUMNS}}  # fmt: skip
    row["out_of_domain_bleu"] = out_of_domain(scratch / point.name.replace(" ", "") / f"seed{seed}")["bleu"]
    row["gap"] = row["bleu"] - row["out_of_domain_bleu"]
    return row


def spread(rows: list[dict], key: str) -> tuple[float, float, float]:
    values = [r[key] for r in rows]
    return min(values), statistics.median(values), max(values)


def plot(results: list[tuple[Point, list[dict]]], path: Path) -> None:
    """BLEU by floats per token: each point's median and min-max, held-out and out of domain; LD4LG's points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    for key, label, marker in (("bleu", "held-out", "o"), ("out_of_domain_bleu", "out of domain", "s")):
        xs = [point.floats_per_token * (0.97 if key == "bleu" else 1.03) for point, _ in results]
        spreads = [spread(rows, key) for _, rows in results]
        mids = [mid for _, mid, _ in spreads]
        errors = [[mid - low for low, mid, _ in spreads], [high - mid for _, mid, high in spreads]]  # below, above
        axis.errorbar(xs, mids, yerr=errors, fmt=marker, capsize=3, label=f"parallel-latent, {label}")
        for x, y, (point, _) in zip(xs, mids, results, strict=True):
            if key == "bleu":
                axis.annotate(point.name, (x, y), textcoords="offset points", xytext=(-34, -12), fontsize=7)
    axis.plot(list(LD4LG), list(LD4LG.values()), "k^", label="LD4LG (BART-base, ROCStories)")
    axis.set(xlabel="floats per token (N x k / T)", ylabel="BLEU",
             title="Reconstruction against compression (min-max over seeds)")  # fmt: skip
    axis.set_xscale("log", base=2)
    axis.legend(fontsize=8, loc="lower right")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def body(args, report: Report) -> None:
    points = QUICK_POINTS if args.quick else POINTS
    if args.points:
        points = [p for p in points if p.name.replace(" ", "") in args.points or str(p.floats_per_token) in args.points]
    seeds = args.seeds[:1] if args.quick else args.seeds
    results = []
    with tempfile.TemporaryDirectory(prefix="parallel-latent-frontier.") as scratch:
        for point in points:
            results.append((point, rows := []))
            for seed in seeds:
                rows.append(row := measure(point, seed, args, Path(scratch)))
                noise = row.get("bleu_noise_0.5", float("nan"))
                print(f"{point.name} seed {seed}: BLEU {row['bleu']:.2f}, noise 0.5 {noise:.2f}, out of domain "
                      f"{row['out_of_domain_bleu']:.2f}, {row['wall_s']:.0f} s", flush=True)  # fmt: skip
    keys = [*COLUMNS, "out_of_domain_bleu", "wall_s"]
    print("\nmin / median / max over the seeds")
    print(f"{'floats/token':>12} {'N x k':>8} " + " ".join(f"{k:>22}" for k in keys) + f" {'LD4LG':>6}")
    for point, rows in results:
        cells = []
        for key in keys:
            digits, measured = ".3f" if key == "exact_match" else ".1f", all(key in r for r in rows)
            cells.append(" /".join(f"{v:>6{digits}}" for v in spread(rows, key)) if measured else f"{'-':>22}")
        anchor = LD4LG.get(point.floats_per_token) if point.name.startswith("32 ") else None
        print(f"{point.floats_per_token:>12} {point.name:>8} " + " ".join(f"{c:>22}" for c in cells)
              + f" {anchor if anchor is not None else '-':>6}")  # fmt: skip
    gap, wall = (None, None) if args.quick else (OUT_OF_DOMAIN_GAP, WALL_S)
    for point, rows in results:
        label = f"{point.name} ({point.floats_per_token} floats per token)"
        for key in (*COLUMNS, "out_of_domain_bleu"):
            if all(key in r for r in rows):
                low, mid, _ = spread(rows, key)
                goal = None if args.quick else point.goals.get(key)
                report.figure(f"{label} worst seed {key.replace('_', ' ')}", low, at_least=goal)
                report.figure(f"{label} median {key.replace('_', ' ')}", mid)
        report.figure(f"{label} held-out - out-of-domain BLEU, worst seed", spread(rows, "gap")[2], at_most=gap)
        report.figure(f"{label} slowest seed wall time", spread(rows, "wall_s")[2], "s", at_most=wall)
    if args.json:
        plot(results, Path(args.json).with_suffix(".png"))


def arguments(parser) -> None:
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 1234])
    parser.add_argument("--points", nargs="+", help="points to run: N x k without spaces (32x16) or floats per token")
    parser.add_argument("--nproc", type=int, default=2)


main = command("bench_frontier", __doc__, body, arguments, __name__)
