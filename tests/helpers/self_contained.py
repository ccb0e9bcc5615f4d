"""A checkpoint loads from itself alone: copies of a checkpoint whose manifest names a feature model or
a tokenizer outside it (a path that does not exist, a hub id that nobody can reach), the one-line
refusal they must meet from the command line and from the Python API, and a guard that fails a test
whenever something outside the checkpoint is opened through transformers or the hub.

The paths named do not exist and the hub is offline, so a loader that tried them would fail anyway;
the guard makes the test say that nothing was tried at all, whatever the machine's cache holds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from parallel_latent.api import TextAutoencoder
from parallel_latent.checkpoint import save_portable
from parallel_latent.config import Config, FeatureModelConfig, ModelConfig, config_to_dict
from parallel_latent.errors import ExitStatus
from parallel_latent.feature_model.features import random_features_unannounced
from parallel_latent.feature_model.tokenizer import (
    TOKENIZER_CONFIG_FILE,
    apply_tokenizer_facts,
    load_tokenizer,
    tokenizer_facts,
)
from parallel_latent.model import LatentAutoencoder
from tests.helpers.in_process_cli import run_main

OUTSIDE_PATH = "/nonexistent/parallel-latent-test/gpt2"
HUB_ID = "someone-else/their-model"
# Each edit: (what the manifest then names, the key the refusal names).
FEATURE_KEY = "feature_model_config.pretrained"
TOKENIZER_KEY = "config.tokenizer.name_or_path"
OUTSIDE = {
    "feature-model-path": (OUTSIDE_PATH, FEATURE_KEY),
    "feature-model-hub-id": (HUB_ID, FEATURE_KEY),
    "tokenizer-path": (OUTSIDE_PATH, TOKENIZER_KEY),
    "tokenizer-hub-id": (HUB_ID, TOKENIZER_KEY),
}
TEXTS = ["It is a truth universally acknowledged.", "Mr. Darcy bowed."]
# The files of a checkpoint directory that hold its record (a save-pretrained directory repeats the
# manifest's in config.json; both are edited so that the copy stays consistent with itself).
RECORD_FILES = ("manifest.json", "config.json")


def tiny_autoencoder(seed: int = 5) -> tuple[TextAutoencoder, Config]:
    """A tiny autoencoder with the offline GPT-2 tokenizer (so the inference commands load it), and
    its config."""
    cfg = Config(
        model=ModelConfig(d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, max_length=12, dropout=0.0),
        feature_model=FeatureModelConfig(n_layer=3, n_head=2, n_embd=32),
    )
    tokenizer = load_tokenizer(cfg.tokenizer)
    cfg = apply_tokenizer_facts(cfg, tokenizer_facts(tokenizer))
    with random_features_unannounced():
        model = LatentAutoencoder(cfg.model, cfg.feature_model, seed=seed)
    return TextAutoencoder(model.eval(), tokenizer), cfg


def save_portable_copy(autoencoder: TextAutoencoder, cfg: Config, directory: Path) -> Path:
    """``autoencoder`` as `parallel-latent export` writes it: shards, and a manifest with ``cfg``."""
    facts = tokenizer_facts(autoencoder.tokenizer)
    return save_portable(autoencoder.model, directory, config_to_dict(cfg), facts, step=7)


def edit_record(record: dict, edit: str, *, keep_shape: bool = False) -> None:
    """Make ``record`` name ``OUTSIDE[edit]``'s path or hub id as its GPT-2 (pretrained, without the
    recorded shape unless ``keep_shape``) or as its tokenizer."""
    name, key = OUTSIDE[edit]
    if key == FEATURE_KEY:
        record["feature_model_config"].update(pretrained=True, name_or_path=name)
        if not keep_shape:
            record.pop("feature_model_architecture", None)
    else:
        record["config"]["tokenizer"]["name_or_path"] = name


def edited_copy(
    source: Path, target: Path, portable: str, *edits: str, keep_shape: bool = False, keep_tokenizer: bool = False
) -> Path:
    """A copy of the checkpoint ``source`` as ``target`` whose record (in its ``portable``
    subdirectory: "" or "model") is changed by each of ``edits`` (:func:`edit_record`). A tokenizer
    edit also removes the tokenizer's own files, which would supply it from inside, unless
    ``keep_tokenizer``."""
    shutil.copytree(source, target)
    directory = target / portable
    for name in RECORD_FILES:
        if (directory / name).is_file():
            record = json.loads((directory / name).read_text())
            for edit in edits:
                edit_record(record, edit, keep_shape=keep_shape)
            (directory / name).write_text(json.dumps(record, indent=1))
    if not keep_tokenizer and any(OUTSIDE[edit][1] == TOKENIZER_KEY for edit in edits):
        (directory / TOKENIZER_CONFIG_FILE).unlink(missing_ok=True)
    return target


def guard_outside_reads(monkeypatch, inside: Path) -> list[str]:
    """Fail whenever the GPT-2 or a tokenizer is fetched by name, or the hub is asked, unless it is
    a tokenizer saved under ``inside`` read with ``local_files_only``; the allowed reads, listed."""
    import huggingface_hub
    import transformers

    allowed: list[str] = []

    def guarded(cls):
        original = cls.from_pretrained  # bound to cls; monkeypatch puts back what cls itself held

        def from_pretrained(klass, name, *args, **kwargs):
            if cls is transformers.AutoTokenizer and Path(str(name)).resolve().is_relative_to(inside.resolve()):
                assert kwargs.get("local_files_only"), f"{name}: read without local_files_only"
                allowed.append(str(name))
                return original(name, *args, **kwargs)
            raise AssertionError(f"{cls.__name__}.from_pretrained({name!r}): outside the checkpoint")

        return classmethod(from_pretrained)

    for cls in (transformers.AutoTokenizer, transformers.GPT2Model):
        monkeypatch.setattr(cls, "from_pretrained", guarded(cls))
    for name in ("snapshot_download", "hf_hub_download"):
        monkeypatch.setattr(huggingface_hub, name, lambda *a, name=name, **k: pytest.fail(f"{name}{a}: hub asked"))
    return allowed


def assert_refused_by_cli(checkpoint: Path, manifest: Path, key: str) -> None:
    """``reconstruct`` stops with one line naming the manifest and the key, exit status 2."""
    result = run_main(["reconstruct", "--checkpoint", str(checkpoint), *TEXTS], env={"HF_HUB_OFFLINE": "1"})
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == ExitStatus.BAD_INPUT, result.stderr
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(f"parallel-latent: error: {manifest}: {key}"), lines[0]
    assert "not read" in lines[0] and not result.stdout.strip()


def assert_refused_by_api(checkpoint: Path, manifest: Path, key: str) -> None:
    """``TextAutoencoder.from_pretrained`` raises a one-line CheckpointError naming the manifest and the key."""
    from parallel_latent.checkpoint import CheckpointError

    with pytest.raises(CheckpointError) as refused:
        TextAutoencoder.from_pretrained(checkpoint)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{manifest}: {key}"), message


def reconstructs(checkpoint: Path, want: TextAutoencoder, *options: str) -> None:
    """``reconstruct`` (with ``options``) loads ``checkpoint`` (exit status 0) and prints what
    ``want`` reconstructs."""
    argv = ["reconstruct", "--checkpoint", str(checkpoint), *options, *TEXTS]
    result = run_main(argv, env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    with torch.no_grad():
        for text in want.reconstruct(TEXTS):
            assert f"reconstructed: {text}" in result.stdout
