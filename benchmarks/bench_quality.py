"""Reconstruction quality over seeds: is a config's held-out quality a property of the config, or
of one lucky seed?

For each seed, one real training run, ``parallel-latent train --config CONFIG --nproc 2
training.seed=S``, in a fresh temporary run directory (one after another, never two at once). Its
final held-out evaluation gives the figures: token accuracy, exact match, BLEU, plus the wall time
of the whole command (start-up included). Prints one row per seed, then min / median / max, then
the config's goals and whether every seed met them. Runs keep the config as it is except what the
figures do not need: no progress bar, no TensorBoard, no intermediate checkpoint and no portable
export (the trainer still writes its final checkpoint).

    python benchmarks/bench_quality.py                                  # configs/tiny.yaml, 6 seeds
    python benchmarks/bench_quality.py --config configs/small.yaml --seeds 1,2,3
    python benchmarks/bench_quality.py --json docs/benchmarks/quality_tiny.json
    python benchmarks/bench_quality.py model.head=normal                # any config override
    python benchmarks/bench_quality.py --quick                          # a tiny shape, a few steps

Exit status: 0 when every run produced its figures (whether or not the goals were met: the JSON
and the last lines say which), 1 when a run failed or reported no evaluation, 2 for bad arguments.
Wall times depend on what else the machine runs: the load averages before and after are printed
and recorded.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import operator
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_CONFIG = "configs/tiny.yaml"
DEFAULT_SEEDS = [1, 2, 3, 4, 5, 1234]
QUICK_SEEDS = [1, 2]

# What a config promises (README), per seed. Keyed by the config file's name.
GOALS = {
    "tiny.yaml": ["token_accuracy>=0.98", "exact_match>=0.75", "bleu>=95", "wall_s<=150"],
    "small.yaml": ["bleu>=98", "wall_s<=1800"],
}

# Only what the figures do not need is switched off.
RUN_OVERRIDES = [
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "checkpoint.save_every=0",
    "checkpoint.export_portable=false",
    "checkpoint.keep_last=1",
    "checkpoint.resume=never",
]

# --quick: the smallest shape with every part, a few steps: checks that the script works, not quality.
QUICK_OVERRIDES = [
    "model.d_model=32",
    "model.n_heads=4",
    "model.max_length=16",
    "feature_model.n_embd=32",
    "feature_model.n_head=4",
    "feature_model.n_layer=3",
    "data.max_samples=600",
    "training.micro_batch_size=4",
    "training.max_steps=8",
    "training.eval_every=4",
    "training.eval_batches=2",
    "training.log_every=4",
    "schedule.warmup_steps=2",
]

METRICS = {  # figure -> (key in the final evaluation, printed format)
    "token_accuracy": ("eval_token_accuracy", "{:.4f}"),
    "exact_match": ("eval_exact_match", "{:.4f}"),
    "bleu": ("eval_bleu", "{:.2f}"),
}
COLUMNS = [*METRICS, "wall_s"]
SAMPLES = 3  # held-out reconstructions kept per seed in the JSON
COMPARE = {">=": operator.ge, "<=": operator.le}


class BenchError(Exception):
    """A run that did not produce its figures."""


def parse_goal(text: str) -> dict:
    match = re.fullmatch(r"\s*(\w+)\s*(>=|<=)\s*([0-9.eE+-]+)\s*", text)
    if not match or match.group(1) not in COLUMNS:
        figures = ", ".join(COLUMNS)
        raise argparse.ArgumentTypeError(f"goal {text!r}: expected FIGURE>=NUMBER or FIGURE<=NUMBER ({figures})")
    return {"figure": match.group(1), "op": match.group(2), "value": float(match.group(3))}


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds {text!r}: expected comma-separated integers") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"--seeds {text!r}: expected distinct seeds")
    return seeds


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def final_evaluation(run_dir: Path) -> tuple[dict, list[dict]]:
    """The last evaluation of a run's metrics.jsonl, and every evaluation (the curve)."""
    from parallel_latent.metrics import read_metrics

    path = run_dir / "metrics.jsonl"
    evals = [r for r in read_metrics(path) if r.get("kind") == "eval"] if path.exists() else []
    if not evals:
        raise BenchError(f"{path}: no evaluation recorded (is training.eval_every > 0?)")
    final = evals[-1]
    missing = [key for key, _ in METRICS.values() if not _finite(final.get(key))]
    if missing:
        raise BenchError(f"{path}: the final evaluation (step {final.get('step')}) has no finite {', '.join(missing)}")
    return final, evals


def run_seed(config: str, seed: int, nproc: int, overrides: list[str], work: Path) -> dict:
    run_dir = work / f"seed_{seed}"
    command = [
        sys.executable,
        "-m",
        "parallel_latent",
        "train",
        "--config",
        config,
        "--nproc",
        str(nproc),
        *RUN_OVERRIDES,
        *overrides,
        f"training.seed={seed}",
        f"logging.run_dir={run_dir}",
    ]
    log_path = work / f"seed_{seed}.log"
    started = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        code = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    wall = time.perf_counter() - started
    if code != 0:
        tail = [line for line in log_path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
        raise BenchError(f"seed {seed}: training exited with status {code}: {tail[-1] if tail else '(no output)'}")
    final, evals = final_evaluation(run_dir)
    row = {"seed": seed, "step": final["step"]}
    row.update({figure: float(final[key]) for figure, (key, _) in METRICS.items()})
    row["wall_s"] = wall
    row["loss"] = final.get("eval_loss")
    row["position_accuracy"] = final.get("eval_position_accuracy")
    samples = run_dir / "reconstructions" / f"step_{final['step']:08d}.jsonl"
    if samples.exists():  # the first held-out samples and their reconstructions, as the trainer shows them
        records = [json.loads(line) for line in samples.read_text(encoding="utf-8").splitlines()[:SAMPLES]]
        row["reconstructions"] = [{k: r[k] for k in ("input", "reconstruction", "exact", "truncated")} for r in records]
    row["curve"] = [{"step": e["step"], **{figure: e.get(key) for figure, (key, _) in METRICS.items()}} for e in evals]
    return row


def code_version() -> dict:
    """The commit the runs used, and whether the working tree differed from it (None outside git)."""

    def git(*args: str) -> str | None:
        try:
            result = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=False)
        except OSError:
            return None
        return result.stdout.strip() if result.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "modified": bool(status) if status is not None else None}


def summarise(rows: list[dict]) -> dict:
    return {
        name: {c: reduce([r[c] for r in rows]) for c in COLUMNS}
        for name, reduce in (("min", min), ("median", statistics.median), ("max", max))
    }


def check_goals(goals: list[dict], rows: list[dict]) -> list[dict]:
    """A goal holds for a config when it holds at every seed: its worst seed decides."""
    checked = []
    for goal in goals:
        values = [r[goal["figure"]] for r in rows]
        worst = min(values) if goal["op"] == ">=" else max(values)
        checked.append({**goal, "per": "every seed", "worst": worst, "met": COMPARE[goal["op"]](worst, goal["value"])})
    return checked


def fmt(column: str, value: float) -> str:
    return f"{value:.1f}" if column == "wall_s" else METRICS[column][1].format(value)


def print_table(rows: list[dict], summary: dict) -> None:
    header = f"{'seed':>8}  {'token_acc':>9}  {'exact_match':>11}  {'BLEU':>6}  {'wall_s':>7}"
    print(header)
    for row in rows:
        cells = [fmt(c, row[c]) for c in COLUMNS]
        print(f"{row['seed']:>8}  {cells[0]:>9}  {cells[1]:>11}  {cells[2]:>6}  {cells[3]:>7}")
    for name, values in summary.items():
        cells = [fmt(c, values[c]) for c in COLUMNS]
        print(f"{name:>8}  {cells[0]:>9}  {cells[1]:>11}  {cells[2]:>6}  {cells[3]:>7}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"YAML config (default {DEFAULT_CONFIG})")
    parser.add_argument("--seeds", type=parse_seeds, help=f"comma-separated (default {DEFAULT_SEEDS})")
    parser.add_argument("--nproc", type=int, default=2, help="processes per run (default 2)")
    parser.add_argument("--goal", type=parse_goal, action="append", help="e.g. bleu>=98 (default: the config's)")
    parser.add_argument("--quick", action="store_true", help="a tiny shape and a few steps: the script, not quality")
    parser.add_argument("--json", type=Path, help="also write the figures, config and goals here as JSON")
    parser.add_argument("--runs-dir", type=Path, help="keep the run directories here (default: a temporary one)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides for every run")
    args = parser.parse_args(argv)

    from parallel_latent.config import ConfigError, config_to_dict, load_config

    config = args.config
    config_path = Path(config) if Path(config).exists() else REPO / config
    overrides = [*(QUICK_OVERRIDES if args.quick else []), *args.overrides]
    seeds = args.seeds or (QUICK_SEEDS if args.quick else DEFAULT_SEEDS)
    try:
        resolved = config_to_dict(load_config(config_path, overrides))
    except (ConfigError, OSError) as error:
        print(f"bench_quality: {error}", file=sys.stderr)
        return 2
    if args.goal is not None:
        goals = args.goal
    elif args.quick:
        goals = []  # a smoke run: its figures are not the config's
    else:
        goals = [parse_goal(g) for g in GOALS.get(Path(config).name, [])]

    command = f"parallel-latent train --config {config} --nproc {args.nproc} training.seed=S"
    if overrides:
        command += " " + " ".join(overrides)
    load_before = os.getloadavg()
    print(
        f"bench_quality: {config}, seeds {','.join(map(str, seeds))}, each: {command} "
        f"(fresh run directory, one run at a time); {os.cpu_count()} CPUs, load average {load_before[0]:.2f}",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_quality_") as tmp:
        work = Path(tmp)
        if args.runs_dir:
            work = args.runs_dir
            taken = [work / f"seed_{seed}" for seed in seeds if (work / f"seed_{seed}").exists()]
            if taken:  # a fresh run directory per seed: never resume or mix an earlier run
                print(f"bench_quality: {taken[0]} exists; use another --runs-dir", file=sys.stderr)
                return 2
            work.mkdir(parents=True, exist_ok=True)
        if args.quick:  # a private data cache: the smoke run leaves nothing behind
            overrides = [*overrides, f"data.cache_dir={work / 'cache'}"]
        for seed in seeds:
            try:
                rows.append(run_seed(str(config_path.resolve()), seed, args.nproc, overrides, work))
            except BenchError as error:
                print(f"bench_quality: {error}", file=sys.stderr)
                return 1
            row = rows[-1]
            print(
                f"  seed {seed}: token accuracy {row['token_accuracy']:.4f}, exact match {row['exact_match']:.4f}, "
                f"BLEU {row['bleu']:.2f}, {row['wall_s']:.1f} s",
                flush=True,
            )
    load_after = os.getloadavg()
    summary = summarise(rows)
    checked = check_goals(goals, rows)
    print_table(rows, summary)
    for goal in checked:
        verdict = "met" if goal["met"] else "NOT met"
        bound = f"{goal['figure']} {goal['op']} {goal['value']:g}"
        print(f"goal {bound} at every seed: {verdict} (worst {goal['worst']:.4g})")
    print(f"load average after: {load_after[0]:.2f} (before: {load_before[0]:.2f}) on {os.cpu_count()} CPUs")

    if args.json:
        import torch

        record = {
            "benchmark": "quality",
            "config_file": config,
            "overrides": [o for o in overrides if not o.startswith("data.cache_dir=")],
            "quick": args.quick,
            "nproc": args.nproc,
            "command": command,
            "seeds": seeds,
            "rows": rows,
            "summary": summary,
            "goals": checked,
            "all_goals_met": all(goal["met"] for goal in checked),
            "config": resolved,
            "code": code_version(),
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "load_average_before": list(load_before),
                "load_average_after": list(load_after),
            },
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1, allow_nan=False) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
