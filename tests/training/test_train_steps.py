"""What one training step costs the host: nothing in the trainer reads a device value between log
lines (each such read is a device synchronisation on a GPU), builds a tensor from Python data, or
copies host memory to the device except the batches (pinned on a GPU, copied without blocking). A
real Trainer in this process (one rank, gloo), DeepSpeed ZeRO-2."""

from __future__ import annotations

import collections
import traceback
from pathlib import Path

import pytest
import torch

from tests.helpers.op_counter import OpCounter
from tests.helpers.trainer_runs import TINY, TINY_CONFIG

# The calls that wait for the device: explicit reads, and Python conversions of a tensor.
READS = ("item", "cpu", "tolist", "__bool__", "__float__", "__int__")
PACKAGE = str(Path(__file__).resolve().parents[2] / "parallel_latent")


def _caller(stack) -> str:
    """The first frame outside torch's tensor wrappers and this test: who asked for the value."""
    for frame in reversed(stack[:-2]):
        if "/torch/_tensor" not in frame.filename and frame.filename != __file__:
            return frame.filename
    return "?"


@pytest.fixture(params=[0.1, 0.0], ids=["dropout", "no-dropout"])
def trainer(request, tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from parallel_latent.config import load_config
    from parallel_latent.parallel import destroy_distributed
    from parallel_latent.training.startup import start_run
    from parallel_latent.training.trainer import Trainer

    overrides = [*TINY, "parallel.tensor_parallel=1", f"logging.run_dir={tmp_path / 'run'}", "training.max_steps=10"]
    cfg = load_config(TINY_CONFIG, [*overrides, f"model.dropout={request.param}", "training.grad_accum_steps=2"])
    trainer = Trainer(start_run(cfg))
    yield trainer
    trainer.close()
    trainer.logger.close()
    destroy_distributed()


def test_a_training_step_reads_nothing_from_the_device(trainer, monkeypatch):
    trainer.train_step()  # the first step creates the optimizer's state
    calls = collections.Counter()
    synchronize = torch.cuda.synchronize
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            calls[_caller(traceback.extract_stack())] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.update(["torch.cuda.synchronize"]))
    steps = 3
    for _ in range(steps):
        trainer.train_step()
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    ours = {caller: n for caller, n in calls.items() if caller.startswith(PACKAGE)}
    assert ours == {}, f"the trainer reads device values at every step: {ours}"
    # What is left is DeepSpeed's check for a non-finite gradient norm (the skip decision) and
    # torch's AdamW reading its step counter (a host tensor unless fused on CUDA).
    assert all("/deepspeed/" in caller or "/torch/optim/" in caller for caller in calls), calls
    assert sum(calls.values()) <= 5 * steps, calls
    assert "torch.cuda.synchronize" not in calls


def test_a_training_step_builds_nothing_from_python_data_and_copies_only_the_batches(trainer, monkeypatch):
    """Forward, backward and optimizer step (two accumulated micro-batches): no tensor built from
    Python data by the package (each would be a blocking copy on a GPU), and the only host-to-device
    transfers the package asks for are the batches, without blocking."""
    trainer.train_step()  # warm-up: the optimizer's state, the dropout index caches
    transfers = []
    to = torch.Tensor.to

    def recorded_to(self, *args, **kwargs):
        if any(isinstance(a, (torch.device, str)) for a in args) or "device" in kwargs:
            caller = _caller(traceback.extract_stack())
            if caller.startswith(PACKAGE):
                transfers.append((Path(caller).name, kwargs.get("non_blocking", False), tuple(self.shape)))
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", recorded_to)
    with OpCounter() as counter:
        trainer.train_step()
    assert counter.total > 100  # the step did run under the counter
    ours = [caller for caller in counter.from_python_data if caller is not None]
    assert ours == [], f"tensors built from Python data inside a step: {ours}"
    batch = (trainer.micro_batch, trainer.cfg.model.max_length)
    assert transfers == [("trainer.py", True, batch)] * 4  # ids and mask of 2 micro-batches, non-blocking


def test_start_up_resolves_the_device_once(tmp_path, monkeypatch):
    """Preflight resolves training.device; the engine, its DeepSpeed config and the run take that
    answer instead of asking again."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    import parallel_latent.training.engine_setup as engine_setup
    import parallel_latent.training.preflight as preflight
    from parallel_latent.config import load_config
    from parallel_latent.parallel import destroy_distributed
    from parallel_latent.training.startup import start_run

    calls = []
    resolve = preflight.resolve_device

    def counted(*args, **kwargs):
        calls.append(args)
        return resolve(*args, **kwargs)

    for module in (preflight, engine_setup):
        monkeypatch.setattr(module, "resolve_device", counted)
    overrides = [*TINY, "parallel.tensor_parallel=1", f"logging.run_dir={tmp_path / 'run'}", "training.max_steps=1"]
    run = start_run(load_config(TINY_CONFIG, overrides))
    try:
        assert run.device_kind == "cpu" and len(calls) == 1, calls
    finally:
        run.release()
        destroy_distributed()
