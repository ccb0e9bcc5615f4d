"""Single-process use of a trained autoencoder: encode text to latents, decode latents to text,
and evaluate a checkpoint on held-out text. Each works on any checkpoint the trainer or
``parallel-latent export`` wrote, whatever TP degree it was saved at.

Latents travel as a safetensors file holding ``latents`` [N, T, d] (float32) and
``attention_mask`` [N, T] (int64): the decoder needs the mask to know where each text ends.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def encode_texts(model, tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(latents, attention_mask, kept texts); texts that tokenise to nothing are dropped."""
    from parallel_latent.data import tokenize_samples

    cfg = model.model_cfg
    batch = tokenize_samples(texts, tokenizer, cfg.max_length, cfg.pad_token_id)
    with torch.no_grad():
        latents = model.encode(batch.input_ids, batch.attention_mask)
    return latents, batch.attention_mask, list(batch.texts)


def decode_latents(model, tokenizer, latents: torch.Tensor, attention_mask: torch.Tensor) -> list[str]:
    d, length = model.model_cfg.d_model, model.model_cfg.max_length
    if latents.dim() != 3 or latents.shape[2] != d or latents.shape[1] > length:
        raise ValueError(f"latents of shape {tuple(latents.shape)} do not fit this model ([N, <={length}, {d}])")
    if attention_mask.shape != latents.shape[:2]:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} does not match latents "
                         f"{tuple(latents.shape[:2])}")
    ids = model.decode(latents.float(), attention_mask)
    return [tokenizer.decode(row[:n].tolist()) for row, n in zip(ids, attention_mask.sum(dim=1).tolist())]


@torch.no_grad()
def evaluate_texts(model, tokenizer, texts: list[str], batch_size: int = 32) -> dict:
    """Loss per token, token accuracy and exact-match rate of whole sequences."""
    from parallel_latent.data import tokenize_samples

    cfg = model.model_cfg
    data = tokenize_samples(texts, tokenizer, cfg.max_length, cfg.pad_token_id)
    loss_sum = tokens = correct = exact = 0.0
    for start in range(0, len(data.texts), batch_size):
        out = model(data.input_ids[start:start + batch_size], data.attention_mask[start:start + batch_size])
        loss_sum += out.loss_sum.item()
        tokens += out.num_tokens.item()
        correct += out.num_correct.item()
        exact += out.num_exact.item()
    n = len(data.texts)
    return {"samples": n, "tokens": int(tokens), "loss": loss_sum / max(tokens, 1),
            "token_accuracy": correct / max(tokens, 1), "exact_match": exact / max(n, 1)}


def _read_texts(args) -> list[str]:
    from parallel_latent.cli import UsageError

    texts = list(getattr(args, "texts", []) or [])
    if getattr(args, "file", None):
        try:
            texts += [line.strip() for line in Path(args.file).read_text(encoding="utf-8").splitlines() if line.strip()]
        except OSError as error:
            raise UsageError(f"{args.file}: cannot read: {error.strerror}") from None
    if not texts:
        raise UsageError(f"{args.command}: give at least one text (or --file)")
    return texts


def cmd_encode(args: argparse.Namespace, argv: list[str]) -> int:
    from safetensors.torch import save_file

    from parallel_latent.cli import load_for_inference

    model, tokenizer = load_for_inference(args.checkpoint)
    latents, mask, kept = encode_texts(model, tokenizer, _read_texts(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({"latents": latents.contiguous(), "attention_mask": mask.contiguous()}, str(out),
              metadata={"checkpoint": str(args.checkpoint), "texts": json.dumps(kept)})
    print(f"wrote {len(kept)} x {latents.shape[1]} x {latents.shape[2]} latents to {out}")
    return 0


def cmd_decode(args: argparse.Namespace, argv: list[str]) -> int:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from parallel_latent.cli import UsageError, load_for_inference

    try:
        tensors = load_file(args.latents)
    except (OSError, SafetensorError) as error:
        raise UsageError(f"{args.latents}: not a readable latents file ({error})") from None
    if "latents" not in tensors or "attention_mask" not in tensors:
        raise UsageError(f"{args.latents}: needs tensors 'latents' and 'attention_mask' (written by encode)")
    model, tokenizer = load_for_inference(args.checkpoint)
    for text in decode_latents(model, tokenizer, tensors["latents"], tensors["attention_mask"]):
        print(text)
    return 0


def cmd_evaluate(args: argparse.Namespace, argv: list[str]) -> int:
    from parallel_latent.checkpoint import PortableCheckpoint, resolve_portable_dir
    from parallel_latent.cli import load_for_inference
    from parallel_latent.config import config_from_dict
    from parallel_latent.data import build_datasets, read_samples

    model, tokenizer = load_for_inference(args.checkpoint)
    if args.data:
        texts = read_samples(args.data)
    else:  # the run's own held-out split
        location = Path(args.checkpoint)
        location = location / "checkpoints" if (location / "checkpoints").is_dir() else location
        manifest = PortableCheckpoint(resolve_portable_dir(location), verify_checksums=False).manifest
        cfg = config_from_dict(manifest["config"], source=str(location))
        texts = list(build_datasets(cfg, tokenizer)[1].texts)
    if args.max_samples:
        texts = texts[:args.max_samples]
    print(json.dumps(evaluate_texts(model, tokenizer, texts, args.batch_size)))
    return 0


def add_subcommands(sub) -> None:
    encode = sub.add_parser("encode", help="encode texts to latents (a safetensors file)")
    encode.add_argument("--checkpoint", required=True, help="a run directory or a checkpoint directory")
    encode.add_argument("--out", required=True, help="output .safetensors file")
    encode.add_argument("texts", nargs="*", help="texts to encode")
    encode.add_argument("--file", help="a text file, one sample per line")
    encode.set_defaults(handler=cmd_encode)

    decode = sub.add_parser("decode", help="decode a latents file (from encode) to text")
    decode.add_argument("--checkpoint", required=True, help="a run directory or a checkpoint directory")
    decode.add_argument("latents", help="the .safetensors file written by encode")
    decode.set_defaults(handler=cmd_decode)

    evaluate = sub.add_parser("evaluate", help="loss, token accuracy and exact match of a checkpoint")
    evaluate.add_argument("--checkpoint", required=True, help="a run directory or a checkpoint directory")
    evaluate.add_argument("--data", default=None, help="text/JSONL file or directory (default: the run's held-out split)")
    evaluate.add_argument("--batch-size", type=int, default=32)
    evaluate.add_argument("--max-samples", type=int, default=0, help="0 = all")
    evaluate.set_defaults(handler=cmd_evaluate)
