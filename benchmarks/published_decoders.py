"""Published decoders (GPT-2, Pythia, Llama, Mistral, Qwen) as the frozen feature model at their real
sizes, built on the meta device from their config.json figures: what a rank holds, the frozen pass per
rank replicated or sharded over the TP group (a roofline with the performance model's constants), and
one rank's whole step per TP degree and layout. Bytes are bf16; each decoder is cut to hidden state -3
as the trainer cuts it, its held layers' matrices what ``shard`` splits."""

from __future__ import annotations

import dataclasses

from benchmarks.meta_trace import fake_tp_group, row_config, trace_model
from benchmarks.performance import PEAK_FLOPS, PINNED, collective_seconds, kernels_of, matmul_seconds, projection
from benchmarks.step_projection import model_flops
from benchmarks.step_trace import Op
from parallel_latent.config import ConfigError, FeatureModelConfig

BYTES = 2  # bf16
TP_DEGREES = (1, 2, 4, 8)
LAYOUTS = ("replicate", "shard")

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
QUICK_MODELS = ("gpt2 (124M)", "pythia-1.4b", "llama-3.2-1b")


def transformers_config(family: str, hidden, layers, heads, kv_heads, mlp, vocab, positions):
    """The published shape as its family's own config mapping builds it."""
    from parallel_latent.feature_model.families import FAMILIES

    return FAMILIES[family].random_config(vocab, layers, heads, hidden, positions, kv_heads, mlp)


@dataclasses.dataclass(frozen=True)
class Held:
    """What the cut decoder holds: per held layer its matrix elements, the whole-kept elements."""

    layers: int
    layer_matrices: int  # elements of one held layer's matrices (what shard splits)
    replicated: int  # token table, positions, norms: whole on every rank
    width: int
    family: str
    config: object  # the transformers config, for feature_model/sharded.py's check


def held_on_meta(name: str) -> Held:
    import torch
    from transformers import AutoModel

    from parallel_latent.feature_model.families import FAMILIES, held_layers
    from parallel_latent.feature_model.features import truncate_to_hidden_state

    family_name, hidden, layers, *_ = MODELS[name]
    family = FAMILIES[family_name]
    config = transformers_config(family_name, *MODELS[name][1:])
    setattr(config, family.layers_key, held_layers(layers, -3, family, name))
    with torch.device("meta"):
        decoder = AutoModel.from_config(config)
    truncate_to_hidden_state(decoder, -3, depth=layers)
    stack = getattr(decoder, family.layers)
    per_layer = sum(p.numel() for p in stack[0].parameters() if p.dim() == 2)
    replicated = sum(p.numel() for p in decoder.parameters()) - per_layer * len(stack)  # the norms and biases too
    return Held(len(stack), per_layer, replicated, hidden, family_name, config)


def shard_refusal(held: Held, tp: int) -> str | None:
    """Why ``shard`` refuses this decoder at ``tp`` (feature_model/sharded.py's check itself), or None."""
    from parallel_latent.feature_model.families import FAMILIES
    from parallel_latent.feature_model.sharded import check_shardable

    try:
        check_shardable(FeatureModelConfig(parallel="shard"), FAMILIES[held.family], held.config, tp)
    except ConfigError as refusal:
        return str(refusal)
    return None


def frozen_seconds(held: Held, tp: int, layout: str, batch: int, length: int) -> float:
    """One rank's frozen pass over ``batch`` samples of ``length`` tokens (docs/development.md, Benchmarks)."""
    samples = batch / tp if layout == "replicate" else batch
    split = tp if layout == "shard" else 1
    tokens = samples * length
    per_layer = matmul_seconds(2 * tokens * held.layer_matrices / split, BYTES * held.layer_matrices / split, PINNED)
    per_layer += 4 * samples * length * length * held.width / split / PINNED.big_matmul_rate
    seconds, features = held.layers * per_layer, BYTES * batch * length * held.width
    if tp > 1 and layout == "replicate":
        seconds += collective_seconds("all_gather", features, tp)
    if tp > 1 and layout == "shard":
        seconds += held.layers * 2 * collective_seconds("all_reduce", features, tp)
    return seconds


def frozen_rows(held: Held, batch: int, length: int):
    """(layout, tp, refusal or None, GiB per rank, ms per rank) at every layout and TP degree."""
    for layout in LAYOUTS:
        for tp in TP_DEGREES:
            if refusal := (shard_refusal(held, tp) if layout == "shard" else None):
                yield layout, tp, refusal, None, None
                continue
            split = tp if layout == "shard" else 1
            gib = BYTES * (held.replicated + held.layers * held.layer_matrices / split) / 2**30
            yield layout, tp, None, gib, frozen_seconds(held, tp, layout, batch, length) * 1e3


def feature_model_setting(name: str) -> dict:
    """The overrides that make the rows' model read decoder ``name``'s features (its shape: feature_model_record)."""
    family, hidden, layers, heads, kv_heads, _, _, positions = MODELS[name]
    setting = {"feature_model.architecture": family, "feature_model.n_layer": layers, "feature_model.n_head": heads,
               "feature_model.n_embd": hidden, "feature_model.n_positions": positions, "model.d_model": hidden,
               "model.n_heads": hidden // 128}  # fmt: skip
    if kv_heads != heads:  # grouped-query attention
        setting["feature_model.n_kv_head"] = kv_heads
    return {key: str(value) for key, value in setting.items()}


def feature_model_record(name: str) -> dict:
    """Decoder ``name``'s whole transformers config (its own MLP width: a random build from the few
    ``feature_model.n_*`` keys has 4x its width), which the trace rebuilds the feature model from."""
    return transformers_config(*MODELS[name]).to_dict()


# The collectives a trace at TP > 1 holds (the model's own, dispatched on a fake group): what each
# does, and which of the operands it reads is its whole tensor.
COLLECTIVES = {
    "c10d.allreduce_": ("all_reduce", sum),  # the tensors it reduces in place
    "c10d._allgather_base_": ("all_gather", max),  # the gathered output (the input is 1/tp of it)
    "c10d._reduce_scatter_base_": ("reduce_scatter", max),  # the scattered input
    "c10d.allgather_": ("all_gather", lambda sizes: sum(sizes[:-1])),  # one output per rank, then the input
}


def collective_of(op: Op) -> tuple[str, int]:
    """(what a traced collective does, the bytes of its whole tensor)."""
    base = op.name.rsplit(".", 1)[0]
    if base not in COLLECTIVES:
        raise ValueError(f"{op.name}: a collective whose time the projection does not model")
    kind, whole = COLLECTIVES[base]
    return kind, whole([nbytes for *_, nbytes in op.reads])


def perceiver_at(name: str, setting: dict, quick: bool, tp: int) -> dict:
    """One rank's part of the model's forward and backward at TP=``tp`` over decoder ``name``, less the frozen
    pass: traced over a fake group, its kernels timed as the TP=1 rows', its collectives at NVLink's rate."""
    recorded = feature_model_record(name)
    cfg = row_config({**setting, **feature_model_setting(name), "parallel.tensor_parallel": str(tp)}, quick)
    with fake_tp_group(tp) as group:
        ops = trace_model(cfg, "cuda", tp_group=group, recorded=recorded)
    ours = [op for op in ops if op.part != "features"]
    kernels = [k for k in kernels_of(ops) if k.part != "features" and not k.collective]
    collectives = [collective_of(op) for op in ours if op.kind == "collective"]
    return {
        "compute": projection(kernels, 0.0), "kernels": kernels, "collectives": collectives,
        "matmul_flops": sum(op.flops for op in ours), "matmul_ms": sum(k.device_s for k in kernels if k.flops) * 1e3,
        "collective_ms": sum(collective_seconds(kind, nbytes, tp) for kind, nbytes in collectives) * 1e3,
    }  # fmt: skip


def whole_steps(name: str, setting: dict, quick: bool, tps: tuple[int, ...] | None = None) -> list[dict]:
    """Per TP degree (``tps``, by default all) and layout, one rank's forward and backward: the Perceiver
    (:func:`perceiver_at`), then the frozen pass; a rank's tokens and FLOPs are 1/tp of its group's."""
    held, cfg = held_on_meta(name), row_config({**setting, **feature_model_setting(name)}, quick)
    batch, length = cfg.training.micro_batch_size, cfg.model.max_length
    flops = model_flops(cfg, feature_model_record(name))
    rows = []
    for tp in tps or TP_DEGREES:
        try:
            ours = perceiver_at(name, setting, quick, tp)
        except ConfigError as refusal:
            rows += [{"tp": tp, "layout": layout, "refused": str(refusal)} for layout in LAYOUTS]
            continue
        for layout in LAYOUTS:
            if refusal := (shard_refusal(held, tp) if layout == "shard" else None):
                rows.append({"tp": tp, "layout": layout, "refused": refusal})
                continue
            frozen_ms = frozen_seconds(held, tp, layout, batch, length) * 1e3
            step_ms = ours["compute"]["step_ms_overlapped"] + ours["collective_ms"] + frozen_ms
            rows.append({"tp": tp, "layout": layout, "perceiver": ours, "frozen_ms": frozen_ms, "step_ms": step_ms,
                         "tokens_per_s": batch * length / tp / (step_ms / 1e3),
                         "mfu": flops / tp / (step_ms / 1e3) / PEAK_FLOPS})  # fmt: skip
    return rows
