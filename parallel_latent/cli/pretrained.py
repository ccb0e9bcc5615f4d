"""``parallel-latent save-pretrained`` and ``push-to-hub``: a checkpoint as a Hugging Face model
directory (:mod:`parallel_latent.pretrained` writes it), and its upload."""

from __future__ import annotations

import tempfile
from pathlib import Path


def save_from_checkpoint(
    checkpoint: str, out: Path, evaluate: bool, repo_id: str | None = None, tokenizer: str | None = None
) -> Path:
    """Load ``checkpoint`` (any path the inference commands take, or a hub id; with ``tokenizer``,
    that tokenizer, whose files are then saved) and write it to ``out``. With ``evaluate``, weights
    the run never evaluated are evaluated on its held-out split."""
    from parallel_latent import pretrained
    from parallel_latent.api import TextAutoencoder
    from parallel_latent.checkpoint import require_empty_output
    from parallel_latent.evaluation.held_out import evaluate_held_out

    require_empty_output(out)  # before loading anything
    autoencoder = TextAutoencoder.from_pretrained(checkpoint, tokenizer=tokenizer)
    record = pretrained.training_record(autoencoder.source)
    if evaluate and record.evaluation is None and record.config:
        print(f"no held-out evaluation recorded at step {record.steps}: evaluating on the held-out split", flush=True)
        result = evaluate_held_out(autoencoder)
        keys = ("samples", "loss", *(key for key, _, _ in pretrained.METRICS))
        record.evaluation = {
            "step": record.steps,
            **{key: result[key] for key in keys},
            **pretrained.latent_figures(result),
        }
    return pretrained.save_pretrained(autoencoder, out, record=record, repo_id=repo_id)


def cmd_save_pretrained(args) -> int:
    out = save_from_checkpoint(args.checkpoint, Path(args.out), not args.no_evaluate, tokenizer=args.tokenizer)
    print(f"pretrained model written to {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
    return 0


def cmd_push_to_hub(args) -> int:
    from parallel_latent import pretrained

    options = {"private": args.private or None, "revision": args.revision, "message": args.message}
    source = Path(args.source)
    if source.is_dir() and pretrained.read_pretrained_config(source) is not None:
        url = pretrained.push_directory_to_hub(source, args.repo_id, **options)
    else:
        with tempfile.TemporaryDirectory(prefix="parallel-latent-push-") as scratch:
            folder = save_from_checkpoint(
                args.source, Path(scratch) / "model", True, repo_id=args.repo_id, tokenizer=args.tokenizer
            )
            url = pretrained.push_directory_to_hub(folder, args.repo_id, **options)
    print(f"pushed to {args.repo_id}: {url}")
    return 0


TOKENIZER_HELP = (
    "the tokenizer (offline, a local directory or a hub id) of a checkpoint that does not hold its own; "
    "its files are saved with the model"
)


def add_subcommands(sub) -> None:
    save = sub.add_parser(
        "save-pretrained",
        help="write a checkpoint as a Hugging Face model directory (weights, config, tokenizer, model card)",
        description="Write OUT/config.json, OUT/model.safetensors (TP=1, from any TP), OUT/manifest.json, the "
        "tokenizer's files and OUT/README.md, a model card with the held-out evaluation. Load it with "
        "TextAutoencoder.from_pretrained(OUT) or upload it with push-to-hub.",
    )
    save.add_argument("checkpoint", help="a run directory, a checkpoint or portable directory, or a hub repository id")
    save.add_argument("out", help="output directory (must not exist or be empty)")
    save.add_argument(
        "--no-evaluate",
        action="store_true",
        help="do not evaluate weights the run never evaluated (their card then has no numbers)",
    )
    save.add_argument("--tokenizer", default=None, help=TOKENIZER_HELP)
    save.set_defaults(handler=cmd_save_pretrained)

    push = sub.add_parser(
        "push-to-hub",
        help="upload a model to a Hugging Face hub repository",
        description="Upload a save-pretrained directory as it is, or any checkpoint (written as one first), "
        "to REPO_ID (created if missing). Log in first (hf auth login, or HF_TOKEN).",
    )
    push.add_argument("source", help="a save-pretrained directory, or anything save-pretrained takes")
    push.add_argument("repo_id", help="the hub repository, e.g. my-org/tiny-latent-autoencoder")
    push.add_argument("--private", action="store_true", help="create the repository private")
    push.add_argument("--revision", default=None, help="the branch to commit to (default: main)")
    push.add_argument("--message", default=None, help="commit message")
    push.add_argument("--tokenizer", default=None, help=TOKENIZER_HELP)
    push.set_defaults(handler=cmd_push_to_hub)
