"""``feature_model.parallel=shard``: the frozen decoder's held layers split over the TP group (Megatron
layout), every rank running the whole batch. Against the replicated decoder built in the same rank
(features within a derived bound, a missing all-reduce far outside it), random builds and a decoder
read slice by slice from its safetensors; 1/tp of the projections per rank; two all-reduces per
layer; the autoencoder's loss and gradients at TP=2 and 4; portable checkpoints across the layouts;
and the refusals in one line. Real gloo ranks (tests/conftest.py's pools)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaForCausalLM, Qwen2Config, Qwen3Config

from parallel_latent.api import load_autoencoder
from parallel_latent.checkpoint import load_portable, save_portable
from parallel_latent.config import ConfigError, FeatureModelConfig, config_from_dict
from parallel_latent.model import FeatureModel, LatentAutoencoder
from parallel_latent.model.features import random_features_unannounced
from parallel_latent.model.sharded import PROJECTIONS, sharded_projection_weights
from parallel_latent.parallel import initialize_model_parallel
from parallel_latent.training.report import tp_options_line
from tests.helpers.checkpoint_stack import gathered_state
from tests.helpers.decoders import save_tiny_decoder, small_tokenizer
from tests.helpers.pool_training import train_in_pool
from tests.helpers.tiny_model import D, T, reduction_length_of_model, tiny_batch, tiny_configs
from tests.helpers.tp_compare import (
    count_collectives,
    max_abs,
    max_param_diff,
    order_bound,
    terms_scale,
)

B, LENGTH, VOCAB = 3, 12, 300
RANDOM = {
    "gpt_neox": FeatureModelConfig(architecture="gpt_neox", n_layer=4, n_head=4, n_embd=32, parallel="shard"),
    "llama": FeatureModelConfig(architecture="llama", n_layer=4, n_head=4, n_embd=32, n_kv_head=2, parallel="shard"),
}


def random_build(family: str, tp: int) -> FeatureModelConfig:
    """RANDOM[family], with 8 heads in 4 kv groups where 4 ranks split a llama's 2 kv heads."""
    if family == "llama" and tp == 4:
        return dataclasses.replace(RANDOM[family], n_head=8, n_kv_head=4)
    return RANDOM[family]


def decoder_reduction_length(model: FeatureModel, length: int, tp: int) -> int:
    """Terms summed on the path through the held layers (see tests/helpers/tp_compare.py): per layer
    two norms, q/k/v, scores (head width), softmax and weighted sums (T each), the output projection
    and its all-reduce (tp), the MLP's products (gated: two in, one out) and its all-reduce, and 16
    roundings for elementwise activations and rotary steps."""
    config, f = model.decoder_config, model.width
    heads, mlp = config.num_attention_heads, config.intermediate_size
    mlp_terms = (2 * f + mlp) if model.family.name == "llama" else (f + mlp)
    return model.blocks * (2 * f + f + f // heads + 2 * length + f + tp + mlp_terms + tp + 16)


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (B, LENGTH), generator=torch.Generator().manual_seed(1))
    return ids, torch.ones_like(ids)


def projection_elements(model: FeatureModel, split_only: bool) -> int:
    """Elements of the held layers' projections (weights, and biases of the column-split ones)."""
    total = 0
    for layer in getattr(model.decoder, model.family.layers):
        for path, dim in PROJECTIONS[model.family.name].items():
            linear = layer.get_submodule(path)
            total += linear.weight.numel()
            if linear.bias is not None and (dim == 0 or not split_only):
                total += linear.bias.numel()
    return total


def full_shape(param: torch.Tensor, tp: int) -> torch.Size:
    """The shape of ``param`` reassembled over the TP group (its own if it is not split)."""
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp
    return torch.Size(shape)


def features_task(tp: int, feature_cfg: FeatureModelConfig, vocab: int, recorded: dict | None = None) -> dict:
    """The sharded decoder at ``tp`` against the replicated one, in this rank (``recorded``: both
    rebuilt from a checkpoint's transformers config)."""
    group = initialize_model_parallel(tp).tp_group
    with random_features_unannounced():
        torch.manual_seed(0)
        whole = FeatureModel(dataclasses.replace(feature_cfg, parallel="replicate"), vocab, recorded, group)
        torch.manual_seed(0)
        sharded = FeatureModel(feature_cfg, vocab, recorded, group)
    ids, mask = batch(vocab)
    want = whole(ids, mask)
    log, restore = count_collectives()
    try:
        got = sharded(ids, mask)
    finally:
        restore()
    n = decoder_reduction_length(whole, LENGTH, tp)
    for layer in getattr(sharded.decoder, sharded.family.layers):  # a broken variant: no all-reduce at all
        for path, dim in PROJECTIONS[sharded.family.name].items():
            if dim == 1:
                layer.get_submodule(path).tp_group = None
    broken = sharded(ids, mask)
    return {
        "diff": (got - want).abs().max().item(),
        "bound": order_bound(n, terms_scale(max_abs([want]), n)),
        "broken": (broken - want).abs().max().item(),
        "collectives": log,
        "expected_collectives": [("all_reduce", B * LENGTH * whole.width, "SUM")] * (2 * whole.blocks),
        "same_table": torch.equal(sharded.token_table, whole.token_table),
        "split_elements": sharded_projection_weights(sharded.decoder, sharded.family),
        "whole_split_elements": projection_elements(whole, split_only=True),
        "other_elements": (
            sum(p.numel() for p in sharded.parameters()) - sharded_projection_weights(sharded.decoder, sharded.family),
            sum(p.numel() for p in whole.parameters()) - projection_elements(whole, split_only=True),
        ),
        "matmul_weights": (sharded.matmul_weights, whole.matmul_weights),
        "names": [n for n, _ in sharded.named_parameters()] == [n for n, _ in whole.named_parameters()],
        "full_shapes": [full_shape(p, tp) for p in sharded.parameters()] == [p.shape for p in whole.parameters()],
    }


def assert_sharded_equals_whole(results: list[dict], tp: int, label: str) -> None:
    for rank, res in enumerate(results):
        where = f"{label} tp={tp} rank {rank}"
        assert res["diff"] <= res["bound"], f"{where}: features differ by {res['diff']:.3g} > {res['bound']:.3g}"
        assert res["broken"] > 10 * res["bound"], f"{where}: the bound cannot tell a missing all-reduce"
        assert res["collectives"] == res["expected_collectives"], where
        assert res["same_table"], f"{where}: the token tables differ"
        # 1/tp of the split projections per rank, exactly; everything else whole; the FLOPs the whole model's.
        assert res["split_elements"] * tp == res["whole_split_elements"], where
        assert res["other_elements"][0] == res["other_elements"][1], where
        assert res["matmul_weights"][0] == res["matmul_weights"][1], where
        assert res["names"] and res["full_shapes"], f"{where}: names or full shapes differ from the replicated decoder"


@pytest.mark.parametrize("family", sorted(RANDOM))
def test_random_builds_sharded_equal_the_whole_decoder(pool4, family):
    for tp in (2, 4):
        assert_sharded_equals_whole(pool4.run(features_task, tp, random_build(family, tp), VOCAB), tp, family)


def test_qwen_layouts_rebuilt_from_a_record_shard_too(pool4):
    """The llama family's variants as a checkpoint's record rebuilds them: Qwen2's q/k/v biases
    (split with their columns) and Qwen3's per-head q/k norms (whole on every rank)."""
    shape = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, max_position_embeddings=64, head_dim=8,
    )  # fmt: skip
    cfg = dataclasses.replace(RANDOM["llama"], hidden_state=-2)
    for record in (Qwen2Config(**shape).to_dict(), Qwen3Config(**shape).to_dict()):
        assert_sharded_equals_whole(pool4.run(features_task, 2, cfg, VOCAB, record), 2, record["model_type"])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Tiny decoders of tests/helpers/decoders.py, and the Llama again in safetensors shards of
    20 kB with their index, as large models ship."""
    tokenizer = small_tokenizer()
    root = tmp_path_factory.mktemp("decoders")
    out = {family: save_tiny_decoder(root / family, family, tokenizer) for family in ("gpt_neox", "llama")}
    LlamaForCausalLM.from_pretrained(out["llama"]).save_pretrained(root / "llama-index", max_shard_size="20kB")
    out["llama-index"] = root / "llama-index"
    assert (out["llama-index"] / "model.safetensors.index.json").is_file()
    return out


@pytest.mark.parametrize("family", ["gpt_neox", "llama", "llama-index"])
def test_a_pretrained_decoder_read_slice_by_slice_equals_the_whole_one(pool4, saved, family):
    """The tiny decoders (tests/helpers/decoders.py: NeoX with partial rotary, Llama with grouped
    kv heads and an MLP width that is not 4x), the held layers of hidden state -2 only."""
    cfg = FeatureModelConfig(name_or_path=str(saved[family]), pretrained=True, hidden_state=-2, parallel="shard")
    assert_sharded_equals_whole(pool4.run(features_task, 2, cfg, 514), 2, family)


# ----------------------------------------------------------------------------- the autoencoder


def autoencoder_configs(parallel: str = "shard"):
    model_cfg, _ = tiny_configs(0.0)
    feature_cfg = dataclasses.replace(
        random_build("llama", 4), n_embd=D, n_positions=64, hidden_state=-2, parallel=parallel
    )
    return model_cfg, feature_cfg


def autoencoder_task(tp: int) -> dict:
    group = initialize_model_parallel(tp).tp_group
    model_cfg, feature_cfg = autoencoder_configs()
    ref = LatentAutoencoder(model_cfg, feature_cfg, seed=1).train()  # TP=1: nothing to shard
    par = LatentAutoencoder(model_cfg, feature_cfg, tp_group=group, seed=1).train()
    ids, mask = tiny_batch(seed=0)
    losses = []
    for model in (ref, par):
        loss = model(ids, mask).loss
        loss.backward()
        losses.append(loss)
    # The features' own path comes before the autoencoder's.
    k = reduction_length_of_model(tp) + decoder_reduction_length(ref.feature_model, T, tp)
    grad_scale = max_abs([p.grad for p in ref.parameters() if p.requires_grad])
    cfg = config_from_dict({"feature_model": {"parallel": "shard"}, "parallel": {"tensor_parallel": tp}})
    return {
        "banner": tp_options_line(cfg, par),
        "sharded": par.feature_model.sharded and not par.split_feature_model,
        "loss": ((losses[0] - losses[1]).abs().item(), order_bound(k, terms_scale(abs(losses[0].item()), k))),
        "grads": (
            max(max_param_diff(ref, par, group, grads=True).values()),
            order_bound(k, terms_scale(grad_scale, k)),
        ),
    }


@pytest.mark.parametrize("tp", [2, 4])
def test_the_autoencoder_over_a_sharded_decoder_equals_tp1(pool4, tp):
    for rank, res in enumerate(pool4.run(autoencoder_task, tp)):
        assert res["sharded"], rank
        assert res["banner"].startswith("frozen decoder sharded over the TP group (feature_model.parallel=shard: 1/tp")
        for key in ("loss", "grads"):
            diff, bound = res[key]
            assert diff <= bound, f"rank {rank} tp={tp}: {key} differs by {diff:.3g} > {bound:.3g}"


@torch.no_grad()
def loss_of(model: LatentAutoencoder) -> float:
    return model.eval()(*tiny_batch(seed=3)).loss.item()


def save_sharded_task(tp: int, directory: str):
    group = initialize_model_parallel(tp).tp_group
    model = LatentAutoencoder(*autoencoder_configs(), tp_group=group, seed=1)
    save_portable(model, directory, tp_group=group)
    return loss_of(model), gathered_state(model, group)


def load_sharded_task(tp: int, directory: str):
    group = initialize_model_parallel(tp).tp_group
    model = LatentAutoencoder(*autoencoder_configs(), tp_group=group, seed=2)  # other weights, all overwritten
    load_portable(directory, model, group)
    return loss_of(model), gathered_state(model, group)


def test_portable_checkpoints_hold_the_same_tensors_in_either_layout(pool4, tmp_path):
    k = reduction_length_of_model(4) + decoder_reduction_length(
        LatentAutoencoder(*autoencoder_configs(), seed=1).feature_model, T, 4
    )
    # Saved sharded at TP=4, loaded whole in one process: by the API, and into a replicate model.
    sharded_dir = tmp_path / "sharded"
    loss, state = pool4.run(save_sharded_task, 4, str(sharded_dir))[0]
    replicate = LatentAutoencoder(*autoencoder_configs("replicate"), seed=2)
    load_portable(sharded_dir, replicate)
    for model in (load_autoencoder(sharded_dir), replicate):
        assert abs(loss_of(model) - loss) <= order_bound(k, terms_scale(abs(loss), k))
        got = gathered_state(model, None)
        assert got.keys() == state.keys() and all(torch.equal(got[n], state[n]) for n in state)
    # Saved whole, loaded sharded at TP=4.
    whole_dir = tmp_path / "whole"
    whole = LatentAutoencoder(*autoencoder_configs("replicate"), seed=3)
    save_portable(whole, whole_dir)
    want, want_state = loss_of(whole), gathered_state(whole, None)
    for got_loss, got_state in pool4.run(load_sharded_task, 4, str(whole_dir)):
        assert abs(got_loss - want) <= order_bound(k, terms_scale(abs(want), k))
        assert all(torch.equal(got_state[n], want_state[n]) for n in want_state)


# ----------------------------------------------------------------------------- refusals


def build_task(tp: int, feature_cfg: FeatureModelConfig) -> str:
    group = initialize_model_parallel(tp).tp_group
    try:
        FeatureModel(feature_cfg, VOCAB, tp_group=group)
    except ConfigError as refused:
        return str(refused)
    return ""


def test_what_cannot_be_sharded_is_one_line(pool4):
    kv = dataclasses.replace(RANDOM["llama"], n_head=8, n_kv_head=2)  # 2 kv heads over 4 ranks
    gpt2 = FeatureModelConfig(architecture="gpt2", n_layer=2, n_head=4, n_embd=32, parallel="shard")
    trainable = dataclasses.replace(RANDOM["llama"], frozen=False)
    messages = [pool4.run(build_task, 4, cfg)[0] for cfg in (kv, gpt2, trainable)]
    assert all(message and "\n" not in message for message in messages), messages
    assert messages[0].startswith("parallel.tensor_parallel=4 does not divide the 2 key/value heads of the feature")
    assert "(Llama, 8 heads)" in messages[0]
    assert messages[1].startswith("feature_model.parallel=shard does not support GPT-2 decoders")
    assert messages[2].startswith("feature_model.parallel=shard needs feature_model.frozen=true")


def test_the_config_refuses_shard_with_a_trainable_decoder_or_zero3():
    with pytest.raises(ConfigError, match=r"feature_model\.parallel=shard needs feature_model\.frozen=true"):
        config_from_dict({"feature_model": {"parallel": "shard", "frozen": False}})
    with pytest.raises(
        ConfigError, match=r"feature_model\.parallel=shard is not supported with parallel\.zero_stage=3"
    ):
        config_from_dict({"feature_model": {"parallel": "shard"}, "parallel": {"tensor_parallel": 2, "zero_stage": 3}})
    config_from_dict({"feature_model": {"parallel": "shard"}, "parallel": {"tensor_parallel": 2, "zero_stage": 2}})


def test_a_trainer_runs_over_a_sharded_decoder(pool4, tmp_path):
    """TP=2 x DP=2 under ZeRO-2, a training checkpoint and a portable export: the banner says how
    the frozen pass runs."""
    out, _ = train_in_pool(
        pool4, tmp_path / "run", "parallel.tensor_parallel=2", "feature_model.parallel=shard",
        "feature_model.architecture=llama", "feature_model.n_kv_head=2", "training.max_steps=2",
        "checkpoint.export_portable=true",
    )  # fmt: skip
    assert "tensor parallelism: frozen decoder sharded over the TP group" in out and "done: 2 steps" in out
