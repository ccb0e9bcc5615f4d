"""The inference subcommands of ``parallel-latent``: reconstruct, encode, decode, evaluate.

Each runs in one process on any checkpoint the trainer or ``parallel-latent export`` wrote (a run
directory, a checkpoints directory, a training checkpoint or a portable/consolidated directory), on
a ``save-pretrained`` directory, or on a Hugging Face hub repository id, whatever TP degree it was
saved at, through :class:`parallel_latent.api.TextAutoencoder`.

Latents travel as a safetensors file holding ``latents`` [N, T, d] (float32) and
``attention_mask`` [N, T] (int64): the decoder needs the mask to know where each text ends.
"""

from __future__ import annotations

import argparse
import json

import torch

from parallel_latent.errors import UsageError, require_file, require_new_file


@torch.no_grad()
def evaluate_ids(
    autoencoder, input_ids: torch.Tensor, attention_mask: torch.Tensor, batch_size: int = 32, truncated: int = 0
) -> dict:
    """Loss per token, token accuracy, exact-match rate of whole sequences and corpus BLEU of the
    reconstructions against the inputs as the model saw them, for tokenised samples [N, T]
    (``truncated``: how many of them were cut to ``max_length`` tokens, reported as is)."""
    from parallel_latent.model import eval_mode
    from parallel_latent.quality import corpus_bleu, detokenize, output_totals, reconstruction_metrics

    model, tokenizer = autoencoder.model, autoencoder.tokenizer
    totals = torch.zeros(4, dtype=torch.float64)
    references, hypotheses = [], []
    with eval_mode(model):
        for start in range(0, input_ids.shape[0], batch_size):
            ids = input_ids[start : start + batch_size].to(autoencoder.device)
            mask = attention_mask[start : start + batch_size].to(autoencoder.device)
            out = model(ids, mask, return_predictions=True)
            totals += output_totals(out).cpu()
            references += detokenize(tokenizer, ids, mask)
            hypotheses += detokenize(tokenizer, out.predictions, mask)
    n = input_ids.shape[0]
    loss_sum, tokens, correct, exact = totals.tolist()
    return {
        "samples": n,
        "tokens": int(tokens),
        "truncated": int(truncated),
        **reconstruction_metrics(loss_sum, tokens, correct, exact, n),
        "bleu": corpus_bleu(hypotheses, references) if n else None,
    }


def evaluate_texts(autoencoder, texts: list[str], batch_size: int = 32) -> dict:
    """:func:`evaluate_ids` of ``texts``, each cut to the model's ``max_length`` tokens."""
    from parallel_latent.data import tokenize_samples

    cfg = autoencoder.model.model_cfg
    data = tokenize_samples(texts, autoencoder.tokenizer, cfg.max_length, cfg.pad_token_id)
    return evaluate_ids(autoencoder, data.input_ids, data.attention_mask, batch_size, data.num_truncated)


def read_texts(args: argparse.Namespace) -> list[str]:
    """The texts given on the command line, then those of ``--file`` (one per non-empty line)."""
    texts = list(getattr(args, "texts", []) or [])
    if getattr(args, "file", None):
        path = require_file(args.file, "--file")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise UsageError(f"{path}: not UTF-8 text") from None
        texts += [line.strip() for line in text.splitlines() if line.strip()]
    if not texts:
        raise UsageError(f"{args.command}: give at least one text (or --file)")
    return texts


def evaluate_held_out(autoencoder, batch_size: int = 32, max_samples: int = 0) -> dict:
    """:func:`evaluate_ids` on the held-out split of the run ``autoencoder`` was loaded from (its
    config travels with the checkpoint): the very token ids the trainer evaluates."""
    from parallel_latent.checkpoint import PortableCheckpoint
    from parallel_latent.config import config_from_dict
    from parallel_latent.data import build_datasets, get_batch

    source = autoencoder.source
    config = PortableCheckpoint(source, verify_checksums=False).manifest.get("config")
    if not config:
        raise UsageError(f"{source}: saved without its training config, so without a held-out split; give --data")
    cfg = config_from_dict(config, source=str(source))
    held_out = build_datasets(cfg, autoencoder.tokenizer, announce=False)[1]  # stdout is the JSON result
    indices = list(range(min(len(held_out), max_samples) if max_samples else len(held_out)))
    batch = get_batch(held_out, indices)
    truncated = int(held_out.truncated_at(indices).sum()) if hasattr(held_out, "truncated_at") else 0
    return evaluate_ids(autoencoder, batch["input_ids"], batch["attention_mask"], batch_size, truncated)


def _load(args: argparse.Namespace):
    """What ``--checkpoint`` names: any checkpoint directory, a save-pretrained directory, or a
    Hugging Face hub repository id."""
    from parallel_latent.api import TextAutoencoder

    return TextAutoencoder.from_pretrained(args.checkpoint)


def cmd_reconstruct(args: argparse.Namespace) -> int:
    texts = read_texts(args)
    for text, decoded in zip(texts, _load(args).reconstruct(texts), strict=True):
        print(f"text:          {text}\nreconstructed: {decoded}\n")
    return 0


def cmd_encode(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    texts = read_texts(args)
    out = require_new_file(args.out, "--out")
    latents = _load(args).encode(texts)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        {"latents": latents.latents.float().contiguous(), "attention_mask": latents.attention_mask.contiguous()},
        str(out),
        metadata={"checkpoint": str(args.checkpoint), "texts": json.dumps(texts)},
    )
    n, length, width = latents.latents.shape
    print(f"wrote {n} x {length} x {width} latents to {out}")
    return 0


def cmd_decode(args: argparse.Namespace) -> int:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = require_file(args.latents, "latents")
    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as error:
        raise UsageError(f"{path}: not a readable latents file ({error})") from None
    if "latents" not in tensors or "attention_mask" not in tensors:
        raise UsageError(f"{path}: needs tensors 'latents' and 'attention_mask' (written by encode)")
    for text in _load(args).decode(tensors["latents"], tensors["attention_mask"]):
        print(text)
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from parallel_latent.data import read_samples

    autoencoder = _load(args)
    if args.data:  # any corpus, e.g. out-of-domain text
        texts = read_samples(args.data)
        if args.max_samples:
            texts = texts[: args.max_samples]
        result = evaluate_texts(autoencoder, texts, args.batch_size)
    else:  # the run's own held-out split
        result = evaluate_held_out(autoencoder, args.batch_size, args.max_samples)
    print(json.dumps(result))
    return 0


def add_subcommands(sub) -> None:
    checkpoint_help = (
        "a run directory, a checkpoints directory, a training checkpoint, a portable or save-pretrained "
        "directory, or a Hugging Face hub repository id"
    )
    reconstruct = sub.add_parser("reconstruct", help="encode texts to latents and decode them back")
    reconstruct.add_argument("--checkpoint", required=True, help=checkpoint_help)
    reconstruct.add_argument("texts", nargs="*", help="texts to reconstruct")
    reconstruct.add_argument("--file", help="a text file, one sample per line")
    reconstruct.set_defaults(handler=cmd_reconstruct)

    encode = sub.add_parser("encode", help="encode texts to latents (a safetensors file)")
    encode.add_argument("--checkpoint", required=True, help=checkpoint_help)
    encode.add_argument("--out", required=True, help="output .safetensors file")
    encode.add_argument("texts", nargs="*", help="texts to encode")
    encode.add_argument("--file", help="a text file, one sample per line")
    encode.set_defaults(handler=cmd_encode)

    decode = sub.add_parser("decode", help="decode a latents file (from encode) to text")
    decode.add_argument("--checkpoint", required=True, help=checkpoint_help)
    decode.add_argument("latents", help="the .safetensors file written by encode")
    decode.set_defaults(handler=cmd_decode)

    evaluate = sub.add_parser("evaluate", help="loss, token accuracy, exact match and BLEU of a checkpoint")
    evaluate.add_argument("--checkpoint", required=True, help=checkpoint_help)
    evaluate.add_argument(
        "--data",
        default=None,
        help="text/JSONL file or directory, e.g. another corpus to measure out-of-domain text "
        "(default: the run's held-out split)",
    )
    evaluate.add_argument("--batch-size", type=int, default=32)
    evaluate.add_argument("--max-samples", type=int, default=0, help="0 = all")
    evaluate.set_defaults(handler=cmd_evaluate)


__all__ = [
    "add_subcommands",
    "evaluate_held_out",
    "evaluate_ids",
    "evaluate_texts",
    "read_texts",
]
