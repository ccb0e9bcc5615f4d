"""The patches of DeepSpeed's private API, checked against the releases they were written for: inside
the range they apply and give DeepSpeed's results; outside it, what only speeds DeepSpeed up is
skipped with one warning (DeepSpeed's own code runs). What safety depends on is the gate's
(tests/zero/test_version.py)."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from parallel_latent.zero import patches
from tests.helpers.gpu import gpu_test
from tests.helpers.trainer_runs import TINY, TINY_CONFIG, trained_weights

OUTSIDE = "0.21.0"


@contextlib.contextmanager
def tiny_bf16_trainer(run_dir, *extra: str):
    """A real bf16 ZeRO-2 trainer in this process (one rank, gloo), before its first step."""
    from parallel_latent.config import load_config
    from parallel_latent.parallel import destroy_distributed
    from parallel_latent.training.startup import start_run
    from parallel_latent.training.trainer import Trainer

    # On a pool's rank the world is the pool's and outlives this trainer (the pool releases the
    # trainer's groups when the task returns).
    pool_rank = torch.distributed.is_initialized()
    overrides = [*TINY, "parallel.tensor_parallel=1", "training.precision=bf16", "training.max_steps=4"]
    trainer = Trainer(start_run(load_config(TINY_CONFIG, [*overrides, f"logging.run_dir={run_dir}", *extra])))
    try:
        yield trainer
    finally:
        trainer.close()
        trainer.job.release()
        if not pool_rank:
            destroy_distributed()


@pytest.fixture
def bf16_trainer(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    with tiny_bf16_trainer(tmp_path / "run") as trainer:
        yield trainer


def test_outside_the_range_the_sync_free_step_is_skipped_with_one_warning_and_deepspeeds_own_step_runs(
    bf16_trainer, caplog
):
    optimizer = bf16_trainer.bundle.optimizer
    # Inside the range start-up bound the sync-free helpers to this optimizer instance.
    assert {"get_grad_norm_direct", "unscale_and_clip_grads"} <= set(vars(optimizer))
    del optimizer.get_grad_norm_direct, optimizer.unscale_and_clip_grads
    with caplog.at_level(logging.WARNING, logger="parallel_latent"):
        assert patches.sync_free_zero_step(optimizer, version=OUTSIDE) is False
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
    assert patches.sync_free_zero_step(optimizer) is True
    assert {"get_grad_norm_direct", "unscale_and_clip_grads"} <= set(vars(optimizer))


def test_outside_the_range_the_cpu_comm_kernel_is_left_to_deepspeed_with_one_warning(monkeypatch, caplog):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().create_op_builder("ShareMemCommBuilder").NAME
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, name, "as DeepSpeed found it")
    with caplog.at_level(logging.WARNING, logger="parallel_latent"):
        patches.skip_unused_cpu_comm_kernel(version=OUTSIDE)
    assert deepspeed.ops.__compatible_ops__[name] == "as DeepSpeed found it"
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        f"DeepSpeed {OUTSIDE} is outside the releases >=0.19.8,<0.20 that parallel-latent's skip of the unused "
        "CPU communication kernel was written for"
    ]
    patches.skip_unused_cpu_comm_kernel()
    assert deepspeed.ops.__compatible_ops__[name] is False


def test_zeros_optimizer_check_answers_from_deepspeeds_list_without_importing_muon(monkeypatch, caplog):
    """Inside the range, the engine's check answers as DeepSpeed's would for the optimizers the
    trainer builds (AdamW is in its list; SGD and the guarded AdamW, a subclass, are not: ZeRO then
    needs ``zero_allow_untested_optimizer``, which the config sets) and never imports Muon (here any
    import of it would raise); outside the range, one warning and DeepSpeed's own check stays."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    import sys

    import deepspeed.runtime.engine as ds_engine

    from parallel_latent.zero.engine import NonFiniteGuardAdamW

    deepspeeds = ds_engine.is_zero_supported_optimizer
    params = [torch.nn.Parameter(torch.zeros(2))]
    optimizers = [torch.optim.AdamW(params), torch.optim.SGD(params, lr=0.1)]
    optimizers.append(NonFiniteGuardAdamW(params, max_grad_norm=1.0, mpu=None))
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.zero.muon.muon_optimizer", None)  # importing it raises
    with patches.zero_optimizer_check_without_muon():
        assert ds_engine.is_zero_supported_optimizer is not deepspeeds
        assert [ds_engine.is_zero_supported_optimizer(optimizer) for optimizer in optimizers] == [True, False, False]
    assert ds_engine.is_zero_supported_optimizer is deepspeeds
    outside = patches.zero_optimizer_check_without_muon(version=OUTSIDE)
    with caplog.at_level(logging.WARNING, logger="parallel_latent"), outside:
        assert ds_engine.is_zero_supported_optimizer is deepspeeds
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        f"DeepSpeed {OUTSIDE} is outside the releases >=0.19.8,<0.20 that parallel-latent's ZeRO optimizer check "
        "without the Muon import was written for"
    ]


# --------------------------------------------------------------------------- #
# ZeRO-1/2's gradients in bulk.
# --------------------------------------------------------------------------- #


def bf16_steps(run_dir, *extra: str, steps: int = 3):
    """Weights, fp32 masters and gradient norms after ``steps`` bf16 steps that all clip."""
    with tiny_bf16_trainer(run_dir, "optimizer.grad_clip=0.01", "model.dropout=0.1", *extra) as trainer:
        return trained_weights(trainer, steps)


@pytest.mark.parametrize(("stage", "accumulation"), [(1, 1), (2, 1), (1, 2)])
def test_bulk_gradients_give_deepspeeds_weights_bit_for_bit_at_dp1(monkeypatch, tmp_path, stage, accumulation):
    """One rank: DeepSpeed's bucket copies and its one-rank reduction are exact, and at ZeRO-1 both
    paths sum micro-batches in the parameters' bf16 ``.grad``: the same weights, masters and norms."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    layout = [f"parallel.zero_stage={stage}", f"training.grad_accum_steps={accumulation}"]
    theirs, their_norms = bf16_steps(tmp_path / "theirs", *layout, "parallel.zero_gradients=deepspeed")
    ours, our_norms = bf16_steps(tmp_path / "ours", *layout)
    assert min(their_norms) > 0.01 and our_norms == their_norms
    assert theirs.keys() == ours.keys()
    assert [name for name in theirs if not torch.equal(theirs[name], ours[name])] == []


def test_zero2_sums_the_micro_batches_in_fp32_and_hands_the_step_its_flat_partition(tmp_path, monkeypatch):
    """Each micro-batch's bf16 gradients land in the fp32 flat as they are (the first copied, the
    second added): the step's gradient is fp32(g1) + fp32(g2) exactly, laid out where DeepSpeed's
    flat group holds each parameter, with the padding 0."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    with tiny_bf16_trainer(tmp_path / "run", "training.grad_accum_steps=2", "model.dropout=0.1") as trainer:
        micro_grads, handed = record_one_step(trainer)
    assert len(micro_grads) == 2 and len(handed) == 1
    layout = group_layouts(trainer.bundle.optimizer)
    for index, flat in enumerate(handed[0]):
        per_parameter = zip(*[micro[index] for micro in micro_grads], strict=True)
        expected = laid_out(layout[index], [sum_fp32(*grads) for grads in per_parameter])
        assert flat.dtype == torch.float32 and torch.equal(flat, expected)


def sum_fp32(*grads):
    """The fp32 sum of bf16 gradients (None: a parameter the step did not reach, 0)."""
    present = [g.float() for g in grads if g is not None]
    return sum(present[1:], present[0]) if present else None


def group_layouts(optimizer) -> list[tuple[list, list, int]]:
    """(shapes, offsets, flat size) of each parameter group in DeepSpeed's flat layout."""
    world = torch.distributed.get_world_size(optimizer.real_dp_process_group[0])
    return [
        ([p.shape for p in params], list(offsets), int(size) * world)
        for params, offsets, size in zip(optimizer.round_robin_bit16_groups, optimizer.round_robin_bit16_offsets,
                                         optimizer.partition_size, strict=True)
    ]  # fmt: skip


def laid_out(layout, grads) -> torch.Tensor:
    shapes, offsets, size = layout
    flat = torch.zeros(size, dtype=torch.float32)
    for shape, offset, grad in zip(shapes, offsets, grads, strict=True):
        if grad is not None:
            flat[offset : offset + shape.numel()] = grad.flatten()
    return flat


def record_one_step(trainer):
    """One step, recording each micro-batch's bf16 gradients (per group, in round-robin order) and
    the flat fp32 partitions handed to the step (before its clip scales them in place)."""
    optimizer = trainer.bundle.optimizer
    bulk = optimizer.bulk_gradients
    assert optimizer._grad_acc_hooks == []
    assert all(not p._post_accumulate_grad_hooks for p in trainer.model.parameters())
    micro_grads, handed = [], []
    after_backward = bulk.after_backward

    def recorded():
        groups = optimizer.round_robin_bit16_groups
        micro_grads.append([[None if p.grad is None else p.grad.clone() for p in group] for group in groups])
        after_backward()
        if bulk.fresh:  # the boundary: what the step will see, before the clip scales it in place
            handed.append([optimizer.averaged_gradients[i].flat_partition.clone() for i in range(len(bulk.flats))])

    optimizer.overlapping_partition_gradients_reduce_epilogue = recorded
    trainer.train_step()
    return micro_grads, handed


def test_deepspeeds_own_gradient_path_when_asked_or_outside_the_range(tmp_path, monkeypatch, caplog):
    """``parallel.zero_gradients=deepspeed`` leaves DeepSpeed's hooks in place; outside the supported
    releases the bulk path is skipped with one warning and they stay."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    with tiny_bf16_trainer(tmp_path / "run", "parallel.zero_gradients=deepspeed") as trainer:
        optimizer = trainer.bundle.optimizer
        hooks = len(optimizer._grad_acc_hooks)
        assert hooks == len(list(trainer.model.trainable_parameters())) and not hasattr(optimizer, "bulk_gradients")
        with caplog.at_level(logging.WARNING, logger="parallel_latent"):
            assert patches.bulk_zero_gradients(optimizer, version=OUTSIDE) is False
        assert [r.getMessage().split(":")[0] for r in caplog.records] == [
            f"DeepSpeed {OUTSIDE} is outside the releases >=0.19.8,<0.20 that parallel-latent's bulk ZeRO-1/2 "
            "gradient path was written for"
        ]
        assert len(optimizer._grad_acc_hooks) == hooks
        assert trainer.train_step().applied


def two_rank_bulk_task(run_dir: str):
    import os

    os.environ["DS_ACCELERATOR"] = "cpu"
    with tiny_bf16_trainer(run_dir, "parallel.tensor_parallel=1", "model.dropout=0.1") as trainer:
        micro_grads, handed = record_one_step(trainer)
        return micro_grads, handed, group_layouts(trainer.bundle.optimizer), torch.distributed.get_rank()


def test_at_dp2_each_rank_gets_its_slice_of_the_fp32_mean_of_both_ranks_gradients(pool2, tmp_path):
    """ZeRO-2 over two gloo ranks: one all-reduce of the fp32 flat, divided by 2, and each rank's
    partition is its half of (fp32(g0) + fp32(g1)) / 2, exactly (a sum of two is the same in any
    order; halving is exact), unrounded to bf16 where DeepSpeed rounds it."""
    results = pool2.run(two_rank_bulk_task, str(tmp_path / "run"))
    (grads0, handed0, layout, _), (grads1, handed1, _, _) = results
    for index, group_layout in enumerate(layout):
        both = zip(grads0[0][index], grads1[0][index], strict=True)
        mean = laid_out(group_layout, [None if a is None else sum_fp32(a, b) / 2 for a, b in both])
        half = group_layout[2] // 2
        assert torch.equal(handed0[0][index], mean[:half]) and torch.equal(handed1[0][index], mean[half:])


@gpu_test
def test_on_cuda_the_sync_free_norm_is_within_its_stated_bound_of_deepspeeds(tmp_path):
    """On this GPU our gradient norm (one multi-tensor norm, fp32 sums of squares) against
    DeepSpeed's own (a norm per tensor of an fp64 copy), on the same gradients of two real steps:
    within the relative ``n * eps_fp32 / 2`` that sync_free_zero_step states (``n``: the elements
    of the largest gradient tensor), plus the final roundings."""
    with tiny_bf16_trainer(tmp_path / "run", "training.device=cuda", "model.dropout=0.1") as trainer:
        optimizer = trainer.bundle.optimizer
        ours, pairs = optimizer.get_grad_norm_direct, []

        def both(gradients, params, norm_type=2):
            norm = ours(gradients, params, norm_type)
            theirs = type(optimizer).get_grad_norm_direct(optimizer, gradients, params, norm_type)
            pairs.append((float(norm), float(theirs), max(g.numel() for g in gradients)))
            return norm

        optimizer.get_grad_norm_direct = both
        for _ in range(2):
            trainer.train_step()
    eps = torch.finfo(torch.float32).eps
    assert len(pairs) == 2 * 2  # two steps, two parameter groups
    for norm, theirs, n in pairs:
        assert abs(norm - theirs) <= (n * eps / 2 + 4 * eps) * theirs, (norm, theirs, n)
