"""A pretrained decoder's files checked whole before a job is accepted (feature_model/weight_files.py):
each kind of damage named in one line with its file, a hub name neither cached nor reachable said
at once, and ``train --nproc 2`` refusing such a decoder with the run directory never made."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from parallel_latent import cli
from parallel_latent.config import ConfigError
from parallel_latent.errors import ExitStatus
from parallel_latent.feature_model.weight_files import check_decoder_files, weight_files_problem
from tests.helpers.decoders import HUB_COMMIT, into_hub_cache, offline_hub
from tests.helpers.trainer_runs import TINY, TINY_CONFIG

TENSORS = {"embed.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4), "steps": torch.tensor([1, 2])}


@pytest.fixture
def decoder(tmp_path):
    directory = tmp_path / "decoder"
    directory.mkdir()
    save_file(TENSORS, str(directory / "model.safetensors"))
    (directory / "config.json").write_text("{}")
    return directory


def test_an_intact_decoder_passes(decoder):
    assert weight_files_problem(decoder) is None


def _data_start(path) -> int:
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-5])


def _flip_header(path):
    data = bytearray(path.read_bytes())
    data[8] = ord("x")  # the header's opening brace
    path.write_bytes(bytes(data))


def _nan_weight(path):
    data = bytearray(path.read_bytes())
    offsets = json.loads(data[8 : _data_start(path)])["embed.weight"]["data_offsets"]
    at = _data_start(path) + offsets[0] + 4  # the second float
    data[at : at + 4] = struct.pack("<f", float("nan"))
    path.write_bytes(bytes(data))


def _link_out(path):
    outside = path.parent.parent / "elsewhere.safetensors"
    path.rename(outside)
    path.symlink_to(outside)


@pytest.mark.parametrize(
    "damage, expected",
    [
        (_truncate, "truncated"),
        (_flip_header, "its safetensors header is not JSON"),
        (_nan_weight, "tensor 'embed.weight' holds 1 NaN or infinite values"),
        (lambda p: p.write_bytes(b""), "0 bytes: truncated"),
        (_link_out, "outside the model's directory"),
        (lambda p: p.unlink(), "no weight files"),
    ],
    ids=["truncated", "header", "nan", "empty", "link-out", "missing"],
)
def test_each_kind_of_damage_is_named_with_its_file(decoder, damage, expected):
    damage(decoder / "model.safetensors")
    problem = weight_files_problem(decoder)
    assert problem is not None and expected in problem and str(decoder) in problem, problem


def test_an_index_and_torch_files_are_read_like_the_safetensors(decoder):
    (decoder / "model.safetensors").unlink()
    torch.save(TENSORS, decoder / "pytorch_model-1.bin")
    weight_map = {"embed.weight": "pytorch_model-1.bin", "steps": "pytorch_model-2.bin"}
    (decoder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert "pytorch_model-2.bin: missing (its index names it)" in weight_files_problem(decoder)
    torch.save({"x": torch.tensor([float("inf")])}, decoder / "pytorch_model-2.bin")
    assert "tensor 'x' holds 1 NaN or infinite values" in weight_files_problem(decoder)
    marker = decoder.parent / "ran"
    torch.save({"x": Payload(str(marker))}, decoder / "pytorch_model-2.bin")
    assert "does not load with weights_only=True" in weight_files_problem(decoder)
    assert not marker.exists()


class Payload:
    """An object whose unpickling would create a file."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_hub_name_neither_cached_nor_reachable_is_one_line_at_once(tmp_path, monkeypatch):
    from huggingface_hub import constants

    for name in ("PARALLEL_LATENT_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    with pytest.raises(ConfigError, match=r"cannot be reached") as caught:
        check_decoder_files("nobody/no-such-model")
    assert "\n" not in str(caught.value)
    with (
        offline_hub(tmp_path / "cache"),
        pytest.raises(ConfigError, match="not in the Hugging Face cache while offline"),
    ):
        check_decoder_files("nobody/no-such-model")


def test_a_cached_hub_snapshot_is_checked(tmp_path, decoder):
    repo = into_hub_cache(tmp_path / "cache", "org/tiny", decoder)
    _truncate(repo / "snapshots" / HUB_COMMIT / "model.safetensors")
    with (
        offline_hub(tmp_path / "cache"),
        pytest.raises(ConfigError, match=r"^feature_model.name_or_path=org/tiny: .*truncated"),
    ):
        check_decoder_files("org/tiny")


def test_train_refuses_a_damaged_decoder_before_the_run_directory_exists(tmp_path, capsys, decoder):
    _truncate(decoder / "model.safetensors")
    run_dir = tmp_path / "run"
    overrides = ["feature_model.pretrained=true", f"feature_model.name_or_path={decoder}"]
    argv = ["train", "--config", str(TINY_CONFIG), *TINY, f"logging.run_dir={run_dir}", *overrides, "--nproc=2"]
    assert cli.main(argv) == ExitStatus.BAD_INPUT
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"parallel-latent: error: feature_model.name_or_path={decoder}: {decoder}/"), lines
    assert not run_dir.exists()
