"""What is known about how a model's weights were trained: the training config, the optimizer steps,
and the held-out evaluation of exactly these weights (from the trainer's ``metrics.jsonl``), for
``config.json`` and the model card.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from parallel_latent.checkpoint import PortableCheckpoint
from parallel_latent.files import read_jsonl

from .directory import read_pretrained_config

__all__ = [
    "BUNDLED_CORPUS",
    "LATENT_METRICS",
    "METRICS",
    "TrainingRecord",
    "dataset_of",
    "latent_figures",
    "training_record",
]

BUNDLED_CORPUS = "Pride and Prejudice (Jane Austen), one sentence per line, bundled with parallel-latent"
METRICS = [  # (key in an evaluation record, model-index metric type, display name)
    ("token_accuracy", "accuracy", "Token accuracy"),
    ("exact_match", "exact_match", "Exact match"),
    ("bleu", "bleu", "BLEU"),
]
# The latent evaluations (parallel_latent.evaluation.latent_space), by their names without the trainer's eval_
# prefix, as the card's second table shows them.
LATENT_METRICS = (
    "floats_per_token", "compression", "length_accuracy",
    "bleu_noise_0.1", "bleu_noise_0.3", "bleu_noise_0.5",
    "token_accuracy_noise_0.1", "token_accuracy_noise_0.3", "token_accuracy_noise_0.5",
    "latent_mean_abs", "latent_std_min", "latent_std_median", "latent_std_max", "latent_top10_variance_share",
)  # fmt: skip


def latent_figures(result: dict, prefix: str = "") -> dict:
    """The latent evaluations that ``result`` holds (names with ``prefix``), by their card names."""
    return {name: result[prefix + name] for name in LATENT_METRICS if prefix + name in result}


@dataclasses.dataclass
class TrainingRecord:
    """How a model was trained, for ``config.json`` and the model card: the training config (as a
    dict), the optimizer steps, and the held-out evaluation of exactly these weights (``step``,
    ``samples``, ``loss``, ``token_accuracy``, ``exact_match``, ``bleu``), each None if unknown."""

    config: dict | None = None
    steps: int | None = None
    evaluation: dict | None = None

    @property
    def corpus(self) -> str | None:
        return dataset_of(self)[1] if self.config else None

    def to_dict(self) -> dict:
        return {"corpus": self.corpus, "steps": self.steps, "evaluation": self.evaluation}


def _evaluation_from_metrics(run_dir: Path, step: int) -> dict | None:
    """The trainer's held-out evaluation at ``step`` (the last one, if a resumed run repeated it)."""
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "eval" and r.get("step") == step]
    if not records:
        return None
    record = records[-1]
    return {
        "step": step,
        "samples": record.get("eval_samples"),
        "loss": record.get("eval_loss"),
        "token_accuracy": record.get("eval_token_accuracy"),
        "exact_match": record.get("eval_exact_match"),
        "bleu": record.get("eval_bleu"),
        **latent_figures(record, "eval_"),
    }


def _run_directory(directory: Path, config: dict | None) -> Path | None:
    """The run directory a checkpoint belongs to: the nearest ancestor holding ``metrics.jsonl``
    (``RUN/checkpoints/step_N/model``), else the recorded ``logging.run_dir`` if it exists."""
    for candidate in (directory, *list(directory.resolve().parents)[:3]):
        if (candidate / "metrics.jsonl").is_file():
            return candidate
    recorded = ((config or {}).get("logging") or {}).get("run_dir")
    if recorded and (Path(recorded) / "metrics.jsonl").is_file():
        return Path(recorded)
    return None


def training_record(directory: str | Path | None) -> TrainingRecord:
    """What ``directory`` (a pretrained directory, or a portable directory inside a run) says about
    its training; an empty record for None."""
    if directory is None:
        return TrainingRecord()
    directory = Path(directory)
    config = read_pretrained_config(directory)
    if config is not None:
        saved = config.get("training") or {}
        return TrainingRecord(config.get("config"), saved.get("steps"), saved.get("evaluation"))
    manifest = PortableCheckpoint(directory, verify_checksums=False).manifest
    record = TrainingRecord(manifest.get("config"), manifest.get("step"))
    run_dir = _run_directory(directory, record.config)
    if run_dir is not None and record.steps is not None:
        record.evaluation = _evaluation_from_metrics(run_dir, record.steps)
    return record


def dataset_of(record: TrainingRecord) -> tuple[str, str, str | None]:
    """(model-index dataset type, dataset name, hub dataset id or None) of the training corpus."""
    data = (record.config or {}).get("data") or {}
    path = data.get("path") or ""
    if path.startswith("hf:"):
        name, _, config = path[3:].partition(":")
        split = data.get("split", "train")
        return name, f"{name} ({config}), split {split}" if config else f"{name}, split {split}", name
    if not path:
        return "pride-and-prejudice", BUNDLED_CORPUS, None
    name = Path(path).name  # a local path says nothing to others; its name does
    return name, name, None
