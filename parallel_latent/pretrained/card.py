"""The model card (``README.md``) of a pretrained directory: hub metadata with the held-out evaluation
as ``model-index`` (token accuracy, exact match, BLEU), and the same numbers, the latent space, the
training and the model's shape as tables.
"""

from __future__ import annotations

from typing import Any

from parallel_latent.feature_model.families import FAMILIES, SHAPE_RECORDED

from .directory import LIBRARY
from .record import METRICS, TrainingRecord, dataset_of, latent_figures

__all__ = ["build_model_card"]

# What the model card's metadata calls the evaluation: the hub has no task for reconstruction.
TASK = {"task_type": "text-reconstruction", "task_name": "Text reconstruction (autoencoding)"}
TAGS = ["text-autoencoder", "perceiver", "latent", "tensor-parallel"]


def _format(value: Any, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _table(rows: list[tuple[str, Any]]) -> str:
    rows = [(name, value) for name, value in rows if value is not None]
    if not rows:
        return "Not recorded (saved from a model in memory, without its training config)."
    return "\n".join(["| | |", "| --- | --- |", *(f"| {name} | {value} |" for name, value in rows)])


def _eval_results(record: TrainingRecord) -> list:
    """The held-out evaluation as the hub's ``EvalResult`` entries (those recorded)."""
    from huggingface_hub import EvalResult

    dataset_type, dataset_name, _ = dataset_of(record)
    evaluation = record.evaluation or {}
    return [
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


def _card_data(config: dict, record: TrainingRecord, name: str, results: list):
    from huggingface_hub import ModelCardData

    feature = _trained_feature_model(config)
    hub_dataset = dataset_of(record)[2]
    return ModelCardData(
        library_name=LIBRARY,
        pipeline_tag="feature-extraction",
        tags=[*TAGS, _family(config)],
        datasets=[hub_dataset] if hub_dataset else None,
        base_model=feature.get("name_or_path") if feature.get("pretrained") else None,
        model_name=name,
        eval_results=results or None,
    )


def _evaluation_text(evaluation: dict, max_length: Any, recorded: bool) -> str:
    """The card's "Held-out evaluation" section."""
    if not recorded:
        return (
            "No held-out evaluation of these weights was recorded; "
            "`parallel-latent evaluate --checkpoint <this directory>` measures it."
        )
    text = (
        f"On {evaluation.get('samples') or 'the'} held-out samples of the training corpus at step "
        f"{evaluation.get('step')}, each cut to the model's {max_length} tokens as the model "
        "sees them:\n\n"
        "| loss | token accuracy | exact match | BLEU |\n| --- | --- | --- | --- |\n"
        f"| {_format(evaluation.get('loss'), 4)} | {_format(evaluation.get('token_accuracy'), 4)} | "
        f"{_format(evaluation.get('exact_match'), 4)} | {_format(evaluation.get('bleu'), 2)} |\n\n"
        "Token accuracy: the argmax is the input token; exact match: every token of a sample right; "
        "BLEU: sacrebleu's corpus BLEU (13a, 0-100) of the reconstructions against the inputs."
    )
    latent = latent_figures(evaluation)
    if latent:
        text += (
            "\n\nThe latent space (Gaussian noise of 0.1 / 0.3 / 0.5 times the latents' root-mean-square, "
            "then decoded; the per-feature mean and standard deviation are in config.json's latent_stats):\n\n"
            + _table([(name.replace("_", " "), _format(value, 4)) for name, value in latent.items()])
        )
    return text


def _training_table(record: TrainingRecord) -> str:
    saved = record.config or {}
    training, optimizer, parallel = (saved.get(key) or {} for key in ("training", "optimizer", "parallel"))
    return _table(
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


def _trained_feature_model(config: dict) -> dict:
    """The feature model as the training config named it (where its weights came from): a loaded
    checkpoint's ``feature_model_config`` says how it was rebuilt, from the checkpoint alone."""
    return ((config.get("config") or {}).get("feature_model")) or config.get("feature_model_config") or {}


def _family(config: dict) -> str:
    return (config.get("feature_model_architecture") or {}).get("architecture", SHAPE_RECORDED.name)


def _feature_words(config: dict) -> str:
    feature = _trained_feature_model(config)
    family = FAMILIES[_family(config)].title
    if feature.get("pretrained"):
        return f"pretrained `{feature.get('name_or_path')}` ({family}), hidden state {feature.get('hidden_state', -3)}"
    architecture = config.get("feature_model_architecture") or {}
    return (
        f"RANDOM weights: a {architecture.get('n_layer', feature.get('n_layer'))}-layer, "
        f"{architecture.get('n_embd', feature.get('n_embd'))}-wide {family} built from its config (a demo)"
    )


def _tokenizer_words(config: dict) -> str:
    name = ((config.get("config") or {}).get("tokenizer") or {}).get("name_or_path", "offline")
    words = "GPT-2 BPE" if name == "offline" else f"`{name}`"
    return f"{words} with <|mask|> and <|pad|>, {(config.get('tokenizer') or {}).get('vocab_size')} tokens"


def _latent_shape(model: dict) -> tuple[Any, Any]:
    """(N, k): 0 (or a checkpoint from before the keys) means one latent per position, of the blocks' width."""
    return model.get("num_latents") or model.get("max_length"), model.get("latent_dim") or model.get("d_model")


def _model_table(config: dict) -> str:
    model = config.get("model_config") or {}
    num_latents, latent_dim = _latent_shape(model)
    return _table(
        [
            ("tokens per text (T)", model.get("max_length")),
            ("latents per text (N)", num_latents),
            ("features per latent (k)", latent_dim),
            ("block width (d)", model.get("d_model")),
            ("predicts the length (decodes without a mask)", bool(model.get("predict_length"))),
            ("encoder / decoder blocks", f"{model.get('n_encoder_layers')} / {model.get('n_decoder_layers')}"),
            ("attention heads", model.get("n_heads")),
            ("vocabulary head", model.get("head")),
            ("feature model", _feature_words(config)),
            ("tokenizer", _tokenizer_words(config)),
            ("format", f"{config.get('format')} v{config.get('format_version')}"),
        ]
    )


def build_model_card(config: dict, record: TrainingRecord, name: str, repo_id: str | None = None):
    """The model card (``huggingface_hub.ModelCard``) of a pretrained directory whose ``config.json``
    is ``config``: metadata with the held-out evaluation as ``model-index``, and the same numbers,
    the training and the model's shape as tables."""
    from huggingface_hub import ModelCard

    results = _eval_results(record)
    model = config.get("model_config") or {}
    num_latents, latent_dim = _latent_shape(model)
    load_id = repo_id or name
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

{_evaluation_text(record.evaluation or {}, model.get("max_length"), bool(results))}

## Training

{_training_table(record)}

## Model

{_model_table(config)}
"""
    data = _card_data(config, record, name, results)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")
