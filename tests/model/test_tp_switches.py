"""The three TP throughput switches on the whole autoencoder: the split frozen feature pass,
sequence parallelism and the overlapped backward collective. Each leaves the model the TP=1 model
(tests/model/test_autoencoder_tp.py runs the equality checks with them on); here: exactly which
collectives they cost, and that a checkpoint saved with one setting loads with the other."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from parallel_latent.checkpoint import CheckpointError, load_portable, save_portable
from parallel_latent.model import LatentAutoencoder
from parallel_latent.parallel import TensorParallelOptions, initialize_model_parallel
from parallel_latent.parallel.mappings import split_along_sequence
from tests.helpers.autoencoder_tp import COMPRESSED, assert_equals_tp1, compare_with_tp1
from tests.helpers.tiny_model import VOCAB, B, D, T, reduction_length_of_model, tiny_batch, tiny_configs
from tests.helpers.tp_compare import collectives_of, gather_full, max_abs, order_bound, terms_scale

GATHER, SCATTER = "all_gather_single", "reduce_scatter_single"
SP = TensorParallelOptions(sequence_parallel=True)


def collectives(tp: int, model_overrides: dict | None = None, **options) -> dict:
    state = initialize_model_parallel(tp)
    configs = tiny_configs(dropout=0.0, **(model_overrides or {}))
    model = LatentAutoencoder(*configs, tp_group=state.tp_group, seed=1, **options).train()
    ids, mask = tiny_batch()
    forward, backward = collectives_of(lambda: model(ids, mask).loss)
    sequence_parallel_params = [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]
    return {
        "forward": [(name, numel) for name, numel, _ in forward],
        "backward": [(name, numel) for name, numel, _ in backward],
        "sp_params": sorted(p.numel() for p in sequence_parallel_params if p.requires_grad),
        "sp_names": sorted(n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)),
        "sp_sizes": {n: p.numel() for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)},
        "blocks": len(model.encoder.stack.blocks) + len(model.decoder.stack.blocks),
    }


def test_the_split_feature_pass_adds_one_all_gather_forward_and_nothing_backward(pool4):
    for tp in (2, 4):
        split = pool4.run(collectives, tp)[0]
        replicated = pool4.run(collectives, tp, split_feature_model=False)[0]
        extra = Counter(split["forward"]) - Counter(replicated["forward"])
        assert extra == Counter({(GATHER, B * T * D): 1}), (tp, extra)  # the features [B, T, f], f = d
        assert Counter(replicated["forward"]) - Counter(split["forward"]) == Counter()
        assert split["backward"] == replicated["backward"]


def test_sequence_parallel_blocks_cost_two_all_gathers_and_two_reduce_scatters_each_way(pool4):
    """Per block: the attention entry all-gathers cat(context, stream), the MLP entry the stream,
    both exits reduce-scatter; backward the transposes. Outside the blocks: the split feature pass
    (one all-gather of the features), the head's entry (an all-gather of the decoder's output), the
    loss's [B, T] reductions and the query MLP (a replicated d-sized computation). The gradients of
    the parameters used on 1/tp of the positions are summed over the group: one all-reduce each,
    of the parameter's size."""
    for tp in (2, 4):
        res = pool4.run(collectives, tp, tp_options=SP)[0]
        blocks, stream, joint = res["blocks"], B * T * D, B * 2 * T * D
        forward = Counter(res["forward"])
        assert forward[(GATHER, joint)] == blocks  # attention entries (context and stream: T each)
        # MLP entries, the head's entry, and the features (B x T x f, f = d) of the split pass.
        assert forward[(GATHER, stream)] == blocks + 2
        assert forward[(SCATTER, stream // tp)] == 2 * blocks
        assert sum(n for (name, _), n in forward.items() if name in (GATHER, SCATTER)) == 4 * blocks + 2
        assert all(numel <= 2 * B * T for name, numel in forward if name == "all_reduce")  # loss, query MLP
        backward = Counter(res["backward"])
        assert backward[(SCATTER, joint // tp)] == blocks
        assert backward[(SCATTER, stream // tp)] == blocks + 1  # MLP entries, head entry
        assert backward[(GATHER, stream)] == 2 * blocks  # the exits' transposes
        assert sum(n for (name, _), n in backward.items() if name in (GATHER, SCATTER)) == 4 * blocks + 1
        # Every other backward collective sums a parameter-sized gradient, no activation: one per
        # sequence-parallel parameter, and one for the query (d), computed once for every position.
        reduced = sorted(numel for name, numel in res["backward"] if name == "all_reduce")
        assert reduced == sorted([*res["sp_params"], D]), (tp, reduced, res["sp_params"])


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_sequence_parallel_model_equals_tp1(pool4, tp, dropout):
    assert_equals_tp1(pool4.run(compare_with_tp1, tp, dropout, tp_options=SP), f"SP tp={tp} dropout={dropout}")


@pytest.mark.parametrize(
    ("label", "options"),
    [
        ("replicated feature pass", {"split_feature_model": False}),
        ("no overlap", {"tp_options": TensorParallelOptions(overlap_comm=False)}),
        ("SP, no overlap", {"tp_options": TensorParallelOptions(sequence_parallel=True, overlap_comm=False)}),
    ],
)
def test_every_switch_setting_equals_tp1(pool4, label, options):
    assert_equals_tp1(pool4.run(compare_with_tp1, 2, 0.1, **options), f"{label} tp=2")


def test_sequence_parallel_with_a_trained_feature_model_equals_tp1(pool4):
    """The features then need every position's gradient: they enter the sequence-parallel region
    through a scatter whose backward all-gathers (and the feature pass stays replicated)."""
    assert_equals_tp1(pool4.run(compare_with_tp1, 2, 0.1, "tied", False, tp_options=SP), "SP trained features")


def test_the_compressed_model_under_sequence_parallelism_adds_one_small_gradient_sum_per_side(pool4):
    """Fewer, narrower latents (tests/model/test_autoencoder_tp.py's COMPRESSED) under sequence
    parallelism: the blocks' collectives are the default model's kind, and the parameters each side
    uses on this rank's latents only (the latents' second position table, the bottleneck
    projection; the encoder's learned latents) have their gradients summed in one all-reduce per
    side. The encoder's replaces the one the default model spends on its latents; the decoder's is
    the one collective its bottleneck adds. Nothing of activation size."""
    default = pool4.run(collectives, 2, tp_options=SP)[0]
    compressed = pool4.run(collectives, 2, COMPRESSED, tp_options=SP)[0]
    added = sorted(set(compressed["sp_names"]) - set(default["sp_names"]))
    assert added == ["decoder.from_latent.weight", "decoder.latent_positions", "encoder.latent_positions",
                     "encoder.to_latent.weight"]  # fmt: skip
    assert set(default["sp_names"]) <= set(compressed["sp_names"])
    n, k, sizes = COMPRESSED["num_latents"], COMPRESSED["latent_dim"], compressed["sp_sizes"]
    expected_sizes = {name: n * D if name.endswith("positions") else D * k for name in added}
    assert {name: sizes[name] for name in added} == expected_sizes
    together = {
        "encoder": ["encoder.latents", "encoder.latent_positions", "encoder.to_latent.weight"],
        "decoder": ["decoder.latent_positions", "decoder.from_latent.weight"],
    }
    one_each = [sizes[name] for name in compressed["sp_names"] if not any(name in side for side in together.values())]
    reduced = sorted(numel for name, numel in compressed["backward"] if name == "all_reduce")
    assert reduced == sorted([*one_each, *(sum(sizes[name] for name in side) for side in together.values()), D])
    default_reduced = [numel for name, numel in default["backward"] if name == "all_reduce"]
    assert len(reduced) == len(default_reduced) + 1
    kinds = {name for name, _ in compressed["forward"] + compressed["backward"]}
    assert kinds == {name for name, _ in default["forward"] + default["backward"]}


def save_task(tp: int, directory: str, sequence_parallel: bool, model_overrides: dict | None = None) -> tuple:
    state = initialize_model_parallel(tp)
    options = TensorParallelOptions(sequence_parallel=sequence_parallel)
    configs = tiny_configs(dropout=0.0, **(model_overrides or {}))
    model = LatentAutoencoder(*configs, tp_group=state.tp_group, seed=4, tp_options=options)
    with torch.no_grad():  # move every parameter off its init, so a load has something to restore
        for param in model.parameters():
            param.add_(0.01 * torch.sin(torch.arange(param.numel(), dtype=param.dtype)).view_as(param))
    save_portable(model, directory, tp_group=state.tp_group)
    return _outputs(model, state.tp_group)


def load_task(tp: int, directory: str, sequence_parallel: bool, model_overrides: dict | None = None) -> tuple:
    state = initialize_model_parallel(tp)
    options = TensorParallelOptions(sequence_parallel=sequence_parallel)
    configs = tiny_configs(dropout=0.0, **(model_overrides or {}))
    model = LatentAutoencoder(*configs, tp_group=state.tp_group, seed=9, tp_options=options)
    load_portable(directory, model)
    return _outputs(model, state.tp_group)


class _SplitOnLastDim:
    tensor_model_parallel, partition_dim = True, -1


def _outputs(model, group) -> tuple:
    model.eval()
    ids, mask = tiny_batch()
    with torch.no_grad():
        out = model(ids, mask, return_latents=True)  # the latents of every position
        local = split_along_sequence(out.latents, group) if model.sequence_parallel else out.latents
        logits = gather_full(model.decoder(local, ids.shape[1]), _SplitOnLastDim, group)
    return out.loss.item(), out.latents, logits


@pytest.mark.parametrize(
    ("saved_with", "loaded_with"), [(True, False), (False, True)], ids=["sp-to-plain", "plain-to-sp"]
)
def test_a_checkpoint_loads_with_and_without_sequence_parallelism(pool4, tmp_path, saved_with, loaded_with):
    want = pool4.run(save_task, 2, str(tmp_path / "ckpt"), saved_with)[0]
    got = pool4.run(load_task, 2, str(tmp_path / "ckpt"), loaded_with)[0]
    k = reduction_length_of_model(2)
    for name, w, g in zip(("loss", "latents", "logits"), want, got, strict=True):
        w, g = torch.as_tensor(w), torch.as_tensor(g)
        assert (w - g).abs().max().item() <= order_bound(k, terms_scale(max_abs([w]), k)), name


@pytest.mark.parametrize("head", ["tied", "nearest"])
def test_a_compressed_checkpoint_saved_at_tp2_loads_at_tp4_and_in_one_process(pool4, tmp_path, head):
    """The portable checkpoint of fewer, narrower latents (with either head) loads at another TP
    degree (and with sequence parallelism) to the same numbers; a model of other latent keys is
    refused in one line."""
    compressed = {**COMPRESSED, "head": head}
    want = pool4.run(save_task, 2, str(tmp_path / "ckpt"), False, compressed)[0]
    k = reduction_length_of_model(4)
    for tp, sequence_parallel in ((4, True), (1, False)):
        got = pool4.run(load_task, tp, str(tmp_path / "ckpt"), sequence_parallel, compressed)[0]
        for name, w, g in zip(("loss", "latents", "logits"), want, got, strict=True):
            w, g = torch.as_tensor(w), torch.as_tensor(g)
            if name == "logits":  # the vocabulary is padded per TP degree
                w, g = w[..., :VOCAB], g[..., :VOCAB]
            assert (w - g).abs().max().item() <= order_bound(k, terms_scale(max_abs([w]), k)), (tp, name)
    other = LatentAutoencoder(*tiny_configs(dropout=0.0, **{**compressed, "num_latents": 2}), seed=9)
    with pytest.raises(CheckpointError, match=r"model\.num_latents is 4 in the checkpoint but 2 in the model"):
        load_portable(str(tmp_path / "ckpt"), other)
