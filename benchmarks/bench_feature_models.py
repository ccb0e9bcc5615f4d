"""The frozen feature model at realistic sizes, on the meta device: bytes per rank and the frozen
pass's projected time on one H200 per rank, replicated (``feature_model.parallel: replicate``, each TP
rank runs 1/tp of the micro-batch through the whole held decoder, one all-gather of the features)
against sharded (``shard``: each rank runs the whole micro-batch through 1/tp of each held layer's
attention and MLP, two all-reduces per layer), at TP 1, 2, 4 and 8.

Nothing is downloaded: each decoder is built from its published ``config.json`` figures (below) on the
meta device, cut to hidden state -3 as the trainer cuts it (``model/features.py``), and its parameters
counted by name: a held layer's matrices are what ``shard`` splits, the rest (token table, norms)
stays whole on every rank. Bytes are bf16.

The time of the frozen pass per rank is a roofline with the constants bench_projection.py pins (its
matmul rates, 4.0 TB/s of HBM): per layer, its matrix products (FLOPs over the matmul rate, or the
weights read over the bandwidth, whichever is longer) and causal attention (4 T^2 f FLOPs per
sample, counted in full); collectives at ``NVLINK`` bytes/s per direction in a ring (all-reduce
2 (n-1)/n of the bytes, all-gather (n-1)/n) plus ``COLLECTIVE_LATENCY`` each. Kernel launches and
elementwise work are left out (the same in both layouts). A TP degree that ``shard`` refuses (one that
does not divide the heads, the kv heads or the MLP width: model/sharded.py's own check) is shown as
refused.

Usage: python benchmarks/bench_feature_models.py [--quick] [--batch 32] [--length 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from bench_projection import PINNED, matmul_seconds

from common import Report, add_common_arguments, run

NVLINK = 450e9  # H200 NVLink: 900 GB/s both directions together
COLLECTIVE_LATENCY = 10e-6
BYTES = 2  # bf16
TP_DEGREES = (1, 2, 4, 8)

# Published config.json figures (hidden, layers, heads, kv heads, MLP width, vocabulary, positions).
MODELS = {
    "gpt2 (124M)": ("gpt2", 768, 12, 12, 12, 3072, 50257, 1024),
    "gpt2-xl (1.5B)": ("gpt2", 1600, 48, 25, 25, 6400, 50257, 1024),
    "pythia-1.4b": ("gpt_neox", 2048, 24, 16, 16, 8192, 50304, 2048),
    "pythia-6.9b": ("gpt_neox", 4096, 32, 32, 32, 16384, 50432, 2048),
    "llama-3.2-1b": ("llama", 2048, 16, 32, 8, 8192, 128256, 131072),
    "mistral-7b": ("llama", 4096, 32, 32, 8, 14336, 32000, 32768),
    "llama-3.1-8b": ("llama", 4096, 32, 32, 8, 14336, 128256, 131072),
    "qwen2.5-7b": ("llama", 3584, 28, 28, 4, 18944, 152064, 32768),
    "llama-3.1-70b": ("llama", 8192, 80, 64, 8, 28672, 128256, 131072),
}
QUICK = ("gpt2 (124M)", "pythia-1.4b", "llama-3.2-1b")


def transformers_config(family: str, hidden, layers, heads, kv_heads, mlp, vocab, positions):
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig

    if family == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_inner=mlp, vocab_size=vocab,
                          n_positions=positions)  # fmt: skip
    if family == "gpt_neox":
        return GPTNeoXConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                             intermediate_size=mlp, vocab_size=vocab, max_position_embeddings=positions)  # fmt: skip
    return LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, intermediate_size=mlp, vocab_size=vocab,
                       max_position_embeddings=positions)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Held:
    """What the cut decoder holds: per held layer its matrix elements, the whole-kept elements."""

    layers: int
    layer_matrices: int  # elements of one held layer's matrices (what shard splits)
    replicated: int  # token table, positions, norms: whole on every rank
    width: int
    kv_heads: int
    heads: int
    mlp: int
    family: str
    config: object  # the transformers config, for model/sharded.py's check


def held_on_meta(name: str) -> Held:
    import torch
    from transformers import AutoModel

    from parallel_latent.model.families import FAMILIES, held_layers
    from parallel_latent.model.features import truncate_to_hidden_state

    family_name, hidden, layers, heads, kv_heads, mlp, *_ = MODELS[name]
    family = FAMILIES[family_name]
    config = transformers_config(family_name, *MODELS[name][1:])
    keep = held_layers(layers, -3, family, name)
    setattr(config, family.layers_key, keep)
    with torch.device("meta"):
        decoder = AutoModel.from_config(config)
    truncate_to_hidden_state(decoder, -3, depth=layers)
    stack = getattr(decoder, family.layers)
    per_layer = sum(p.numel() for p in stack[0].parameters() if p.dim() == 2)
    matrices = per_layer * len(stack)
    replicated = sum(p.numel() for p in decoder.parameters()) - matrices  # the layers' norms and biases too
    return Held(len(stack), per_layer, replicated, hidden, kv_heads, heads, mlp, family_name, config)


def frozen_bytes(held: Held, tp: int, layout: str) -> float:
    split = tp if layout == "shard" else 1
    return BYTES * (held.replicated + held.layers * held.layer_matrices / split)


def shard_refusal(held: Held, tp: int) -> str | None:
    """Why ``shard`` refuses this decoder at ``tp`` (model/sharded.py's check itself), or None."""
    from parallel_latent.config import ConfigError, FeatureModelConfig
    from parallel_latent.model.families import FAMILIES
    from parallel_latent.model.sharded import check_shardable

    try:
        check_shardable(FeatureModelConfig(parallel="shard"), FAMILIES[held.family], held.config, tp)
    except ConfigError as refusal:
        return str(refusal)
    return None


def collective_seconds(kind: str, nbytes: float, tp: int) -> float:
    """A collective over ``tp`` ranks in a ring at ``NVLINK`` bytes/s per direction, plus
    ``COLLECTIVE_LATENCY``: an all-reduce moves 2 (n-1)/n of its tensor's ``nbytes``, an all-gather or
    a reduce-scatter (n-1)/n of the whole tensor's (the gathered output, the scattered input)."""
    share = 2 * (tp - 1) / tp if kind == "all_reduce" else (tp - 1) / tp
    return share * nbytes / NVLINK + COLLECTIVE_LATENCY


def frozen_seconds(held: Held, tp: int, layout: str, batch: int, length: int) -> float:
    """One rank's frozen pass over a micro-batch of ``batch`` samples of ``length`` tokens."""
    samples = batch / tp if layout == "replicate" else batch
    split = tp if layout == "shard" else 1
    tokens = samples * length
    per_layer = matmul_seconds(2 * tokens * held.layer_matrices / split, BYTES * held.layer_matrices / split, PINNED)
    per_layer += 4 * samples * length * length * held.width / split / PINNED.big_matmul_rate
    seconds = held.layers * per_layer
    features = BYTES * batch * length * held.width
    if tp > 1 and layout == "replicate":  # the features all-gathered once
        seconds += collective_seconds("all_gather", features, tp)
    if tp > 1 and layout == "shard":  # two all-reduces of [B, T, f] per layer
        seconds += held.layers * 2 * collective_seconds("all_reduce", features, tp)
    return seconds


def body(args, report: Report) -> None:
    names = QUICK if args.quick else tuple(MODELS)
    print(f"frozen feature model (hidden state -3), bf16, micro-batch {args.batch} x {args.length} tokens per step")
    header = " ".join(f"{'TP' + str(tp):>17}" for tp in TP_DEGREES)
    print(f"{'model':>16} {'layout':>9} {header}   (GiB per rank / ms per rank)")
    for name in names:
        held = held_on_meta(name)
        for layout in ("replicate", "shard"):
            cells = []
            for tp in TP_DEGREES:
                if layout == "shard" and shard_refusal(held, tp):
                    cells.append(f"{'refused':>17}")
                    continue
                gib = frozen_bytes(held, tp, layout) / 2**30
                ms = frozen_seconds(held, tp, layout, args.batch, args.length) * 1e3
                cells.append(f"{gib:>8.2f} / {ms:>6.2f}")
            print(f"{name:>16} {layout:>9} " + " ".join(cells))
        tp = max(t for t in TP_DEGREES if not shard_refusal(held, t))
        report.figure(f"{name}: frozen GiB per rank, replicate", frozen_bytes(held, 1, "replicate") / 2**30, "GiB")
        if tp == 1:  # not sharded at all
            continue
        report.figure(f"{name}: frozen GiB per rank, shard at TP={tp}", frozen_bytes(held, tp, "shard") / 2**30, "GiB")
        ratio = frozen_bytes(held, tp, "shard") / frozen_bytes(held, tp, "replicate")
        report.figure(f"{name}: frozen bytes per rank, shard / replicate at TP={tp}", ratio, "x")
        slower = frozen_seconds(held, tp, "shard", args.batch, args.length) / frozen_seconds(
            held, tp, "replicate", args.batch, args.length
        )
        report.figure(f"{name}: frozen pass time per rank, shard / replicate at TP={tp}", slower, "x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32, help="samples per micro-batch")
    parser.add_argument("--length", type=int, default=64, help="tokens per sample")
    add_common_arguments(parser)
    return run("bench_feature_models", parser, body)


if __name__ == "__main__":
    sys.exit(main())
