"""`checkpoint.save_final=false` (what the GPU benchmark sets): a run that reaches max_steps writes
no checkpoint; a stop by a signal still writes one. A real Trainer in this process (one rank, gloo)."""

from __future__ import annotations

import json

import pytest

from parallel_latent.checkpoint.layout import INFO_FILE
from tests.helpers.trainer_runs import TINY, TINY_CONFIG


@pytest.fixture
def trainer_without_final_save(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from parallel_latent.config import load_config
    from parallel_latent.parallel import destroy_distributed
    from parallel_latent.training.startup import start_run
    from parallel_latent.training.trainer import Trainer

    def build(run_dir, max_steps):
        overrides = [*TINY, "parallel.tensor_parallel=1", f"logging.run_dir={run_dir}", "logging.print_samples=0"]
        no_saves = ["checkpoint.save_every=0", "checkpoint.save_final=false"]
        cfg = load_config(TINY_CONFIG, [*overrides, *no_saves, f"training.max_steps={max_steps}"])
        return Trainer(start_run(cfg))

    yield build
    destroy_distributed()


def test_no_final_checkpoint_at_max_steps_but_one_on_a_signal(trainer_without_final_save, tmp_path):
    from parallel_latent.training.trainer import StopRequest

    finished = trainer_without_final_save(tmp_path / "finished", 2).run(StopRequest())
    assert finished.stopped_by == "max_steps" and finished.step == 2
    assert finished.checkpoint is None
    assert not list((tmp_path / "finished").glob("checkpoints/step_*"))

    stop = StopRequest()
    stop.signal_name = "SIGTERM"  # what the handler sets when the signal arrives
    stopped = trainer_without_final_save(tmp_path / "stopped", 3).run(stop)
    assert stopped.stopped_by == "signal"  # the flag is agreed on a few steps later: any step
    latest = (tmp_path / "stopped" / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{stopped.step:08d}"
    # No evaluation ran (training.eval_every=0): the checkpoint still records the latents'
    # statistics of its own step, measured at the save on the evaluation's samples.
    info = json.loads((tmp_path / "stopped" / "checkpoints" / latest / INFO_FILE).read_text())
    stats = info["model_record"]["latent_stats"]
    assert stats["step"] == stopped.step and len(stats["std"]) == 32 and min(stats["std"]) > 0
