"""DeepSpeed's private API in one module, checked against the releases it was written for: inside the
range the patches apply; outside it, what only speeds DeepSpeed up is skipped with one warning
(DeepSpeed's own code runs), and what safety depends on (the checkpoint engine's patches) stops the
job before any work with one line and exit status 2."""

from __future__ import annotations

import logging

import pytest

from parallel_latent import deepspeed_patches
from parallel_latent.cli import main
from parallel_latent.errors import ExitStatus, exit_status
from tests.helpers.trainer_runs import TINY, TINY_CONFIG

OUTSIDE = "0.21.0"


@pytest.mark.parametrize(
    ("version", "inside"),
    [("0.19.8", True), ("0.19.12", True), ("0.19.9+cu130", True), ("0.19.7", False), ("0.20.0", False), ("1.0", False)],
)
def test_the_supported_range(version, inside):
    assert deepspeed_patches.supported(version) is inside
    if inside:
        deepspeed_patches.require_supported_deepspeed(version)
    else:
        with pytest.raises(deepspeed_patches.DeepSpeedVersionError) as error:
            deepspeed_patches.require_supported_deepspeed(version)
        assert exit_status(error.value) == ExitStatus.BAD_INPUT
        assert str(error.value) == (
            f"DeepSpeed {version} is installed, but parallel-latent's checkpoints patch DeepSpeed's checkpoint "
            "engine as releases >=0.19.8,<0.20 have it: pip install 'deepspeed>=0.19.8,<0.20'"
        )


def test_the_installed_deepspeed_is_inside_the_range():
    import deepspeed

    assert deepspeed_patches.installed_version() == deepspeed.__version__
    assert deepspeed_patches.supported()


@pytest.fixture
def bf16_trainer(tmp_path, monkeypatch):
    """A real bf16 ZeRO-2 trainer in this process (one rank, gloo), before its first step."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from parallel_latent.config import load_config
    from parallel_latent.parallel import destroy_distributed
    from parallel_latent.training.startup import start_run
    from parallel_latent.training.trainer import Trainer

    overrides = [*TINY, "parallel.tensor_parallel=1", "training.precision=bf16", "training.max_steps=4"]
    trainer = Trainer(start_run(load_config(TINY_CONFIG, [*overrides, f"logging.run_dir={tmp_path / 'run'}"])))
    yield trainer
    trainer.close()
    trainer.job.release()
    destroy_distributed()


def test_outside_the_range_the_sync_free_step_is_skipped_with_one_warning_and_deepspeeds_own_step_runs(
    bf16_trainer, caplog
):
    optimizer = bf16_trainer.bundle.optimizer
    # Inside the range start-up bound the sync-free helpers to this optimizer instance.
    assert {"get_grad_norm_direct", "unscale_and_clip_grads"} <= set(vars(optimizer))
    del optimizer.get_grad_norm_direct, optimizer.unscale_and_clip_grads
    with caplog.at_level(logging.WARNING, logger="parallel_latent"):
        assert deepspeed_patches.sync_free_zero_step(optimizer, version=OUTSIDE) is False
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"DeepSpeed {OUTSIDE} is outside the releases >=0.19.8,<0.20 that parallel-latent's sync-free bf16 "
        "ZeRO-1/2 step was written for: skipped, DeepSpeed's own code runs instead (correct, slower)"
    ]
    assert not {"get_grad_norm_direct", "unscale_and_clip_grads"} & set(vars(optimizer))
    before = [p.detach().clone() for p in bf16_trainer.model.trainable_parameters()]
    outcome = bf16_trainer.train_step()  # DeepSpeed's own ZeRO-2 step
    after = list(bf16_trainer.model.trainable_parameters())
    assert outcome.applied
    assert any(not p.equal(q) for p, q in zip(before, after, strict=True))
    assert all(p.isfinite().all() for p in after)
    # And inside the range it binds them again.
    assert deepspeed_patches.sync_free_zero_step(optimizer) is True
    assert {"get_grad_norm_direct", "unscale_and_clip_grads"} <= set(vars(optimizer))


def test_outside_the_range_the_cpu_comm_kernel_is_left_to_deepspeed_with_one_warning(monkeypatch, caplog):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().create_op_builder("ShareMemCommBuilder").NAME
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, name, "as DeepSpeed found it")
    with caplog.at_level(logging.WARNING, logger="parallel_latent"):
        deepspeed_patches.skip_unused_cpu_comm_kernel(version=OUTSIDE)
    assert deepspeed.ops.__compatible_ops__[name] == "as DeepSpeed found it"
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        f"DeepSpeed {OUTSIDE} is outside the releases >=0.19.8,<0.20 that parallel-latent's skip of the unused "
        "CPU communication kernel was written for"
    ]
    deepspeed_patches.skip_unused_cpu_comm_kernel()
    assert deepspeed.ops.__compatible_ops__[name] is False


@pytest.mark.parametrize("nproc", [[], ["--nproc", "2"]], ids=["one process", "--nproc 2"])
def test_outside_the_range_training_stops_before_any_work_with_one_line(nproc, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(deepspeed_patches, "installed_version", lambda: OUTSIDE)
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
