"""``feature_model.parallel=shard``: the frozen decoder's held layers split over the TP group (Megatron
layout), every rank running the whole batch. Against the replicated decoder built in the same rank
(features within a derived bound, a missing all-reduce far outside it), random builds and a decoder
read slice by slice from its safetensors (GPT-2's c_attn as three ranges, never whole); 1/tp of the
projections per rank; two all-reduces per layer; the autoencoder's loss and gradients at TP=2 and 4;
portable checkpoints across the layouts and TP degrees; and the refusals in one line. Real gloo
ranks (tests/conftest.py's pools)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import GPT2Config, LlamaForCausalLM, Qwen2Config, Qwen3Config

from parallel_latent.api import load_autoencoder
from parallel_latent.checkpoint import load_portable, save_portable
from parallel_latent.config import ConfigError, FeatureModelConfig, config_from_dict
from parallel_latent.model import FeatureModel, LatentAutoencoder
from parallel_latent.model.features import random_features_unannounced
from parallel_latent.model.sharded import COLUMN, PROJECTIONS, ROW, _SafetensorsWeights, sharded_projection_weights
from parallel_latent.parallel import initialize_model_parallel
from parallel_latent.training.report import tp_options_line
from tests.helpers.checkpoint_stack import gathered_state
from tests.helpers.decoders import WIDTH, save_tiny_decoder, small_tokenizer
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
    "gpt2": FeatureModelConfig(architecture="gpt2", n_layer=4, n_head=4, n_embd=32, parallel="shard"),
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
    heads, mlp = config.num_attention_heads, model.family.mlp_width(config)
    mlp_terms = (2 * f + mlp) if model.family.name == "llama" else (f + mlp)
    return model.blocks * (2 * f + f + f // heads + 2 * length + f + tp + mlp_terms + tp + 16)


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (B, LENGTH), generator=torch.Generator().manual_seed(1))
    return ids, torch.ones_like(ids)


def projection_elements(model: FeatureModel, split_only: bool) -> int:
    """Elements of the held layers' projections (weights, and biases of the column-split ones)."""
    total = 0
    for layer in getattr(model.decoder, model.family.layers):
        for path, kind in PROJECTIONS[model.family.name].items():
            linear = layer.get_submodule(path)
            total += linear.weight.numel()
            if linear.bias is not None and (kind == COLUMN or not split_only):
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
        for path, kind in PROJECTIONS[sharded.family.name].items():
            if kind == ROW:
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
    out = {family: save_tiny_decoder(root / family, family, tokenizer) for family in ("gpt2", "gpt_neox", "llama")}
    LlamaForCausalLM.from_pretrained(out["llama"]).save_pretrained(root / "llama-index", max_shard_size="20kB")
    out["llama-index"] = root / "llama-index"
    assert (out["llama-index"] / "model.safetensors.index.json").is_file()
    return out


def pretrained_shard(directory) -> FeatureModelConfig:
    return FeatureModelConfig(name_or_path=str(directory), pretrained=True, hidden_state=-2, parallel="shard")


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "llama", "llama-index"])
def test_a_pretrained_decoder_read_slice_by_slice_equals_the_whole_one(pool4, saved, family):
    """The tiny decoders (tests/helpers/decoders.py: NeoX with partial rotary, Llama with grouped
    kv heads and an MLP width that is not 4x), the held layers of hidden state -2 only."""
    assert_sharded_equals_whole(pool4.run(features_task, 2, pretrained_shard(saved[family]), 514), 2, family)


class RecordingSlice:
    """A safetensors slice that records each index read from it."""

    def __init__(self, piece, reads: list):
        self.piece, self.reads = piece, reads

    def get_shape(self):
        return self.piece.get_shape()

    def __getitem__(self, index):
        self.reads.append(index)
        return self.piece[index]


def reads_task(tp: int, directory: str) -> dict[str, list]:
    """The indices read from each tensor of ``directory``'s safetensors as the sharded decoder is built."""
    group = initialize_model_parallel(tp).tp_group
    reads, opened = {}, _SafetensorsWeights._open
    _SafetensorsWeights._open = lambda self, name: RecordingSlice(opened(self, name), reads.setdefault(name, []))
    try:
        FeatureModel(pretrained_shard(directory), 514, tp_group=group)
    finally:
        _SafetensorsWeights._open = opened
    return reads


def test_gpt2_c_attn_is_read_as_three_ranges_never_whole(pool4, saved):
    """A rank's heads of c_attn ([in, out]: q of all heads, then k, then v) are its half of each."""
    half, mlp_half = WIDTH // 2, 4 * WIDTH // 2
    for rank, reads in enumerate(pool4.run(reads_task, 2, str(saved["gpt2"]))):
        tp_rank = rank % 2
        columns = [slice(j * WIDTH + tp_rank * half, j * WIDTH + (tp_rank + 1) * half) for j in range(3)]
        assert reads["h.0.attn.c_attn.weight"] == [(slice(None), c) for c in columns], rank
        assert reads["h.0.attn.c_attn.bias"] == [(c,) for c in columns], rank
        assert reads["h.0.mlp.c_proj.weight"] == [(slice(tp_rank * mlp_half, (tp_rank + 1) * mlp_half),)], rank
        assert reads["h.0.ln_1.weight"] == [slice(None)], rank


# ----------------------------------------------------------------------------- the autoencoder


def autoencoder_configs(parallel: str = "shard", family: str = "llama"):
    model_cfg, _ = tiny_configs(0.0)
    feature_cfg = dataclasses.replace(
        random_build(family, 4), n_embd=D, n_positions=64, hidden_state=-2, parallel=parallel
    )
    return model_cfg, feature_cfg


def autoencoder_task(tp: int, family: str) -> dict:
    group = initialize_model_parallel(tp).tp_group
    model_cfg, feature_cfg = autoencoder_configs(family=family)
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


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("tp", [2, 4])
def test_the_autoencoder_over_a_sharded_decoder_equals_tp1(pool4, tp, family):
    for rank, res in enumerate(pool4.run(autoencoder_task, tp, family)):
        assert res["sharded"], rank
        assert res["banner"].startswith("frozen decoder sharded over the TP group (feature_model.parallel=shard: 1/tp")
        for key in ("loss", "grads"):
            diff, bound = res[key]
            assert diff <= bound, f"{family} rank {rank} tp={tp}: {key} differs by {diff:.3g} > {bound:.3g}"


@torch.no_grad()
def loss_of(model: LatentAutoencoder) -> float:
    return model.eval()(*tiny_batch(seed=3)).loss.item()


def save_sharded_task(tp: int, directory: str, family: str):
    group = initialize_model_parallel(tp).tp_group
    model = LatentAutoencoder(*autoencoder_configs(family=family), tp_group=group, seed=1)
    save_portable(model, directory, tp_group=group)
    return loss_of(model), gathered_state(model, group)


def load_sharded_task(tp: int, directory: str, family: str):
    group = initialize_model_parallel(tp).tp_group
    model = LatentAutoencoder(*autoencoder_configs(family=family), tp_group=group, seed=2)  # all overwritten
    load_portable(directory, model, group)
    return loss_of(model), gathered_state(model, group)


def assert_same_tensors(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys(), where
    assert all(torch.equal(got[n], want[n]) for n in want), where


@pytest.mark.parametrize(("family", "saved_tp", "load_tp"), [("gpt2", 2, 4), ("llama", 4, 2)])
def test_portable_checkpoints_hold_the_same_tensors_in_either_layout(pool4, tmp_path, family, saved_tp, load_tp):
    """Saved sharded: the full tensors of the replicated decoder of the same seed, loaded whole in
    one process (by the API, and into a replicate model) and sharded at another TP degree (GPT-2's
    c_attn re-cut from 2 ranks' strided shards for 4). Saved whole: loaded sharded."""

    def replicated(seed: int) -> LatentAutoencoder:
        return LatentAutoencoder(*autoencoder_configs("replicate", family), seed=seed)

    k = reduction_length_of_model(4) + decoder_reduction_length(replicated(1).feature_model, T, 4)

    def assert_close(got: float, want: float) -> None:
        assert abs(got - want) <= order_bound(k, terms_scale(abs(want), k))

    sharded_dir = tmp_path / "sharded"
    loss, state = pool4.run(save_sharded_task, saved_tp, str(sharded_dir), family)[0]
    assert_same_tensors(state, gathered_state(replicated(1), None), "saved")
    replicate = replicated(2)
    load_portable(sharded_dir, replicate)
    for model in (load_autoencoder(sharded_dir), replicate):
        assert_close(loss_of(model), loss)
        assert_same_tensors(gathered_state(model, None), state, "loaded whole")
    for got_loss, got_state in pool4.run(load_sharded_task, load_tp, str(sharded_dir), family):
        assert_close(got_loss, loss)
        assert_same_tensors(got_state, state, f"loaded at TP={load_tp}")
    whole_dir = tmp_path / "whole"
    whole = replicated(3)
    save_portable(whole, whole_dir)
    want, want_state = loss_of(whole), gathered_state(whole, None)
    for got_loss, got_state in pool4.run(load_sharded_task, load_tp, str(whole_dir), family):
        assert_close(got_loss, want)
        assert_same_tensors(got_state, want_state, f"saved whole, loaded at TP={load_tp}")


# ----------------------------------------------------------------------------- refusals


def build_task(tp: int, cases: list[tuple[FeatureModelConfig, dict | None]]) -> list[str]:
    """Why each (config, recorded transformers config) cannot be built at ``tp`` ("" if it can)."""
    group = initialize_model_parallel(tp).tp_group
    messages = []
    for feature_cfg, recorded in cases:
        try:
            FeatureModel(feature_cfg, VOCAB, recorded, tp_group=group)
            messages.append("")
        except ConfigError as refused:
            messages.append(str(refused))
    return messages


def test_what_cannot_be_sharded_is_one_line(pool4):
    kv = dataclasses.replace(RANDOM["llama"], n_head=8, n_kv_head=2)  # 2 kv heads over 4 ranks
    gpt2_heads = dataclasses.replace(RANDOM["gpt2"], n_head=2, n_embd=16)
    gpt2_mlp = GPT2Config(vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32, n_inner=42).to_dict()
    trainable = dataclasses.replace(RANDOM["llama"], frozen=False)
    cases = [(kv, None), (gpt2_heads, None), (RANDOM["gpt2"], gpt2_mlp), (trainable, None)]
    messages = pool4.run(build_task, 4, cases)[0]
    assert all(message and "\n" not in message for message in messages), messages
    assert messages[0].startswith("parallel.tensor_parallel=4 does not divide the 2 key/value heads of the feature")
    assert "(Llama, 8 heads)" in messages[0]
    assert messages[1].startswith("parallel.tensor_parallel=4 does not divide the 2 attention heads of the feature")
    assert "(GPT-2, 2 heads)" in messages[1]
    assert messages[2].startswith("parallel.tensor_parallel=4 does not divide the 42 MLP width of the feature")
    assert messages[3].startswith("feature_model.parallel=shard needs feature_model.frozen=true")


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
