"""The whole autoencoder at TP=2 and TP=4 equals TP=1: forward, loss, argmax and gradients after one
fp32 step (bounds derived in :mod:`tests.helpers.tp_compare`), weights after five AdamW steps in float64,
with dropout on and off; replicated parameters stay bit-identical across the TP group; a Perceiver
block costs the Megatron minimum of collectives; and the model learns at TP=2.
Real gloo ranks; the TP=1 twin is built inside each rank from the same seed."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from parallel_latent.model import LatentAutoencoder
from parallel_latent.parallel import TensorParallelOptions, initialize_model_parallel
from tests.helpers.autoencoder_tp import (
    COMPRESSED,
    K_COMPRESSED,
    N_COMPRESSED,
    assert_equals_tp1,
    compare_with_tp1,
    head_configs,
    replicated_spread,
    sgd_engine,
)
from tests.helpers.tiny_model import (
    VOCAB,
    B,
    D,
    T,
    dp_half_batch,
    overfit,
    reduction_length_of_model,
    tiny_batch,
    tiny_configs,
)
from tests.helpers.tp_compare import (
    collectives_of,
    max_abs,
    order_bound,
    terms_scale,
)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_model_at_tp_equals_tp1(pool4, tp, dropout):
    """The default options: the frozen feature pass split over the TP group, the backward
    collective overlapped (tests/model/test_tp_switches.py flips them)."""
    assert_equals_tp1(pool4.run(compare_with_tp1, tp, dropout), f"tp={tp} dropout={dropout}")


@pytest.mark.parametrize(
    ("head", "frozen", "tp"),
    [("token_table_init", True, 4), ("normal", True, 4), ("tied", False, 2), ("tied", False, 4)],
)
def test_head_options_at_tp_equal_tp1(pool4, head, frozen, tp):
    """The heads beside the default (tied, frozen features: the test above), and the tied head with
    a trainable feature model, where the table it reads is a shared, trained parameter: its rows'
    gradients come from every rank's vocabulary slice, and the replicated table must get all of
    them, identically on every rank, or its replicas drift apart."""
    assert_equals_tp1(pool4.run(compare_with_tp1, tp, 0.1, head, frozen), f"tp={tp} head={head} frozen={frozen}")


@pytest.mark.parametrize(("tp", "sequence_parallel"), [(2, False), (4, False), (2, True), (4, True)])
def test_compressed_model_at_tp_equals_tp1(pool4, tp, sequence_parallel):
    """Fewer latents than positions, a bottleneck on each side and the learned length, dropout on:
    with and without sequence parallelism (1 latent per rank at TP=4)."""
    options = {"tp_options": TensorParallelOptions(sequence_parallel=True)} if sequence_parallel else {}
    results = pool4.run(compare_with_tp1, tp, 0.1, model_overrides=COMPRESSED, **options)
    assert_equals_tp1(results, f"compressed tp={tp} sp={sequence_parallel}")


@pytest.mark.parametrize(("tp", "sequence_parallel", "frozen"), [(2, False, True), (4, True, True), (2, False, False)])
def test_the_nearest_head_at_tp_equals_tp1(pool4, tp, sequence_parallel, frozen):
    """The compressed model with the nearest head (each rank scores its vocabulary slice against
    codes it computes from its rows of the table): the codes' projection gets its gradient from
    every slice, the reading and the scale from every position under sequence parallelism, and a
    trained table its rows' gradients from every rank. With the latents noised in training
    (``model.latent_noise``): every rank draws TP=1's noise, its own latents' under sequence
    parallelism."""
    options = {"tp_options": TensorParallelOptions(sequence_parallel=True)} if sequence_parallel else {}
    overrides = {**COMPRESSED, "latent_noise": 0.5}
    results = pool4.run(compare_with_tp1, tp, 0.1, "nearest", frozen, model_overrides=overrides, **options)
    assert_equals_tp1(results, f"nearest tp={tp} sp={sequence_parallel} frozen={frozen}")


def count_block_collectives(tp: int, model_overrides: dict | None = None, **options) -> tuple[list, list]:
    state = initialize_model_parallel(tp)
    configs = tiny_configs(dropout=0.0, **(model_overrides or {}))
    model = LatentAutoencoder(*configs, tp_group=state.tp_group, seed=1, **options).train()
    ids, mask = tiny_batch()
    return collectives_of(lambda: model(ids, mask).loss)


def test_collectives_per_block_are_the_megatron_minimum(pool4):
    layers = tiny_configs()[0].n_encoder_layers, tiny_configs()[0].n_decoder_layers
    blocks = sum(layers)
    # The feature pass replicated, as without the split of tests/model/test_tp_switches.py.
    forward, backward = pool4.run(count_block_collectives, 2, split_feature_model=False)[0]
    assert all(name == "all_reduce" for name, _, _ in forward + backward)
    forward_sizes = Counter(numel for _, numel, _ in forward)
    # Two [B, T, d] all-reduces per block (attention, MLP); one of d for the query MLP, computed
    # once without dropout; the loss's small [B, T] reductions (max; sum-exp + target; argmax).
    assert forward_sizes == Counter([B * T * D] * 2 * blocks + [D] + [B * T] * 2 + [2 * B * T])
    # Backward: one per MLP and one per attention at the region entries, plus the vocabulary head's
    # entry. Attention reduces cat(context, stream) in one go: the context gradient feeds the learned
    # ln_context, so it is needed even where the context itself (GPT-2 features) is frozen.
    backward_sizes = Counter(numel for _, numel, _ in backward)
    assert backward_sizes == Counter([B * T * D] * (blocks + 1) + [2 * B * T * D] * blocks)
    assert len(forward) - 4 == len(backward) - 1 == 2 * blocks


def overfit_at_tp(tp: int) -> int:
    state = initialize_model_parallel(tp)
    model = LatentAutoencoder(*tiny_configs(dropout=0.1), tp_group=state.tp_group, seed=1)
    ids, mask = tiny_batch()
    return overfit(model, ids, mask, max_steps=150)


def test_overfits_a_small_batch_at_tp2(pool4):
    steps = pool4.run(overfit_at_tp, 2)
    assert steps[0] > 0, "token accuracy did not reach 100% in 150 steps at TP=2"
    assert len(set(steps)) == 1  # every rank saw the same accuracy


# --------------------------------------------------------------------------- #
# The tied head under DeepSpeed ZeRO, and in portable checkpoints.
# --------------------------------------------------------------------------- #

ZERO_STEPS, ZERO_LR = 3, 0.2


def _tied_state(model) -> dict[str, torch.Tensor]:
    return {"log_scale": model.decoder.head.log_scale, "table": model.feature_model.token_table}


def reference_sgd(frozen: bool) -> tuple[dict, float]:
    """TP=1 without DeepSpeed: SGD on the mean of the two DP halves' mean losses, as DeepSpeed
    averages the DP ranks' gradients. Returns the tied head's tensors and the largest gradient."""
    model = LatentAutoencoder(*head_configs(0.0, "tied", frozen), seed=1).train()
    optimizer = torch.optim.SGD(model.trainable_parameters(), lr=ZERO_LR)
    grad_scale = 0.0
    for step in range(ZERO_STEPS):
        loss = sum(model(*dp_half_batch(step, r)).loss for r in (0, 1)) / 2
        loss.backward()
        grad_scale = max(grad_scale, max_abs([p.grad for p in model.trainable_parameters()]))
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in _tied_state(model).items()}, grad_scale


def train_under_zero(zero_stage: int, frozen: bool) -> tuple[dict, float]:
    """TP=2 x DP=2 through the trainer's engine set-up: ZeRO-3 partitions the frozen or trainable
    table over DP, and the head, which does not own it, must still see it whole."""
    from parallel_latent.zero.params import gathered

    state = initialize_model_parallel(2)
    model = LatentAutoencoder(*head_configs(0.0, "tied", frozen), tp_group=state.tp_group, seed=1).train()
    engine = sgd_engine(model, 2, zero_stage, ZERO_LR)
    for step in range(ZERO_STEPS):
        engine.backward(engine(*dp_half_batch(step, state.dp_rank)).loss)
        engine.step()
    table = model.feature_model.token_table
    # Under ZeRO-3 the table rests partitioned (this rank's flat piece only), and DeepSpeed knows
    # that the head, which does not own it, uses it.
    facts = {
        "partitioned": zero_stage < 3 or table.numel() == 0,
        "registered": zero_stage < 3 or id(table) in model.decoder.head._external_params,
    }
    tensors = _tied_state(model)
    with gathered(list(tensors.values())):
        whole = {k: v.detach().clone() for k, v in tensors.items()}
    return whole, replicated_spread(whole, state.tp_group), facts


@pytest.mark.parametrize(("stage", "frozen"), [(3, True), (2, False), (3, False)])
def test_tied_head_under_zero_trains_like_tp1(pool4, stage, frozen):
    want, grad_scale = reference_sgd(frozen)
    k = reduction_length_of_model(2) + 2 + (0 if frozen else 2 * (D + 4 * D + 2 * T) + VOCAB)
    # SGD adds each step's gradient error once; doubled for what the moved weights feed back.
    bound = 2 * ZERO_STEPS * ZERO_LR * order_bound(k, terms_scale(grad_scale, k))
    for rank, (got, spread, facts) in enumerate(pool4.run(train_under_zero, stage, frozen)):
        where = f"ZeRO-{stage} rank {rank} frozen={frozen}"
        assert facts == {"partitioned": True, "registered": True}, f"{where}: {facts}"
        assert spread == 0.0, f"{where}: the table or the scale differs across the TP group"
        if frozen:
            assert torch.equal(got["table"], want["table"]), f"{where}: the frozen table changed"
        for name in want:
            diff = (got[name] - want[name]).abs().max().item()
            assert diff <= bound, f"{where}: {name} differs from TP=1 by {diff:.3g} > {bound:.3g}"


def _loss_and_ids(model) -> tuple[float, torch.Tensor]:
    model.eval()
    ids, mask = tiny_batch()
    with torch.no_grad():
        out = model(ids, mask, return_predictions=True)
    return out.loss.item(), out.predictions


def save_tied_task(tp: int, directory: str):
    from parallel_latent.checkpoint import save_portable

    state = initialize_model_parallel(tp)
    model = LatentAutoencoder(*head_configs(0.0), tp_group=state.tp_group, seed=5)
    with torch.no_grad():
        model.decoder.head.log_scale.fill_(0.75)  # not its initial value: a load must read it
    save_portable(model, directory, tp_group=state.tp_group, step=1)
    return _loss_and_ids(model)


def load_tied_task(tp: int, directory: str):
    from parallel_latent.checkpoint import load_portable

    state = initialize_model_parallel(tp)
    model = LatentAutoencoder(*head_configs(0.0), tp_group=state.tp_group, seed=99)  # other weights
    load_portable(directory, model, state.tp_group)
    return _loss_and_ids(model), model.decoder.head.log_scale.item()


def test_tied_head_is_stored_once_and_loads_at_another_tp(pool4, tmp_path):
    from safetensors import safe_open

    from parallel_latent.api import load_autoencoder

    directory = tmp_path / "tied_tp2"
    want_loss, want_ids = pool4.run(save_tied_task, 2, str(directory))[0]
    manifest = json.loads((directory / "manifest.json").read_text())
    tensors = manifest["tensors"]
    # The head's only tensor is its scale; the table it reads is the feature model's, stored once.
    assert [name for name in tensors if name.startswith("decoder.head.")] == ["decoder.head.log_scale"]
    table = tensors["feature_model.gpt2.wte.weight"]
    assert table["partition_dim"] is None and table["shape"] == [VOCAB, D] and manifest["aliases"] == {}
    assert [shard["file"] for shard in table["shards"]] == ["model-tp00-of-02.safetensors"]
    with safe_open(str(directory / "model-tp01-of-02.safetensors"), "pt") as handle:
        names = handle.keys()
    assert not any("wte" in name or "decoder.head" in name for name in names)

    k = reduction_length_of_model(4)
    bound = order_bound(k, terms_scale(abs(want_loss), k))
    single = load_autoencoder(directory)  # TP=1, one process, config from the manifest
    got_loss, got_ids = _loss_and_ids(single)
    assert single.decoder.head.log_scale.item() == 0.75
    assert abs(got_loss - want_loss) <= bound and torch.equal(got_ids, want_ids)
    for (loss, ids), log_scale in pool4.run(load_tied_task, 4, str(directory)):
        assert log_scale == 0.75 and abs(loss - want_loss) <= bound and torch.equal(ids, want_ids)


def test_the_compressed_model_adds_no_collective(pool4):
    """With N latents of k features: the encoder's blocks reduce its N latents, the decoder's the
    T queries, attention's backward cat(context, stream) of T + N rows either way; the bottleneck
    projections are replicated and cost nothing (under sequence parallelism their gradients are
    summed once each: tests/model/test_tp_switches.py)."""
    layers = tiny_configs()[0].n_encoder_layers, tiny_configs()[0].n_decoder_layers
    n = N_COMPRESSED
    forward, backward = pool4.run(count_block_collectives, 2, COMPRESSED, split_feature_model=False)[0]
    assert all(name == "all_reduce" for name, _, _ in forward + backward)
    # The loss's [B, T] reductions, and predict_length's argmax is not in a training step.
    want_forward = [B * n * D] * 2 * layers[0] + [B * T * D] * 2 * layers[1] + [D] + [B * T] * 2 + [2 * B * T]
    assert Counter(numel for _, numel, _ in forward) == Counter(want_forward)
    want_backward = [B * n * D] * layers[0] + [B * T * D] * (layers[1] + 1) + [B * (T + n) * D] * sum(layers)
    assert Counter(numel for _, numel, _ in backward) == Counter(want_backward)


def test_the_nearest_head_costs_one_small_collective(pool4):
    """The nearest head reads r = N k / T of the d features before the vocabulary region: its entry
    reduces [B, T, r] in backward instead of [B, T, d], and the codes' projection [r, d] (computed
    from each rank's slice of the table) adds one all-reduce of its gradient; nothing else changes."""
    layers = tiny_configs()[0].n_encoder_layers, tiny_configs()[0].n_decoder_layers
    n, r = N_COMPRESSED, N_COMPRESSED * K_COMPRESSED // T
    overrides = {**COMPRESSED, "head": "nearest"}
    forward, backward = pool4.run(count_block_collectives, 2, overrides, split_feature_model=False)[0]
    assert all(name == "all_reduce" for name, _, _ in forward + backward)
    want_forward = [B * n * D] * 2 * layers[0] + [B * T * D] * 2 * layers[1] + [D] + [B * T] * 2 + [2 * B * T]
    assert Counter(numel for _, numel, _ in forward) == Counter(want_forward)
    want_backward = [B * n * D] * layers[0] + [B * T * D] * layers[1] + [B * T * r, r * D]
    want_backward += [B * (T + n) * D] * sum(layers)
    assert Counter(numel for _, numel, _ in backward) == Counter(want_backward)
