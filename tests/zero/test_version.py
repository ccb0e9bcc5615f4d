"""The one gate on DeepSpeed's release: what safety depends on (the checkpoint engine's patches,
DeepSpeed's private checkpoint keys) refuses a release outside the range with one line and exit
status 2, the same line wherever it is asked, and a job stops before any work; what only speeds
DeepSpeed up is skipped with one warning (tests/zero/test_patches.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

import parallel_latent.zero.version as zero_version
from parallel_latent.cli import main
from parallel_latent.errors import ExitStatus, exit_status
from parallel_latent.zero import patches
from parallel_latent.zero.checkpoint_files import safe_torch_load
from parallel_latent.zero.params import gathered
from tests.helpers.trainer_runs import TINY, TINY_CONFIG

OUTSIDE = "0.21.0"


def refusal(version: str) -> str:
    return (
        f"DeepSpeed {version} is installed, but parallel-latent's checkpoints patch DeepSpeed's checkpoint "
        "engine as releases >=0.19.8,<0.20 have it: pip install 'deepspeed>=0.19.8,<0.20'"
    )


@pytest.mark.parametrize(
    ("version", "inside"),
    [("0.19.8", True), ("0.19.12", True), ("0.19.9+cu130", True), ("0.19.7", False), ("0.20.0", False), ("1.0", False)],
)
def test_the_supported_range(version, inside):
    assert zero_version.supported(version) is inside
    if inside:
        zero_version.require_supported_deepspeed(version)
    else:
        with pytest.raises(zero_version.DeepSpeedVersionError) as error:
            zero_version.require_supported_deepspeed(version)
        assert exit_status(error.value) == ExitStatus.BAD_INPUT
        assert str(error.value) == (
            f"DeepSpeed {version} is installed, but parallel-latent's checkpoints patch DeepSpeed's checkpoint "
            "engine as releases >=0.19.8,<0.20 have it: pip install 'deepspeed>=0.19.8,<0.20'"
        )


def test_the_installed_deepspeed_is_inside_the_range():
    import deepspeed

    assert zero_version.installed_version() == deepspeed.__version__
    assert zero_version.supported()


@pytest.mark.parametrize("version", ["0.19.0", "0.20.1"])
def test_every_part_refuses_an_unsupported_deepspeed_with_the_same_line(version, tmp_path, monkeypatch):
    """One gate for the job's checks, the checkpoint engine's patches and the code that reads
    DeepSpeed's private checkpoint keys and ZeRO's state: 0.19.0 (inside the 0.19 series, before the
    first release the patches were written for) and 0.20.1 are refused alike, before DeepSpeed is
    touched."""
    from parallel_latent.config import load_config
    from parallel_latent.training.preflight import preflight

    monkeypatch.setattr(zero_version, "installed_version", lambda: version)
    zero3 = torch.nn.Parameter(torch.zeros(2))
    zero3.ds_id = 0  # what ZeRO-3 marks the parameters it converted with
    engine = SimpleNamespace()  # never reached: the gate refuses first
    cfg = load_config(TINY_CONFIG, [*TINY, f"logging.run_dir={tmp_path / 'run'}"])
    uses = {
        "the job's checks": lambda: preflight(cfg, 1),
        "DeepSpeed for its private state": zero_version.import_deepspeed,
        "the weights-only load": lambda: safe_torch_load(tmp_path / "missing.pt"),
        "the checkpoint engine's reads": lambda: patches.checkpoint_reads(engine, torch.load),
        "the checkpoint engine's writes": lambda: patches.checkpoint_writes(engine, None, None, None).__enter__(),
        "ZeRO-3's gather": lambda: gathered([zero3]),
    }
    for use, call in uses.items():
        with pytest.raises(zero_version.DeepSpeedVersionError) as error:
            call()
        assert str(error.value) == refusal(version), use
        assert exit_status(error.value) == ExitStatus.BAD_INPUT, use


def test_every_speed_up_skips_an_unsupported_deepspeed_with_the_same_warning(monkeypatch, caplog):
    """The patches that only speed DeepSpeed up ask the same gate for the installed release (0.19.0):
    each is skipped with one warning of the same form, and DeepSpeed's own code stays."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    import deepspeed.ops
    import deepspeed.runtime.engine as ds_engine
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(zero_version, "installed_version", lambda: "0.19.0")
    name = get_accelerator().create_op_builder("ShareMemCommBuilder").NAME
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, name, "as DeepSpeed found it")
    deepspeeds = ds_engine.is_zero_supported_optimizer
    with caplog.at_level(logging.WARNING, logger="parallel_latent"):
        patches.skip_unused_cpu_comm_kernel()
        with patches.zero_optimizer_check_without_muon():
            assert ds_engine.is_zero_supported_optimizer is deepspeeds
    assert deepspeed.ops.__compatible_ops__[name] == "as DeepSpeed found it"
    assert [r.getMessage() for r in caplog.records] == [
        f"DeepSpeed 0.19.0 is outside the releases >=0.19.8,<0.20 that parallel-latent's {what} was written "
        "for: skipped, DeepSpeed's own code runs instead (correct, slower)"
        for what in ("skip of the unused CPU communication kernel", "ZeRO optimizer check without the Muon import")
    ]


@pytest.mark.parametrize("nproc", [[], ["--nproc", "2"]], ids=["one process", "--nproc 2"])
def test_outside_the_range_training_stops_before_any_work_with_one_line(nproc, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(zero_version, "installed_version", lambda: OUTSIDE)
    run_dir = tmp_path / "run"
    tp = "parallel.tensor_parallel=1" if not nproc else "parallel.tensor_parallel=2"
    status = main(["train", "--config", str(TINY_CONFIG), *nproc, *TINY, tp, f"logging.run_dir={run_dir}"])
    assert status == ExitStatus.BAD_INPUT
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"parallel-latent: error: DeepSpeed {OUTSIDE} is installed, but parallel-latent's checkpoints patch "
        "DeepSpeed's checkpoint engine as releases >=0.19.8,<0.20 have it: pip install 'deepspeed>=0.19.8,<0.20'"
    ]
    assert not run_dir.exists()
