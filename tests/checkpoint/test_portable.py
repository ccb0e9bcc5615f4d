"""Portable sharded checkpoints: safetensors per TP rank + manifest, loaded at any TP degree (also
in one process without a process group), with every damage detected in one clear line; first on a
stack of the core layers, then on the autoencoder (saved at TP=4, loaded at TP=1 from the manifest
alone, 2 and 4; a GPT-2 that came from a path or the hub is rebuilt from its recorded shape); a
portable or training checkpoint whose manifest names a GPT-2 or tokenizer outside it is refused."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch
from safetensors import safe_open
from transformers import GPT2Config, GPT2LMHeadModel

from parallel_latent.api import load_autoencoder
from parallel_latent.checkpoint import (
    CheckpointError,
    consolidate,
    inspect,
    load_portable,
    save_portable,
)
from parallel_latent.config import Config, FeatureModelConfig, ModelConfig
from parallel_latent.model import LatentAutoencoder
from parallel_latent.parallel import initialize_model_parallel
from tests.helpers.checkpoint_stack import VOCAB, Stack, batch, gathered_state
from tests.helpers.make_fixture import FIXTURE
from tests.helpers.self_contained import (
    OUTSIDE,
    assert_refused_by_api,
    assert_refused_by_cli,
    edited_copy,
    guard_outside_reads,
    reconstructs,
    save_portable_copy,
    tiny_autoencoder,
)
from tests.helpers.tp_compare import argmax_agrees, autoencoder_reduction_length, max_abs, order_bound, terms_scale

# Loading at another TP degree sums the row-parallel products in another order: the logits of the
# Stack go through q/k/v (D), scores (D/HEADS), softmax and weighted sum over T, the output
# projection (D), the MLP (D + 4D), the head (D) and the all-reduces (<= 4 slices).
STACK_REDUCTION = 3 * 32 + 32 // 4 + 2 * 6 + 4 * 32 + 4 + 4


def assert_close_logits(got: torch.Tensor, want: torch.Tensor, k: int = STACK_REDUCTION) -> None:
    bound = order_bound(k, terms_scale(max_abs([want]), k))
    assert (got - want).abs().max().item() <= bound
    assert argmax_agrees(want, got, bound)


def save_task(tp: int, directory: str, seed: int):
    state = initialize_model_parallel(tp)
    model = Stack(state.tp_group, seed=seed).eval()
    logits = model.full_logits(batch(0, 2))
    save_portable(model, directory, tp_group=state.tp_group, step=5)
    return logits, gathered_state(model, state.tp_group)


def load_task(tp: int, directory: str):
    state = initialize_model_parallel(tp)
    model = Stack(state.tp_group, seed=99)  # another init: every value must come from the files
    load_portable(directory, model)
    model.eval()
    return model.full_logits(batch(0, 2)), gathered_state(model, state.tp_group)


@pytest.fixture(scope="module")
def saved(pool4, tmp_path_factory):
    root = tmp_path_factory.mktemp("portable")
    results = {tp: pool4.run(save_task, tp, str(root / f"tp{tp}"), 0)[0] for tp in (4, 2)}
    return root, results


def assert_same_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_tp_invariant_save(saved):
    _, results = saved
    assert_same_state(results[2][1], results[4][1])


@pytest.mark.parametrize("saved_tp,load_tp", [(4, 1), (4, 2), (4, 4), (2, 4), (2, 1)])
def test_load_at_any_tp(pool4, saved, saved_tp, load_tp):
    root, results = saved
    logits, state = pool4.run(load_task, load_tp, str(root / f"tp{saved_tp}"))[0]
    want_logits, want_state = results[saved_tp]
    assert_same_state(state, want_state)
    if load_tp == saved_tp:
        assert torch.equal(logits, want_logits)
    else:
        assert_close_logits(logits, want_logits)


def test_single_process_load_without_process_group(saved):
    root, results = saved
    model = Stack(None, seed=3)
    load_portable(root / "tp4", model)
    assert_same_state(gathered_state(model, None), results[4][1])
    assert_close_logits(model.eval().full_logits(batch(0, 2)), results[4][0])


def test_manifest_records_full_unpadded_shapes_and_checksums(saved):
    root, _ = saved
    manifest = json.loads((root / "tp4" / "manifest.json").read_text())
    assert manifest["tp_size"] == 4 and manifest["step"] == 5
    assert sorted(manifest["files"]) == [f"model-tp{r:02d}-of-04.safetensors" for r in range(4)]
    head = manifest["tensors"]["head.weight"]
    assert head["shape"] == [VOCAB, 32] and head["partition_dim"] == 0
    # Padded to 512 rows at TP=4 (128 per rank): rank 2 holds rows 256..299, rank 3 only padding.
    assert [(s["offset"], s["length"]) for s in head["shards"]] == [(0, 128), (128, 128), (256, 44)]
    assert manifest["tensors"]["mlp.dense_4h_to_h.weight"]["partition_dim"] == 1
    assert manifest["tensors"]["ln1.weight"]["partition_dim"] is None
    assert len(manifest["tensors"]["ln1.weight"]["shards"]) == 1
    for info in manifest["tensors"].values():
        assert all(len(s["xxh3_128"]) == 32 for s in info["shards"])
    # Interoperable with the reference safetensors reader.
    with safe_open(str(root / "tp4" / "model-tp02-of-04.safetensors"), framework="pt") as handle:
        assert handle.get_tensor("head.weight").shape == (44, 32)


def test_load_path_never_unpickles(saved, monkeypatch):
    root, results = saved

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used on the weight loading path")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    model = Stack(None, seed=3)
    load_portable(root / "tp2", model)
    assert_same_state(gathered_state(model, None), results[2][1])


@pytest.fixture
def damaged(saved, tmp_path):
    root, _ = saved
    copy = tmp_path / "ckpt"
    shutil.copytree(root / "tp2", copy)
    return copy


def load_error(directory, model=None) -> str:
    with pytest.raises(CheckpointError) as error:
        load_portable(directory, model if model is not None else Stack(None))
    message = str(error.value)
    assert "\n" not in message
    return message


def test_flipped_bytes_fail_the_checksum(damaged):
    path = damaged / "model-tp01-of-02.safetensors"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    data[-99] ^= 0x0F
    path.write_bytes(bytes(data))
    assert "checksum mismatch" in load_error(damaged)


def test_missing_shard(damaged):
    (damaged / "model-tp01-of-02.safetensors").unlink()
    assert "shard file missing" in load_error(damaged)


def test_truncated_shard(damaged):
    path = damaged / "model-tp00-of-02.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    assert "truncated" in load_error(damaged)


def test_truncated_shard_with_matching_manifest(damaged):
    # Even if the manifest's size were edited to match, the header's offsets give it away.
    path = damaged / "model-tp00-of-02.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    manifest = json.loads((damaged / "manifest.json").read_text())
    manifest["files"][path.name]["bytes"] = path.stat().st_size
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    assert "truncated" in load_error(damaged)


@pytest.mark.parametrize("outside", ["../outside.safetensors", "/tmp/outside.safetensors", "model/../../x.safetensors"])
def test_a_manifest_naming_a_file_outside_its_directory_is_refused_before_reading(damaged, outside):
    # The file exists out there, with the right size: nothing may be read from it.
    name = "model-tp00-of-02.safetensors"
    target = (damaged / outside) if not outside.startswith("/") else damaged.parent / "abs-outside.safetensors"
    outside = outside if not outside.startswith("/") else str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(damaged / name, target)
    manifest = json.loads((damaged / "manifest.json").read_text())
    manifest["files"][outside] = manifest["files"].pop(name)
    for info in manifest["tensors"].values():
        for shard in info["shards"]:
            if shard["file"] == name:
                shard["file"] = outside
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    (damaged / name).unlink()
    message = load_error(damaged)
    assert f"manifest.json names {outside!r}, which is not a file inside the directory; not read" in message


def test_a_shard_that_is_a_link_out_of_its_directory_is_refused(damaged):
    # The manifest names the file inside; the file system leads elsewhere: refused all the same.
    name = "model-tp00-of-02.safetensors"
    outside = damaged.parent / "elsewhere.safetensors"
    shutil.move(damaged / name, outside)
    (damaged / name).symlink_to(outside)
    message = load_error(damaged)
    assert f"{damaged / name}: a link to {outside}, outside the checkpoint's directory; not read" in message


def test_links_inside_the_directory_or_into_a_hub_cache_blob_store_load(damaged, tmp_path):
    name = "model-tp00-of-02.safetensors"
    shutil.move(damaged / name, damaged / "real.safetensors")
    (damaged / name).symlink_to("real.safetensors")
    load_portable(damaged, Stack(None))
    # A Hugging Face cache: snapshots/REV/FILE -> ../../blobs/HASH, outside the snapshot by design.
    snapshot = tmp_path / "models--me--x" / "snapshots" / "abc"
    (blobs := tmp_path / "models--me--x" / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in sorted(damaged.iterdir()):
        shutil.copy(path, blobs / f"blob-{path.name}")
        (snapshot / path.name).symlink_to(f"../../blobs/blob-{path.name}")
    load_portable(snapshot, Stack(None))


def test_missing_manifest(damaged):
    (damaged / "manifest.json").unlink()
    assert "not a portable checkpoint" in load_error(damaged)


def test_different_model_size(damaged):
    message = load_error(damaged, Stack(None, vocab=VOCAB + 20))
    assert "head.weight" in message and "different model size" in message


def test_config_mismatch(tmp_path):
    model = Stack(None)
    model.model_cfg = ModelConfig(d_model=32, n_heads=4)
    save_portable(model, tmp_path / "ckpt")
    other = Stack(None)
    other.model_cfg = ModelConfig(d_model=32, n_heads=8)
    assert "model.n_heads is 4 in the checkpoint but 8 in the model" in load_error(tmp_path / "ckpt", other)
    # Runtime-only keys do not matter.
    same = Stack(None)
    same.model_cfg = ModelConfig(d_model=32, n_heads=4, dropout=0.0)
    load_portable(tmp_path / "ckpt", same)


def test_unexpected_and_missing_tensors(damaged):
    model = Stack(None)
    model.extra = torch.nn.Linear(2, 2)
    assert "lacks 2 tensor(s) of the model" in load_error(damaged, model)
    model = Stack(None)
    del model.frozen_scale
    model.frozen_scale = torch.ones(32)  # a plain attribute now, not state
    assert "the model lacks" in load_error(damaged, model)


def test_never_overwrites_and_cleans_a_dead_save(tmp_path):
    model = Stack(None)
    save_portable(model, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="already exists"):
        save_portable(model, tmp_path / "ckpt")
    dead = tmp_path / ".other.partial"
    dead.mkdir()
    (dead / "junk").write_text("half a file")
    save_portable(model, tmp_path / "other")
    assert not dead.exists() and (tmp_path / "other" / "manifest.json").is_file()


def test_consolidate_and_inspect(saved, tmp_path):
    root, results = saved
    out = consolidate(root / "tp4", tmp_path / "single")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "manifest.json", "model.safetensors"]
    # Every file readable as the umask allows, the safetensors file too (the library creates it 0600).
    umask = os.umask(0)
    os.umask(umask)
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {oct(0o666 & ~umask)}
    from safetensors.torch import load_file

    tensors = load_file(str(out / "model.safetensors"))
    assert_same_state(tensors, results[4][1])
    # The consolidated directory is itself a portable checkpoint.
    model = Stack(None, seed=4)
    load_portable(out, model)
    assert_same_state(gathered_state(model, None), results[4][1])
    text = inspect(root / "tp4")
    assert "TP degree 4" in text and "head.weight" in text and "300x32" in text and "split dim 0" in text


# --------------------------------------------------------------------------- #
# The autoencoder.
# --------------------------------------------------------------------------- #

T, D, MODEL_VOCAB, MASK, PAD = 8, 32, 300, 298, 299
FACTS = {"vocab_size": MODEL_VOCAB, "mask_token_id": MASK, "pad_token_id": PAD, "eos_token_id": None}


def tiny_config(**model_overrides) -> Config:
    fields = dict(
        d_model=D,
        n_heads=4,
        n_encoder_layers=1,
        n_decoder_layers=1,
        max_length=T,
        dropout=0.1,
        vocab_size=MODEL_VOCAB,
        mask_token_id=MASK,
        pad_token_id=PAD,
    )
    model = ModelConfig(**{**fields, **model_overrides})
    return Config(model=model, feature_model=FeatureModelConfig(n_layer=3, n_head=4, n_embd=D, n_positions=32))


def tiny_batch():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MASK, (3, T), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    return ids.masked_fill(mask == 0, PAD), mask


@torch.no_grad()
def outputs(model: LatentAutoencoder):
    """(loss, full logits, decoded ids) of the test batch."""
    model.eval()
    ids, mask = tiny_batch()
    out = model(ids, mask, return_latents=True)
    logits = model.decoder(out.latents, ids.shape[1])
    group = model.tp_group
    if group is not None and torch.distributed.get_world_size(group) > 1:
        parts = [torch.empty_like(logits) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, logits.contiguous(), group=group)
        logits = torch.cat(parts, dim=-1)
    return out.loss.item(), logits[..., :MODEL_VOCAB], model.decode(out.latents, mask)


def save_model_task(tp: int, directory: str):
    state = initialize_model_parallel(tp)
    cfg = tiny_config()
    model = LatentAutoencoder(cfg.model, cfg.feature_model, tp_group=state.tp_group, seed=5)
    save_portable(model, directory, cfg, FACTS, state.tp_group, step=7)
    return outputs(model), gathered_state(model, state.tp_group)


def load_model_task(tp: int, directory: str):
    state = initialize_model_parallel(tp)
    cfg = tiny_config()
    model = LatentAutoencoder(cfg.model, cfg.feature_model, tp_group=state.tp_group, seed=99)
    load_portable(directory, model, state.tp_group)
    return outputs(model), gathered_state(model, state.tp_group)


@pytest.fixture(scope="module")
def saved_tp4(pool4, tmp_path_factory):
    directory = tmp_path_factory.mktemp("model") / "tp4"
    return directory, pool4.run(save_model_task, 4, str(directory))[0]


def assert_same(got, want, exact: bool):
    """The same weights give the same outputs: bit for bit at the same TP degree, within the
    summation-order bound at another."""
    (loss, logits, ids), state = got
    (want_loss, want_logits, want_ids), want_state = want
    if exact:
        assert loss == want_loss and torch.equal(logits, want_logits) and torch.equal(ids, want_ids)
    else:
        k = autoencoder_reduction_length(tiny_config().model, 3 * T, 4)
        assert abs(loss - want_loss) <= order_bound(k, terms_scale(abs(want_loss), k))
        assert_close_logits(logits, want_logits, k)
    assert state.keys() == want_state.keys()
    for name in want_state:
        assert torch.equal(state[name], want_state[name]), name


@pytest.mark.parametrize("tp", [2, 4])
def test_tp4_checkpoint_loads_at_tp(pool4, saved_tp4, tp):
    directory, want = saved_tp4
    assert_same(pool4.run(load_model_task, tp, str(directory))[0], want, exact=tp == 4)


def test_single_process_inference_load(saved_tp4, tmp_path):
    directory, want = saved_tp4
    model = load_autoencoder(directory)  # no process group; config from the manifest
    assert not model.training
    assert model.model_cfg == tiny_config().model
    assert_same((outputs(model), gathered_state(model, None)), want, exact=False)
    single = consolidate(directory, tmp_path / "single")
    assert_same((outputs(load_autoencoder(single)), gathered_state(load_autoencoder(single), None)), want, exact=False)


def test_other_model_size_fails_clearly(saved_tp4):
    directory, _ = saved_tp4
    cfg = tiny_config(n_encoder_layers=2)
    model = LatentAutoencoder(cfg.model, cfg.feature_model)
    with pytest.raises(CheckpointError, match=r"config mismatch: model\.n_encoder_layers is 1 in the checkpoint but 2"):
        load_portable(directory, model)


def test_gpt2_from_a_path_is_rebuilt_without_it(tmp_path):
    config = GPT2Config(
        n_layer=4, n_head=4, n_embd=D, vocab_size=290, n_positions=48, bos_token_id=None, eos_token_id=None
    )
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    cfg = tiny_config()
    cfg.feature_model = FeatureModelConfig(
        name_or_path=str(tmp_path / "gpt2"), pretrained=True, n_layer=12, n_head=12, n_embd=768
    )  # n_* are ignored when pretrained
    model = LatentAutoencoder(cfg.model, cfg.feature_model, seed=3)
    save_portable(model, tmp_path / "ckpt", cfg, FACTS)
    shutil.rmtree(tmp_path / "gpt2")  # gone, like a hub model on a machine without the hub
    loaded = load_autoencoder(tmp_path / "ckpt")
    assert len(loaded.feature_model.gpt2.h) == 2
    assert loaded.feature_cfg.pretrained is False and loaded.feature_cfg.n_layer == 4
    want, got = gathered_state(model, None), gathered_state(loaded, None)
    assert all(torch.equal(want[name], got[name]) for name in want)
    assert outputs(loaded)[0] == outputs(model)[0]


# A checkpoint loads from itself alone (tests/helpers/self_contained.py): the portable directory of an
# autoencoder with the offline GPT-2 tokenizer, and the training checkpoint of tests/checkpoint/fixtures.
TRAINING_CHECKPOINT = FIXTURE / "run" / "checkpoints" / "step_00000060"


@pytest.fixture(scope="module")
def own_portable(tmp_path_factory):
    autoencoder, cfg = tiny_autoencoder()
    return save_portable_copy(autoencoder, cfg, tmp_path_factory.mktemp("own") / "portable"), autoencoder


@pytest.mark.parametrize("edit", list(OUTSIDE))
@pytest.mark.parametrize("kind", ["portable", "training"])
def test_a_manifest_naming_something_outside_is_refused_in_one_line(kind, edit, own_portable, tmp_path, monkeypatch):
    """A GPT-2 whose shape only a path or hub id knows, or a tokenizer the checkpoint does not hold:
    one line naming the manifest and the key, exit status 2, and nothing outside is tried."""
    source, portable = (own_portable[0], "") if kind == "portable" else (TRAINING_CHECKPOINT, "model")
    checkpoint = edited_copy(source, tmp_path / "copy", portable, edit)
    guard_outside_reads(monkeypatch, checkpoint)
    manifest = checkpoint / portable / "manifest.json"
    assert_refused_by_cli(checkpoint, manifest, OUTSIDE[edit][1])
    assert_refused_by_api(checkpoint, manifest, OUTSIDE[edit][1])


def test_a_recorded_gpt2_loads_from_the_checkpoint_whatever_it_names(own_portable, tmp_path, monkeypatch):
    """``pretrained: true`` with a path or hub id, as a run on a pretrained GPT-2 records it, beside
    the recorded shape: built from the shape and filled from the files, nothing fetched."""
    directory, autoencoder = own_portable
    guard_outside_reads(monkeypatch, tmp_path)
    reconstructs(directory, autoencoder)
    edited = edited_copy(directory, tmp_path / "portable", "", "feature-model-path", keep_shape=True)
    reconstructs(edited, autoencoder)
    training = edited_copy(TRAINING_CHECKPOINT, tmp_path / "training", "model", "feature-model-hub-id", keep_shape=True)
    want, got = (gathered_state(load_autoencoder(path), None) for path in (TRAINING_CHECKPOINT, training))
    assert want.keys() == got.keys() and all(torch.equal(want[name], got[name]) for name in want)


def test_a_tokenizer_named_outside_is_taken_from_the_command_line(own_portable, tmp_path):
    directory, autoencoder = own_portable
    edited = edited_copy(directory, tmp_path / "portable", "", "tokenizer-hub-id")
    reconstructs(edited, autoencoder, "--tokenizer", "offline")
