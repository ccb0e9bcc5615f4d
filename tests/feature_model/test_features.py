"""The feature model: GPT-2 by path or from its config, truncated to hidden state -3, frozen or not."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

from parallel_latent.config import ConfigError, FeatureModelConfig, ModelConfig
from parallel_latent.feature_model import FeatureModel
from parallel_latent.feature_model.features import truncate_to_hidden_state
from parallel_latent.model import LatentAutoencoder
from tests.helpers.tp_compare import gpt2_reduction_length, order_bound, terms_scale

D, N_LAYER, SAVED_VOCAB, VOCAB, PAD = 32, 5, 290, 300, 299


@pytest.fixture(scope="module")
def saved_gpt2(tmp_path_factory):
    """A tiny GPT-2 as the hub ships it (an LM-head checkpoint), saved to a local folder."""
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=N_LAYER,
        n_head=4,
        n_embd=D,
        vocab_size=SAVED_VOCAB,
        n_positions=64,
        bos_token_id=None,
        eos_token_id=None,
    )
    path = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


def padded_batch():
    ids = torch.randint(0, SAVED_VOCAB, (3, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 2:] = 0
    return ids.masked_fill(mask == 0, PAD), mask


def test_features_are_hidden_state_minus_3_of_the_full_model(saved_gpt2):
    features = FeatureModel(FeatureModelConfig(name_or_path=str(saved_gpt2), pretrained=True), VOCAB)
    full = GPT2Model.from_pretrained(saved_gpt2).eval()
    full.resize_token_embeddings(VOCAB)
    # Rows added by the resize are random draws: give the full model the same ones.
    assert torch.equal(full.wte.weight[:SAVED_VOCAB], features.token_table[:SAVED_VOCAB])
    full.wte.weight.data.copy_(features.token_table)

    ids, mask = padded_batch()
    with torch.no_grad():
        want = full(input_ids=ids, output_hidden_states=True).hidden_states[-3]
        padded = full(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-3]
    got = features(ids, mask)
    # The same function: the tanh GELU in one kernel instead of gelu_new's eight, and attention
    # without a mask (causal SDPA); only the rounding differs.
    n = gpt2_reduction_length(D, 4, ids.shape[1], N_LAYER - 2)
    bound = order_bound(n, terms_scale(want.abs().max().item(), n))
    assert (got - want).abs().max().item() <= bound
    # GPT-2 is causal: the padding mask changes only the features at pad positions (which the
    # encoder masks out), so the features of real tokens equal those of a masked run.
    real = mask.bool()
    assert (got[real] - padded[real]).abs().max().item() <= bound
    assert features.gpt2.config.activation_function == "gelu_pytorch_tanh"
    # A broken feature pass (the last kept block skipped) is far outside the bound.
    with torch.no_grad():
        short = full(input_ids=ids, output_hidden_states=True).hidden_states[-4]
    assert (short - want).abs().max().item() > 10 * bound

    # Only the blocks that index needs are held: not the last two, not the final LayerNorm.
    assert len(features.gpt2.h) == N_LAYER - 2
    assert isinstance(features.gpt2.ln_f, torch.nn.Identity)
    held = sum(p.numel() for p in features.parameters())
    block = sum(p.numel() for p in full.h[0].parameters())
    assert held == sum(p.numel() for p in full.parameters()) - 2 * block - 2 * D


def test_token_table_is_resized_to_the_vocabulary(saved_gpt2):
    features = FeatureModel(FeatureModelConfig(name_or_path=str(saved_gpt2), pretrained=True), VOCAB)
    assert features.token_table.shape == (VOCAB, D)
    assert features.gpt2.config.vocab_size == VOCAB


def test_random_features_are_announced_loudly(caplog):
    with caplog.at_level(logging.WARNING):
        features = FeatureModel(FeatureModelConfig(n_layer=3, n_head=4, n_embd=D), VOCAB)
    assert any(r.levelno == logging.WARNING and "RANDOM" in r.getMessage() for r in caplog.records)
    assert len(features.gpt2.h) == 1 and features.token_table.shape == (VOCAB, D)


def test_truncation_rejects_an_index_that_does_not_exist():
    gpt2 = GPT2Model(GPT2Config(n_layer=2, n_head=4, n_embd=D, vocab_size=VOCAB, bos_token_id=None, eos_token_id=None))
    with pytest.raises(ValueError, match="hidden state -4 does not exist in a 2-layer GPT-2"):
        truncate_to_hidden_state(gpt2, -4)


def _model(frozen: bool, n_embd: int = D) -> LatentAutoencoder:
    model_cfg = ModelConfig(
        d_model=D,
        n_heads=4,
        n_encoder_layers=1,
        n_decoder_layers=1,
        max_length=10,
        vocab_size=VOCAB,
        mask_token_id=298,
        pad_token_id=PAD,
    )
    return LatentAutoencoder(model_cfg, FeatureModelConfig(n_layer=3, n_head=4, n_embd=n_embd, frozen=frozen))


def test_frozen_feature_model_never_trains():
    model = _model(frozen=True).train()
    gpt2 = model.feature_model.gpt2
    assert not model.feature_model.training and not any(m.training for m in gpt2.modules())
    assert not any(p.requires_grad for p in gpt2.parameters())
    trainable = {id(p) for p in model.trainable_parameters()}
    assert not any(id(p) in trainable for p in gpt2.parameters())
    # The mask vector is a copy of the table's mask row, and a buffer (saved, not trained).
    assert "decoder.mask_vector" in dict(model.named_buffers())
    assert torch.equal(model.decoder.mask_vector, model.feature_model.token_table[298])

    ids, mask = padded_batch()
    assert not model.feature_model(ids, mask).requires_grad  # no autograd graph under GPT-2
    model(ids, mask).loss.backward()
    assert all(p.grad is None for p in gpt2.parameters())


def test_unfrozen_feature_model_trains_as_a_replicated_module():
    model = _model(frozen=False).train()
    gpt2 = model.feature_model.gpt2
    assert model.feature_model.training and gpt2.training
    trainable = {id(p) for p in model.trainable_parameters()}
    assert all(id(p) in trainable for p in gpt2.parameters())
    assert all(p.tensor_model_parallel is False for p in gpt2.parameters())
    assert isinstance(model.decoder.mask_vector, torch.nn.Parameter)
    assert id(model.decoder.mask_vector) in trainable
    ids, mask = padded_batch()
    model(ids, mask).loss.backward()
    assert gpt2.h[0].mlp.c_fc.weight.grad is not None and model.decoder.mask_vector.grad is not None


def test_feature_width_must_match_the_model():
    with pytest.raises(ValueError, match=r"has width 48 but model\.d_model=32"):
        _model(frozen=True, n_embd=48)


def test_tied_head_with_the_pretrained_gpt2_is_its_own_output_projection(saved_gpt2):
    """GPT-2 ties its LM head to its token table: with the pretrained model, the tied decoder head
    scores with GPT-2's own output projection (resized to our vocabulary), times the learned scale."""
    model_cfg = ModelConfig(
        d_model=D, n_heads=4, n_encoder_layers=1, n_decoder_layers=1, max_length=10, vocab_size=VOCAB,
        mask_token_id=298, pad_token_id=PAD, head="tied",
    )  # fmt: skip
    model = LatentAutoencoder(model_cfg, FeatureModelConfig(name_or_path=str(saved_gpt2), pretrained=True))
    lm_head = GPT2LMHeadModel.from_pretrained(saved_gpt2).lm_head
    head = model.decoder.head
    assert head.table is model.feature_model.gpt2.wte.weight
    assert torch.equal(head.table[:SAVED_VOCAB], lm_head.weight)
    x = torch.randn(2, 3, D, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = head(x)[..., :SAVED_VOCAB]
        want = lm_head(x * head.log_scale.exp())
    # The same d-term dot products, possibly blocked differently by the two kernels.
    assert (got - want).abs().max().item() <= order_bound(D, terms_scale(want.abs().max().item(), D))


def test_tied_head_needs_the_feature_width_to_be_the_model_width(saved_gpt2):
    model_cfg = ModelConfig(d_model=48, n_heads=4, max_length=10, vocab_size=VOCAB, mask_token_id=298, pad_token_id=PAD)
    with pytest.raises(ConfigError) as caught:
        LatentAutoencoder(model_cfg, FeatureModelConfig(name_or_path=str(saved_gpt2), pretrained=True))
    message = str(caught.value)
    assert "\n" not in message and "has width 32 but model.d_model=48" in message and "model.head=tied" in message


def test_a_sink_token_runs_first_and_is_left_out_of_the_features():
    """``feature_model.sink_token_id``: the decoder reads the sink, then the sample; the features are
    those of the sample's positions, which the sink changes (the decoder attends to it), and the
    sink's position is counted against the decoder's positions."""
    cfg = FeatureModelConfig(n_layer=3, n_head=4, n_embd=32, n_positions=16)
    torch.manual_seed(0)
    plain = FeatureModel(cfg, 300)
    torch.manual_seed(0)
    sinked = FeatureModel(dataclasses.replace(cfg, sink_token_id=7), 300)
    ids = torch.randint(0, 298, (3, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        got = sinked(ids, mask)
        want = plain(torch.cat([torch.full((3, 1), 7), ids], 1), torch.ones(3, 9, dtype=torch.long))[:, 1:]
        assert torch.equal(got, want)
        assert got.shape == plain(ids, mask).shape and not torch.allclose(got, plain(ids, mask))
    assert (plain.positions, sinked.positions) == (16, 15)
    assert sinked.architecture()["n_positions"] == 16  # the decoder's own, which rebuilds it
