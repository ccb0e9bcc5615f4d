"""A bf16 training step, DeepSpeed's ZeRO-1/2 optimizer step included, neither makes the host wait
for the device nor builds a tensor from Python data, at DP=1 (this process), DP=2 and TP=2 (two
real gloo ranks); the sync-free step (engine.sync_free_zero_step) gives DeepSpeed's weights bit for bit,
and its checkpoints resume at another DP size exactly.

Counted by tests.helpers.op_counter.HostSyncCounter over the real ``Trainer.train_step``. On a CPU every
tensor is a host tensor, so the counter takes every tensor to live on the training device except,
by design on the host on CUDA too: the step counters of torch's non-fused AdamW (on CUDA the
optimizer runs fused, with its counters on the device; on a CPU foreach reads them with
``item()``). The stop vote (gloo control group, host tensors) runs only every
``training.vote_every`` steps and the counted steps are not vote steps; the statistics are read
only on log lines, outside ``train_step``."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.gpu import gpu_test
from tests.helpers.op_counter import HostSyncCounter
from tests.helpers.tp_compare import order_bound
from tests.helpers.trainer_runs import TINY, TINY_CONFIG, trained_weights

# Not vote steps (vote_every=10 and max_steps=10: the vote comes at step 10).
OVERRIDES = [
    *TINY,
    "parallel.tensor_parallel=1",
    "training.precision=bf16",
    "training.max_steps=10",
    "training.grad_accum_steps=2",
    "model.dropout=0.1",
]


def build_trainer(run_dir: str, *extra: str):
    from parallel_latent.config import load_config
    from parallel_latent.training.startup import start_run
    from parallel_latent.training.trainer import Trainer

    return Trainer(start_run(load_config(TINY_CONFIG, [*OVERRIDES, f"logging.run_dir={run_dir}", *extra])))


def host_step_counters(trainer) -> list[torch.Tensor]:
    """The step counters of the torch optimizer inside DeepSpeed's wrapper (host tensors unless fused)."""
    inner = trainer.bundle.optimizer.optimizer
    return [state["step"] for state in inner.state.values() if "step" in state and not state["step"].is_cuda]


def use_deepspeeds_own_step(trainer) -> None:
    """Back to DeepSpeed's own helpers: drop the methods bound to this optimizer instance."""
    optimizer = trainer.bundle.optimizer
    del optimizer.get_grad_norm_direct, optimizer.unscale_and_clip_grads


def counted_steps(trainer, steps: int = 2) -> HostSyncCounter:
    trainer.train_step()  # the first step creates the optimizer's state
    with HostSyncCounter(host_tensors=host_step_counters(trainer)) as counter:
        for _ in range(steps):
            trainer.train_step()
    return counter


def close(trainer) -> None:
    trainer.close()
    trainer.logger.close()
    trainer.job.release()  # the watchdog stops: a pool's rank lives on after this task


@pytest.fixture
def cpu_accelerator(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from parallel_latent.parallel import destroy_distributed

    yield
    destroy_distributed()


def test_the_counter_flags_device_reads_and_tensors_from_python_data_but_not_host_tensors():
    device_value, host_counter = torch.ones(3), torch.zeros(())
    with HostSyncCounter(host_tensors=[host_counter]) as counter:
        float(device_value.sum())  # a device read
        device_value.cpu()  # a copy to the host
        device_value[device_value > 0]  # a boolean mask: a data-dependent shape
        torch.tensor(-1.0)  # a tensor from Python data
        host_counter.item()  # a host tensor: no wait
        device_value.mul_(2.0)  # a kernel with a Python scalar: nothing to copy
    assert sum(counter.syncs.values()) == 3, counter.syncs
    assert [s.split(" at ")[0] for s in counter.syncs] == [
        "aten._local_scalar_dense.default",
        "Tensor.cpu",
        "aten.index.Tensor",
    ]
    assert sum(counter.from_python_callers.values()) == 1


def test_the_one_exclusion_is_the_foreach_adamw_step_counter_the_fused_one_has_none():
    """The counted steps declare the AdamW step counters host tensors: on a CPU torch's AdamW runs
    foreach and reads each counter with item(); on CUDA build_optimizer asks for the fused kernel,
    whose counters stay on the device and are never read. Both run here, on the CPU."""

    def counted_second_step(**kind):
        params = [torch.nn.Parameter(torch.randn(10)), torch.nn.Parameter(torch.randn(3, 3))]
        optimizer = torch.optim.AdamW(params, lr=1e-3, **kind)
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()  # creates the state
        with HostSyncCounter() as counter:
            optimizer.step()
        return counter

    foreach, fused = counted_second_step(foreach=True), counted_second_step(fused=True)
    assert sum(foreach.syncs.values()) == 2 * 2  # item() of each counter, for both bias corrections
    assert dict(fused.syncs) == {} and dict(fused.from_python_callers) == {}
    assert fused.ops["aten._fused_adamw_.default"] == 1


@pytest.mark.parametrize("stage", [1, 2])
def test_a_bf16_step_at_dp1_waits_for_nothing_and_builds_nothing_from_python_data(cpu_accelerator, tmp_path, stage):
    trainer = build_trainer(str(tmp_path / "run"), f"parallel.zero_stage={stage}")
    try:
        counter = counted_steps(trainer)
        assert counter.ops["aten._foreach_norm.Scalar"] == 2 * 2  # the step ran, with our norm (2 groups)
        assert dict(counter.syncs) == {}
        assert dict(counter.from_python_callers) == {}
        # The counter sees what DeepSpeed's own helpers do: per step and parameter group, one
        # bool() of the norm (is_invalid_grad_norm) and one torch.tensor(-1.0) (the norm's mask).
        use_deepspeeds_own_step(trainer)
        before = counted_steps(trainer, steps=1)
        assert sum(before.syncs.values()) == 2 and all("deepspeed/runtime/utils.py" in s for s in before.syncs)
        assert sum(before.from_python_callers.values()) == 2
        assert all(c.startswith("deepspeed/runtime/utils.py") for c in before.from_python_callers)
    finally:
        close(trainer)


def test_the_sync_free_step_gives_deepspeeds_weights_bit_for_bit(cpu_accelerator, tmp_path):
    """Same run, DeepSpeed's step path and ours, 3 steps that all clip (grad_clip below every
    norm, so the clip coefficient, computed from the norm, reaches every weight)."""
    clip = ["optimizer.grad_clip=0.01", "parallel.zero_stage=2"]
    theirs = build_trainer(str(tmp_path / "theirs"), *clip)
    use_deepspeeds_own_step(theirs)
    try:
        want, want_norms = trained_weights(theirs, 3)
    finally:
        close(theirs)
    from parallel_latent.parallel import destroy_distributed

    destroy_distributed()
    ours = build_trainer(str(tmp_path / "ours"), *clip)
    try:
        got, got_norms = trained_weights(ours, 3)
    finally:
        close(ours)
    assert min(want_norms) > 0.01  # every step clipped
    assert got_norms == want_norms
    assert want.keys() == got.keys()
    unequal = [name for name in want if not torch.equal(want[name], got[name])]
    assert unequal == []


def two_rank_sync_task(run_dir: str, tensor_parallel: int):
    import os

    os.environ["DS_ACCELERATOR"] = "cpu"
    trainer = build_trainer(run_dir, f"parallel.tensor_parallel={tensor_parallel}", "parallel.zero_stage=2")
    try:
        counter = counted_steps(trainer)
        return dict(counter.syncs), dict(counter.from_python_callers), counter.ops["aten._foreach_norm.Scalar"]
    finally:
        close(trainer)


@pytest.mark.parametrize("tensor_parallel", [1, 2], ids=["dp2", "tp2"])
def test_a_bf16_step_on_two_ranks_waits_for_nothing_and_builds_nothing_from_python_data(
    pool2, tmp_path, tensor_parallel
):
    """ZeRO-2 over two gloo ranks, as DP=2 (the gradient reduction in backward, the step's
    all-reduces and all-gather) or TP=2 (the norm's model-parallel all-reduce, split and
    replicated parameters): no host wait and no tensor from Python data."""
    for syncs, from_python, norms in pool2.run(two_rank_sync_task, str(tmp_path / "run"), tensor_parallel):
        assert norms == 2 * 2
        assert syncs == {}
        assert from_python == {}


RESUME_RECIPE = [
    "training.precision=bf16",
    "parallel.tensor_parallel=1",
    "parallel.zero_stage=2",
    "model.dropout=0.1",
    "training.max_steps=4",
    "checkpoint.save_every=2",
    "checkpoint.keep_last=2",
    "checkpoint.export_portable=true",
    # The gradient norm is a sum over each rank's partition, so its rounding depends on the DP size:
    # a clip by it would carry that rounding into the weights. Logged, not applied, it cannot.
    "optimizer.grad_clip=0",
]


@pytest.mark.slow
@pytest.mark.parametrize("straight_dp,resumed_dp", [(2, 1), (1, 2)], ids=["dp2-to-dp1", "dp1-to-dp2"])
def test_a_bf16_run_resumed_at_another_dp_equals_the_uninterrupted_run(pool2, tmp_path, straight_dp, resumed_dp):
    """The sync-free step's optimizer state is DeepSpeed ZeRO's, in its one checkpoint format: a
    bf16 run saved at step 2 and resumed at another data-parallel size trains steps 3-4 exactly as
    the uninterrupted run. Exactly, because the global batch of 8 is kept as micro-batches of 4
    (2 accumulated at DP=1, one per rank at DP=2): each micro-batch is the same samples in the same
    shapes, so forward and backward are the same operations; the two micro-batch gradients are
    summed in fp32 either way (a + b = b + a), and the factor 1/2 (DeepSpeed's mean over
    accumulation or over ranks) is exact in binary floating point. The logged gradient norm is the
    one figure summed in another order (over each rank's partition, then over the ranks): it is
    within the bound of a sum of its squares' terms in fp32 (no clip applies it: the recipe).

    The runs are ``parallel-latent train`` in this process (DP=1) and on the module's two gloo ranks
    (DP=2), whose imports are paid once."""
    from parallel_latent.checkpoint import PortableCheckpoint
    from tests.helpers.in_process_cli import run_main, train_on_pool
    from tests.helpers.trainer_runs import by_step, copy_checkpoint, describe, train_args

    def launch(run_dir, *overrides, dp: int):
        if dp == 1:  # one process: this one (tests/helpers/in_process_cli.py)
            return run_main(train_args(run_dir, *overrides))
        return train_on_pool(pool2, TINY_CONFIG, [*TINY, *overrides, f"logging.run_dir={run_dir}"])

    def final_weights(run_dir):
        checkpoint = PortableCheckpoint(run_dir / "checkpoints" / "step_00000004" / "model")
        return {name: checkpoint.read_full(name) for name in checkpoint.tensors}

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    accumulate = f"training.grad_accum_steps={2 // straight_dp}"  # a global batch of 8 either way
    result = launch(straight, *RESUME_RECIPE, accumulate, dp=straight_dp)
    assert result.returncode == 0, describe(result)
    copy_checkpoint(straight, 2, resumed)
    result = launch(resumed, *RESUME_RECIPE, dp=resumed_dp)
    assert result.returncode == 0, describe(result)
    assert "at step 2 (resharded from another layout)" in result.stdout
    assert f"TP 1 x DP {resumed_dp}" in result.stdout and "global batch 8;" in result.stdout
    want, got = by_step(straight), by_step(resumed)
    assert sorted(got) == [3, 4]
    want_weights, got_weights = final_weights(straight), final_weights(resumed)
    gradients = sum(weight.numel() for weight in want_weights.values())  # at least the terms of the norm
    for step in got:
        for key in ("loss", "lr", "tokens", "samples"):
            assert got[step][key] == want[step][key], (step, key, got[step][key], want[step][key])
        norm = want[step]["grad_norm"]
        assert abs(got[step]["grad_norm"] - norm) <= order_bound(gradients, norm), (step, got[step], want[step])
    assert want_weights.keys() == got_weights.keys()
    assert [name for name in want_weights if not torch.equal(want_weights[name], got_weights[name])] == []


@gpu_test
def test_on_cuda_a_bf16_step_waits_for_nothing(tmp_path):
    """A real bf16 run on this GPU counts its third step's host synchronisations with torch's sync
    debug mode (``logging.count_syncs_at_step``): none."""
    from parallel_latent.cli import main
    from parallel_latent.files import read_jsonl

    run_dir = tmp_path / "run"
    settings = [*OVERRIDES, "training.device=cuda", "training.max_steps=4", "logging.count_syncs_at_step=3"]
    assert main(["train", "--config", str(TINY_CONFIG), *settings, f"logging.run_dir={run_dir}"]) == 0
    [syncs] = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "syncs"]
    assert syncs["step"] == 3 and syncs["count"] == 0, syncs
