"""The inference subcommands of ``parallel-latent``: reconstruct, encode, decode, interpolate, evaluate.

Each runs in one process on any checkpoint the trainer or ``parallel-latent export`` wrote (a run
directory, a checkpoints directory, a training checkpoint or a portable/consolidated directory), on
a ``save-pretrained`` directory, or on a Hugging Face hub repository id, whatever TP degree it was
saved at, through :class:`parallel_latent.api.TextAutoencoder`.

Latents travel as a safetensors file holding ``latents`` [B, N, k] (float32) and
``attention_mask`` [B, T] (int64): the decoder needs the mask to know where each text ends, unless
the model was trained with ``model.predict_length`` (then ``attention_mask`` may be left out, as for
latents a diffusion model sampled).
"""

from __future__ import annotations

import argparse
import json

from parallel_latent.cli.bounds import MAX_BATCH_SIZE, MAX_INTERPOLATION_STEPS, check_range
from parallel_latent.errors import UsageError, require_file, require_new_file


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


def _load(args: argparse.Namespace):
    """What ``--checkpoint`` names: any checkpoint directory, a save-pretrained directory, or a
    Hugging Face hub repository id; with ``--tokenizer``, that tokenizer. Nothing else outside the
    checkpoint is read: a manifest naming a path or a hub id is refused in one line."""
    from parallel_latent.api import TextAutoencoder

    return TextAutoencoder.from_pretrained(args.checkpoint, tokenizer=getattr(args, "tokenizer", None))


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
    if "latents" not in tensors:
        raise UsageError(f"{path}: needs a tensor 'latents' (and 'attention_mask', as encode writes them)")
    autoencoder = _load(args)
    if "attention_mask" not in tensors and not autoencoder.model.model_cfg.predict_length:
        raise UsageError(f"{path}: no 'attention_mask', and {args.checkpoint} does not predict lengths")
    try:
        texts = autoencoder.decode(tensors["latents"], tensors.get("attention_mask"))
    except ValueError as error:
        raise UsageError(f"{path}: {error}") from None
    for text in texts:
        print(text)
    return 0


def cmd_interpolate(args: argparse.Namespace) -> int:
    check_range("interpolate: --steps", args.steps, 2, MAX_INTERPOLATION_STEPS, "the two endpoints included")
    for index, text in enumerate(_load(args).interpolate(args.first, args.second, args.steps)):
        print(f"{index / (args.steps - 1):.3f}  {text}")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from parallel_latent.data import read_samples
    from parallel_latent.evaluation.held_out import evaluate_held_out, evaluate_texts

    check_range("evaluate: --batch-size", args.batch_size, 1, MAX_BATCH_SIZE)
    check_range("evaluate: --max-samples", args.max_samples, 0, 2**31 - 1, "0: every sample")
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


CHECKPOINT_HELP = (
    "a run directory, a checkpoints directory, a training checkpoint, a portable or save-pretrained "
    "directory, or a Hugging Face hub repository id"
)
TOKENIZER_HELP = (
    "the tokenizer (offline, a local directory or a hub id) of a checkpoint that does not hold its own "
    "(by default it loads from the checkpoint alone)"
)


def add_checkpoint_options(parser) -> None:
    """``--checkpoint`` and ``--tokenizer``: what every command that loads an autoencoder takes."""
    parser.add_argument("--checkpoint", required=True, help=CHECKPOINT_HELP)
    parser.add_argument("--tokenizer", default=None, help=TOKENIZER_HELP)


def add_subcommands(sub) -> None:
    reconstruct = sub.add_parser("reconstruct", help="encode texts to latents and decode them back")
    add_checkpoint_options(reconstruct)
    reconstruct.add_argument("texts", nargs="*", help="texts to reconstruct")
    reconstruct.add_argument("--file", help="a text file, one sample per line")
    reconstruct.set_defaults(handler=cmd_reconstruct)

    encode = sub.add_parser("encode", help="encode texts to latents (a safetensors file)")
    add_checkpoint_options(encode)
    encode.add_argument("--out", required=True, help="output .safetensors file")
    encode.add_argument("texts", nargs="*", help="texts to encode")
    encode.add_argument("--file", help="a text file, one sample per line")
    encode.set_defaults(handler=cmd_encode)

    decode = sub.add_parser("decode", help="decode a latents file (from encode) to text")
    add_checkpoint_options(decode)
    decode.add_argument("latents", help="the .safetensors file written by encode")
    decode.set_defaults(handler=cmd_decode)

    interpolate = sub.add_parser(
        "interpolate", help="decode the latents on the straight line between two texts' latents"
    )
    add_checkpoint_options(interpolate)
    interpolate.add_argument("first", help="the text at 0")
    interpolate.add_argument("second", help="the text at 1")
    interpolate.add_argument(
        "--steps", type=int, default=5, help=f"points on the line, endpoints included (2-{MAX_INTERPOLATION_STEPS})"
    )
    interpolate.set_defaults(handler=cmd_interpolate)

    evaluate = sub.add_parser("evaluate", help="loss, token accuracy, exact match and BLEU of a checkpoint")
    add_checkpoint_options(evaluate)
    evaluate.add_argument(
        "--data",
        default=None,
        help="text/JSONL file or directory, e.g. another corpus to measure out-of-domain text "
        "(default: the run's held-out split)",
    )
    evaluate.add_argument("--batch-size", type=int, default=32, help=f"1-{MAX_BATCH_SIZE}")
    evaluate.add_argument("--max-samples", type=int, default=0, help="0 = all")
    evaluate.set_defaults(handler=cmd_evaluate)
