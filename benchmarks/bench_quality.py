"""Reconstruction quality over seeds: a config trained per seed through the real command, its held-out
token accuracy, exact match and BLEU per seed, min / median / max; goals on the worst seed.
``--tiny-decoder FAMILY``: over a tiny saved decoder of that family (benchmarks/tiny_decoders.py).

    python -m benchmarks.bench_quality [--config configs/small.yaml] [--seeds 1 2 1234] [--quick]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import REPO, SMALLEST, Report, command, config_with_tokenizer
from benchmarks.processes import child_environment, run_checked

# The goals the README states, on the worst seed: the first command's run, and the quality config.
GOALS = {
    "tiny.yaml": {"token_accuracy": 0.98, "exact_match": 0.75, "bleu": 95.0, "wall_s": 150.0},
    "small.yaml": {"bleu": 98.0, "wall_s": 1800.0},
    # LD4LG's BART-base figure on ROCStories at 32 floats per token (ours: the bundled corpus).
    "compressed.yaml": {"token_accuracy": 0.99, "bleu": 97.6, "wall_s": 1200.0},
    # The real pretrained SmolLM2-135M on the feature cache, the cache's build in the first seed's wall time.
    "smollm2.yaml": {"token_accuracy": 0.95, "bleu": 88.0, "wall_s": 900.0},
}
# The latent evaluations shown beside them (parallel_latent.evaluation.latent_space), where a run has them.
LATENT = {key: f"eval_{key}" for key in ("floats_per_token", "length_accuracy", "bleu_noise_0.1", "bleu_noise_0.3",
                                         "bleu_noise_0.5")}  # fmt: skip
OUT_OF_DOMAIN = REPO / "benchmarks" / "data" / "out_of_domain.txt"
METRICS = {key: f"eval_{key}" for key in ("token_accuracy", "exact_match", "bleu")}
QUICK = [*SMALLEST, "training.micro_batch_size=8", "training.max_steps=6", "training.eval_every=6",
         "training.eval_batches=1", "parallel.tensor_parallel=1"]  # fmt: skip


def train_once(config: str, seed: int, nproc: int, overrides: list[str], scratch: Path) -> dict:
    run_dir = scratch / f"seed{seed}"
    command = [sys.executable, "-m", "parallel_latent", "train", "--config", config, "--nproc", str(nproc),
               f"training.seed={seed}", f"logging.run_dir={run_dir}", "logging.progress_bar=false",
               "logging.tensorboard=false", "logging.print_samples=0", "checkpoint.export_portable=false",
               "checkpoint.resume=never", *overrides]  # fmt: skip
    started = time.perf_counter()
    run_checked(command, child_environment(TOKENIZERS_PARALLELISM="false"), f"seed {seed}: training")
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = next((r for r in reversed(records) if r["kind"] == "eval"), None)
    if last is None:
        raise RuntimeError(f"seed {seed}: no held-out evaluation in {run_dir / 'metrics.jsonl'}")
    return {"seed": seed, "step": last["step"], "wall_s": wall, **{k: last[v] for k, v in METRICS.items()},
            "position_accuracy": last.get("eval_position_accuracy"),
            "latent": {k: last[v] for k, v in LATENT.items() if v in last}}  # fmt: skip


def out_of_domain(run_dir: Path) -> dict:
    """``parallel-latent evaluate`` of a run's last checkpoint on the out-of-domain sentences."""
    command = [sys.executable, "-m", "parallel_latent", "evaluate", "--checkpoint", str(run_dir), "--data",
               str(OUT_OF_DOMAIN)]  # fmt: skip
    result = run_checked(command, child_environment(TOKENIZERS_PARALLELISM="false"), f"{run_dir}: evaluation")
    return json.loads(result.stdout.strip().splitlines()[-1])


def unseen_token_share(config: str, overrides: list[str]) -> float:
    """The share of held-out tokens (padding excluded) whose id never occurs in the training split:
    what a trainable vocabulary head could not have learned to produce, and the tied head can."""
    import numpy as np

    from parallel_latent.data import build_datasets

    train, held_out = build_datasets(*config_with_tokenizer(config, overrides), announce=False)

    def real_tokens(view) -> np.ndarray:
        batch = view.batch(np.arange(len(view)))
        return batch["input_ids"][batch["attention_mask"].bool()].numpy()

    return float(np.mean(~np.isin(real_tokens(held_out), real_tokens(train))))


def body(args, report: Report) -> None:
    config = str(Path(args.config))
    overrides = [*(QUICK if args.quick else []), *args.overrides]
    overrides += ["checkpoint.export_portable=true"] if args.out_of_domain else []
    seeds, nproc = (args.seeds[:1], 1) if args.quick else (args.seeds, args.nproc)
    name = Path(config).name
    # A config's goals are for the config as written: overrides make it another model.
    goals = {} if args.quick or args.overrides or args.tiny_decoder else GOALS.get(name, {})
    rows = []
    with tempfile.TemporaryDirectory(prefix="parallel-latent-quality.") as scratch:
        if args.tiny_decoder:
            from benchmarks.tiny_decoders import save_tiny_decoder, small_tokenizer

            decoder = save_tiny_decoder(Path(scratch) / "decoder", args.tiny_decoder, small_tokenizer())
            overrides += [f"feature_model.name_or_path={decoder}", "feature_model.pretrained=true",
                          "tokenizer.name_or_path=feature_model"]  # fmt: skip
            name = f"{name} over a tiny {args.tiny_decoder}"
        for seed in seeds:
            rows.append(row := train_once(config, seed, nproc, overrides, Path(scratch)))
            if args.out_of_domain:
                ood = out_of_domain(Path(scratch) / f"seed{seed}")
                row.update(ood_token_accuracy=ood["token_accuracy"], ood_bleu=ood["bleu"])
                print(f"{name} seed {seed} out of domain: token accuracy {ood['token_accuracy']:.4f}, BLEU "
                      f"{ood['bleu']:.2f}", flush=True)  # fmt: skip
            print(f"{name} seed {seed}: step {row['step']}, token accuracy {row['token_accuracy']:.4f}, exact match "
                  f"{row['exact_match']:.4f}, BLEU {row['bleu']:.2f}, {row['wall_s']:.0f} s", flush=True)  # fmt: skip
        unseen = unseen_token_share(config, overrides) * 100  # while a tiny decoder's tokenizer exists
    print(f"\n{name}, --nproc {nproc}, {len(rows)} seed(s):")
    print(f"{'seed':>8} {'token acc':>10} {'exact':>8} {'BLEU':>7} {'wall s':>7}")
    columns = ("token_accuracy", "exact_match", "bleu", "wall_s")
    summary = {label: {k: of(r[k] for r in rows) for k in columns}
               for label, of in (("min", min), ("median", statistics.median), ("max", max))}  # fmt: skip
    for label, v in [*((row["seed"], row) for row in rows), *summary.items()]:  # each seed, then min / median / max
        print(f"{label:>8} {v['token_accuracy']:>10.4f} {v['exact_match']:>8.4f} {v['bleu']:>7.2f} {v['wall_s']:>7.0f}")
    # Two positions sharing a latent show as a pair near 0.5 here (docs/quality.md); a
    # start that ties quality to the seed shows as a position far below the others at some seeds only.
    if all(r["position_accuracy"] for r in rows):
        print("\nper-position held-out token accuracy ('-': no held-out token there)")
        per_position = list(zip(*(r["position_accuracy"] for r in rows), strict=True))
        worst_per_position = [min((a for a in col if a is not None), default=None) for col in per_position]
        shown = [*((f"seed {r['seed']}", r["position_accuracy"]) for r in rows), ("min", worst_per_position)]
        for label, accuracies in shown:
            print(f"{label:>8} " + " ".join("   -" if a is None else f"{a:.2f}" for a in accuracies))
        measured = min(a for a in worst_per_position if a is not None)
        report.figure(f"{name} worst position over the seeds: token accuracy", measured)
    for row in rows:
        for key, unit in (("token_accuracy", ""), ("exact_match", ""), ("bleu", ""), ("wall_s", "s"),
                          *((("ood_token_accuracy", ""), ("ood_bleu", "")) if args.out_of_domain else ())):  # fmt: skip
            report.figure(f"{name} seed {row['seed']}: {key.replace('_', ' ')}", row[key], unit)
    # The goals apply to every seed: the worst of them (the most wall time) is what is checked.
    for key in METRICS:
        report.figure(f"{name} median {key.replace('_', ' ')}", summary["median"][key])
        report.figure(f"{name} worst seed {key.replace('_', ' ')}", summary["min"][key], at_least=goals.get(key))
    report.figure(f"{name} slowest seed wall time", summary["max"]["wall_s"], "s", at_most=goals.get("wall_s"))
    if latent_keys := [k for k in LATENT if all(k in r["latent"] for r in rows)]:
        print("\n" + f"{'seed':>8} " + " ".join(f"{k:>16}" for k in latent_keys))
        for row in rows:
            print(f"{row['seed']:>8} " + " ".join(f"{row['latent'][k]:>16.4f}" for k in latent_keys))
        for key in latent_keys:
            values = [r["latent"][key] for r in rows]
            for label, value in (("worst seed", min(values)), ("median", statistics.median(values))):
                report.figure(f"{name} {label} {key.replace('_', ' ')}", value)
    report.figure(f"{name} held-out tokens never in the training split", unseen, "%")


def arguments(parser) -> None:
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(1, 21)))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out-of-domain", action="store_true", help="also evaluate each seed on "
                        "benchmarks/data/out_of_domain.txt (its portable checkpoint exported)")  # fmt: skip
    parser.add_argument("--tiny-decoder", choices=("gpt2", "gpt_neox", "llama"), help="the feature model (see above)")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run (section.key=value)")


main = command("bench_quality", __doc__, body, arguments, __name__)
