"""The one gate on transformers' release (feature_model/transformers_api.py): a release outside the range
whose internals the feature model uses is refused in one line, exit status 2, before a decoder is
built; the range is the one pyproject.toml pins."""

from __future__ import annotations

import re

import pytest

import parallel_latent.feature_model.transformers_api as api
from parallel_latent.config import config_from_dict
from parallel_latent.errors import ExitStatus, exit_status
from parallel_latent.model import build_model
from tests.helpers.trainer_runs import REPO


@pytest.mark.parametrize(
    ("version", "inside"),
    [("5.17.0", True), ("5.24.0", True), ("5.25.1.dev0", True), ("5.16.2", False), ("5.26.0", False), ("6.0", False)],
)
def test_the_supported_range(version, inside):
    assert api.supported(version) is inside
    if inside:
        api.require_supported_transformers(version)
        return
    with pytest.raises(api.TransformersVersionError) as error:
        api.require_supported_transformers(version)
    assert exit_status(error.value) == ExitStatus.BAD_INPUT
    assert str(error.value) == (
        f"transformers {version} is installed; the feature model runs and shards transformers' decoder layers "
        "through internals written for transformers>=5.17.0,<5.26 (parallel_latent/feature_model/transformers_api.py): "
        "pip install 'transformers>=5.17.0,<5.26'"
    )


def test_the_range_is_the_one_pyproject_pins_and_the_installed_release_is_in_it():
    import transformers

    pinned = re.search(r'"(transformers[^"]*)"', (REPO / "pyproject.toml").read_text()).group(1)
    (a, b, c), (d, e, _) = api.SUPPORTED
    assert pinned == f"transformers>={a}.{b}{'.' + str(c) if c else ''},<{d}.{e}"
    assert api.installed_version() == transformers.__version__ and api.supported()


def test_a_decoder_is_not_built_under_an_unsupported_release(monkeypatch):
    monkeypatch.setattr(api, "installed_version", lambda: "5.30.0")
    with pytest.raises(api.TransformersVersionError, match=r"^transformers 5\.30\.0 is installed"):
        build_model(config_from_dict({}))
