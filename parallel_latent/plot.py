"""``parallel-latent plot RUN_DIR``: PNG curves of a run's metrics.jsonl (needs the optional
extra ``plot``: ``pip install parallel-latent[plot]``, i.e. matplotlib)."""

from __future__ import annotations

from pathlib import Path

from parallel_latent.errors import BadInput
from parallel_latent.files import read_jsonl

__all__ = ["PlotError", "plot_run"]


class PlotError(BadInput):
    """A problem with the run to plot (one line)."""


def _series(records: list[dict], kind: str, key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for record in records:
        if record.get("kind", "train") == kind and record.get(key) is not None:
            steps.append(record["step"])
            values.append(record[key])
    return steps, values


# figure file -> (title, y label, [(kind, key, legend label), ...])
FIGURES = {
    "loss.png": ("Loss", "cross-entropy (nats/token)", [("train", "loss", "train"), ("eval", "eval_loss", "held-out")]),
    "accuracy.png": (
        "Reconstruction accuracy",
        "fraction",
        [
            ("train", "token_accuracy", "train token accuracy"),
            ("eval", "eval_token_accuracy", "held-out token accuracy"),
            ("eval", "eval_exact_match", "held-out exact match"),
        ],
    ),
    "bleu.png": ("Reconstruction BLEU", "corpus BLEU (0-100)", [("eval", "eval_bleu", "held-out BLEU")]),
    "throughput.png": ("Throughput", "tokens / s", [("train", "tokens_per_s", "tokens/s (non-pad)")]),
    "lr.png": (
        "Learning rate and gradient norm",
        "value",
        [("train", "lr", "learning rate"), ("train", "grad_norm", "gradient norm (pre-clip)")],
    ),
}


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write loss / accuracy / throughput / lr curves as PNG files; return their paths."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise PlotError(f"{run_dir}: no metrics.jsonl (is this a run directory?)")
    records = read_jsonl(metrics)
    if not records:
        raise PlotError(f"{metrics}: no metrics recorded yet")
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("plotting needs matplotlib: pip install 'parallel-latent[plot]'") from None

    out_dir = Path(out_dir) if out_dir else run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for filename, (title, ylabel, curves) in FIGURES.items():
        figure, axes = plt.subplots(figsize=(7, 4))
        drawn = 0
        for kind, key, label in curves:
            steps, values = _series(records, kind, key)
            if steps:
                axes.plot(steps, values, marker="o" if kind == "eval" else None, markersize=3, label=label)
                drawn += 1
        if drawn:
            axes.set(title=f"{title} ({run_dir.name})", xlabel="step", ylabel=ylabel)
            axes.grid(alpha=0.3)
            axes.legend()
            path = out_dir / filename
            figure.tight_layout()
            figure.savefig(path, dpi=100)
            written.append(path)
        plt.close(figure)
    return written
