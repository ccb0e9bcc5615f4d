"""A checkpoint's feature model and tokenizer come from the checkpoint alone: the GPT-2 from its
recorded shape (never ``pretrained``), the tokenizer from files in the directory or the built-in
offline BPE; a record naming a path or a hub id that only those could satisfy is refused in one line
naming the manifest and the key, before anything is tried (the guard fails a test that tries)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parallel_latent.config import TokenizerConfig
from parallel_latent.errors import BadInput, CheckpointError
from parallel_latent.feature_model.from_record import feature_config_from_record, tokenizer_from_record
from parallel_latent.feature_model.tokenizer import OFFLINE, load_tokenizer, tokenizer_facts
from tests.helpers.self_contained import HUB_ID, OUTSIDE_PATH, guard_outside_reads

SHAPE = {"n_layer": 6, "n_head": 4, "n_embd": 32, "n_positions": 64}


def record(name: str = "gpt2", pretrained: bool = False, shape: dict | None = None, tokenizer: str = OFFLINE) -> dict:
    """A manifest's record, as ``LatentAutoencoder.checkpoint_record`` and ``save_portable`` write it."""
    feature = {"name_or_path": name, "pretrained": pretrained, "frozen": True, "n_layer": 3, "n_head": 2,
               "n_embd": 16, "n_positions": 8}  # fmt: skip
    manifest = {"feature_model_config": feature, "config": {"tokenizer": {"name_or_path": tokenizer}}}
    return manifest | ({"feature_model_architecture": shape} if shape is not None else {})


def one_line(error: pytest.ExceptionInfo, start: str) -> str:
    message = str(error.value)
    assert "\n" not in message and message.startswith(start), message
    return message


@pytest.mark.parametrize("name", [OUTSIDE_PATH, HUB_ID])
def test_a_recorded_shape_rebuilds_the_gpt2_wherever_it_came_from(name):
    """A run on a pretrained GPT-2 records where it came from and its shape: the shape is built."""
    cfg = feature_config_from_record(record(name, pretrained=True, shape=SHAPE), "m.json")
    assert cfg.pretrained is False and (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.n_positions) == (6, 4, 32, 64)


@pytest.mark.parametrize("name", [OUTSIDE_PATH, HUB_ID])
def test_a_pretrained_gpt2_without_its_shape_is_refused(name):
    with pytest.raises(CheckpointError) as refused:
        feature_config_from_record(record(name, pretrained=True), "ckpt/manifest.json")
    message = one_line(refused, "ckpt/manifest.json: feature_model_config.pretrained is true")
    assert repr(name) in message and "feature_model_architecture is missing" in message and "not read" in message


def test_a_random_gpt2_without_its_shape_is_built_from_its_config():
    """Manifests older than the recorded shape: a pretrained: false config holds the shape itself."""
    cfg = feature_config_from_record(record(HUB_ID), "m.json")
    assert cfg.pretrained is False and (cfg.n_layer, cfg.n_head, cfg.n_embd) == (3, 2, 16)


@pytest.mark.parametrize(
    "shape, expected",
    [
        ({**SHAPE, "path": "/x"}, "feature_model_architecture.path: unknown key"),
        ({"n_layer": 6, "n_head": 4, "n_embd": 32}, "feature_model_architecture.n_positions: missing"),
        ({**SHAPE, "n_layer": "six"}, "feature_model_architecture.n_layer: expected int"),
        ({**SHAPE, "n_layer": 1}, "feature_model_architecture.n_layer"),
        ({**SHAPE, "n_head": 5}, "does not divide"),
        ([6, 4, 32, 64], "feature_model_architecture: expected an object"),
    ],
    ids=["unknown-key", "missing-key", "wrong-type", "too-shallow", "heads-vs-width", "not-an-object"],
)
def test_a_damaged_shape_is_one_line_naming_the_key(shape, expected):
    with pytest.raises(BadInput) as refused:
        feature_config_from_record(record(HUB_ID, pretrained=True, shape=shape), "m.json")
    assert expected in one_line(refused, "m.json: ")


@pytest.fixture(scope="module")
def offline():
    return load_tokenizer(TokenizerConfig())


def with_facts(manifest: dict, tokenizer) -> dict:
    return manifest | {"tokenizer": tokenizer_facts(tokenizer)}


@pytest.mark.parametrize("name", [OUTSIDE_PATH, HUB_ID])
def test_a_tokenizer_named_outside_is_refused_before_it_is_tried(name, offline, tmp_path, monkeypatch):
    guard_outside_reads(monkeypatch, tmp_path)
    with pytest.raises(CheckpointError) as refused:
        tokenizer_from_record(tmp_path, with_facts(record(tokenizer=name), offline), f"{tmp_path}/manifest.json")
    message = one_line(refused, f"{tmp_path}/manifest.json: config.tokenizer.name_or_path={name!r}")
    assert f"--tokenizer {name}" in message and "save-pretrained" in message


def test_the_tokenizer_comes_from_the_directory_or_is_the_offline_one(offline, tmp_path, monkeypatch):
    """Its own files win over the name the record holds (read from the directory alone); the
    offline BPE when the record names it; the caller's own choice over both."""
    allowed = guard_outside_reads(monkeypatch, tmp_path)
    manifest = with_facts(record(tokenizer=HUB_ID), offline)
    offline.save_pretrained(str(tmp_path))
    text = "It is a truth universally acknowledged."
    own = tokenizer_from_record(tmp_path, manifest, "m.json")
    assert allowed == [str(tmp_path)] and own(text)["input_ids"] == offline(text)["input_ids"]
    built_in = tokenizer_from_record(tmp_path / "none", with_facts(record(), offline), "m.json")
    assert built_in(text)["input_ids"] == offline(text)["input_ids"]
    given = tokenizer_from_record(tmp_path / "none", manifest, "m.json", tokenizer=OFFLINE)
    assert given(text)["input_ids"] == offline(text)["input_ids"]


def test_a_tokenizer_that_does_not_fit_or_load_is_one_line(offline, tmp_path):
    manifest = record() | {"tokenizer": {**tokenizer_facts(offline), "vocab_size": 300}}
    with pytest.raises(CheckpointError) as refused:
        tokenizer_from_record(tmp_path, manifest, "m.json")
    assert "but offline gives 50259" in one_line(refused, "m.json: tokenizer.vocab_size=300")
    with pytest.raises(BadInput) as refused:
        tokenizer_from_record(tmp_path, manifest, "m.json", tokenizer=str(tmp_path / "missing"))
    one_line(refused, f"tokenizer {tmp_path / 'missing'}: the tokenizer does not load")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "NoSuchTokenizer"}))
    with pytest.raises(CheckpointError) as refused:
        tokenizer_from_record(Path(tmp_path), manifest, "m.json")
    one_line(refused, f"{tmp_path / 'tokenizer_config.json'}: the tokenizer does not load")


def _decoder_directory(directory: Path, config) -> Path:
    """A decoder as a name points at it: its config.json is all the comparison reads."""
    config.save_pretrained(directory)
    return directory


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({}, None),
        # GPT-2's weights have the same shapes whatever the heads: the count is compared itself.
        ({"n_head": 2}, "its n_head is 2, the checkpoint's 4"),
        ({"n_positions": 128}, "its wpe.weight is 128x32, the checkpoint's 64x32"),
        # Hidden state -3 holds n_layer - 2 layers: one fewer here.
        ({"n_layer": 5}, "its h.3.ln_1.weight is absent, the checkpoint's 32"),
    ],
)
def test_a_loaded_decoder_is_compared_with_the_checkpoints_by_its_config_alone(changes, expected, tmp_path):
    from transformers import GPT2Config

    from parallel_latent.config import FeatureModelConfig
    from parallel_latent.feature_model.from_record import loaded_decoder_difference

    directory = _decoder_directory(tmp_path / "gpt2", GPT2Config(vocab_size=50, **{**SHAPE, **changes}))
    feature_cfg = FeatureModelConfig(name_or_path=str(directory), pretrained=True)
    found = loaded_decoder_difference(feature_cfg, record(OUTSIDE_PATH, pretrained=True, shape=SHAPE), "c.json")
    prefix = f"feature_model.name_or_path={directory} is another decoder than the checkpoint's: "
    assert found == (None if expected is None else prefix + expected)
    # A checkpoint older than the recorded shape: nothing to compare (the engine's load still checks).
    assert loaded_decoder_difference(feature_cfg, record(OUTSIDE_PATH, pretrained=True), "c.json") is None


def test_a_loaded_decoder_of_another_family_is_named(tmp_path):
    from transformers import GPT2Config, LlamaConfig

    from parallel_latent.config import FeatureModelConfig
    from parallel_latent.feature_model.from_record import loaded_decoder_difference

    llama = LlamaConfig(
        vocab_size=50,
        num_hidden_layers=6,
        num_attention_heads=4,
        hidden_size=32,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=2,
    )  # fmt: skip (SmolLM2's pad)
    saved = record(
        OUTSIDE_PATH, pretrained=True, shape={"architecture": "llama", **SHAPE, "transformers_config": llama.to_dict()}
    )
    directory = _decoder_directory(tmp_path / "gpt2", GPT2Config(vocab_size=50, **SHAPE))
    feature_cfg = FeatureModelConfig(name_or_path=str(directory), pretrained=True)
    assert loaded_decoder_difference(feature_cfg, saved, "c.json").endswith(
        "its architecture is gpt2, the checkpoint's llama"
    )
    same = _decoder_directory(tmp_path / "llama", llama)
    assert (
        loaded_decoder_difference(FeatureModelConfig(name_or_path=str(same), pretrained=True), saved, "c.json") is None
    )
