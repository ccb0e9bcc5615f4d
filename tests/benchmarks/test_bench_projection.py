"""benchmarks/bench_projection.py over the performance model (benchmarks/performance.py): the H200
step projected from a trace on the meta device. Its quick mode produces its figures; its FLOPs are
metrics.py's model FLOPs; its roofline follows the pinned rules on a traced function whose costs are
known; the loss's chunks are fused kernels that read each chunk of logits once each way;
``--feature-model``'s whole step per rank at TP > 1 is the TP=1 projection's Perceiver, its
collectives (those real ranks count) and the frozen pass."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections import Counter

import pytest
import torch

from benchmarks import (
    bench_projection,
    harness,
    meta_trace,
    performance,
    published_decoders,
    step_projection,
    step_trace,
)
from tests.helpers.tp_compare import model_collectives_task

DEFAULT_ROW = {"model.dropout": "0.1", "training.micro_batch_size": "256"}


@pytest.mark.slow
def test_quick_mode_produces_a_projection_for_every_row(tmp_path, monkeypatch, capsys):
    """The script's quick mode, run here in this process (its DP=2 step still on two spawned gloo
    ranks): the interpreter start of a fresh process would be most of its cost."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setattr(sys, "argv", ["bench_projection.py", "--quick", "--json", str(tmp_path / "figures.json")])
    status = bench_projection.main()
    out, err = capsys.readouterr()
    assert status == 0, f"{out[-3000:]}\n{err[-3000:]}"
    record = json.loads((tmp_path / "figures.json").read_text())
    figures = {figure["name"]: figure["value"] for figure in record["figures"]}
    for row in ("default", "compile", "micro32", "dropout0", "dropout0 micro32"):
        overlapped, summed = figures[f"projected MFU overlapped, {row}"], figures[f"projected MFU summed, {row}"]
        assert 0 < summed <= overlapped < 1, row
    assert figures["DeepSpeed kernels per step, DP=1"] > 0 and figures["DeepSpeed kernels per step, DP=2"] > 0
    assert figures["Python hook calls per step, DP=1"] <= 20
    for row in ("default", "compile", "micro32", "dropout0", "dropout0 micro32"):
        pessimistic = figures[f"projected MFU overlapped, pessimistic, {row}"]
        alone = [figures[f"projected MFU overlapped, {a} pessimistic alone, {row}"] for a in performance.ASSUMPTIONS]
        assert 0 < pessimistic <= min(alone) <= max(alone) <= figures[f"projected MFU overlapped, {row}"], row
    assert "Sensitivity: points of MFU (overlapped) lost" in out
    assert "The largest uncertainty, by row: default: the " in out
    printed = [line for line in out.splitlines() if line.startswith("figure: ")]
    assert len(printed) == len(record["figures"])


@pytest.mark.parametrize("setting", [DEFAULT_ROW, {"model.dropout": "0.0", "training.micro_batch_size": "32"}])
def test_traced_flops_are_the_model_flops_of_metrics(setting):
    """configs/gpt2.yaml at full size (meta: no FLOP spent): the matmul FLOPs of one traced forward
    and backward (torch's FLOP formulas) are metrics.py's model FLOPs, counted from the config,
    within 1%."""
    result = step_projection.project(setting, rest=False)
    assert abs(result["traced_flops"] / result["model_flops"] - 1) <= 0.01


@pytest.mark.parametrize("name", ["llama-3.1-8b", "pythia-1.4b"])
def test_another_familys_traced_flops_are_its_model_flops(name):
    """--feature-model: the rows' model over a Llama- or GPT-NeoX-shaped decoder at its real size,
    rebuilt from its whole transformers config (llama-3.1-8b's MLP is 3.5x its width, which a random
    build from the few feature_model keys cannot hold); the model FLOPs count that decoder's own
    products (grouped-query attention, its MLP, parallel residual), and the trace agrees within 1%."""
    setting = {"model.dropout": "0.0", "training.micro_batch_size": "32"}
    setting |= published_decoders.feature_model_setting(name)
    record = published_decoders.feature_model_record(name)
    assert record["intermediate_size"] == published_decoders.MODELS[name][5]
    result = step_projection.project(setting, rest=False, recorded=record)
    assert abs(result["traced_flops"] / result["model_flops"] - 1) <= 0.01


def test_a_compiled_region_is_one_kernel_per_run_between_matmuls_with_its_external_bytes():
    """A traced region of elementwise ops, a matmul, elementwise ops: two fused kernels around the
    matmul, each reading its external inputs and writing what is read afterwards; eagerly, one
    kernel per op reading and writing every operand."""
    n = 4096
    with torch.device("meta"):
        x, w = torch.empty(n, n, dtype=torch.bfloat16), torch.empty(n, n, dtype=torch.bfloat16)

    def body(x, w):
        return ((x * 2 + 1) @ w).relu().neg()

    size = n * n * 2  # bytes of one operand
    for compiled in (True, False):
        tracer = step_trace.StepTracer()
        fn = tracer.region(body, "block") if compiled else body
        with tracer:
            fn(x, w).sum()  # someone reads the result
        kernels = performance.kernels_of(tracer.ops)
        matmul = [k for k in kernels if k.flops]
        assert len(matmul) == 1 and matmul[0].flops == 2 * n**3
        pinned = performance.PINNED
        assert matmul[0].device_s == max(2 * n**3 / pinned.big_matmul_rate, 3 * size / pinned.bandwidth)
        others = sorted(k.device_s * performance.PINNED.bandwidth for k in kernels if not k.flops)
        if compiled:  # x*2+1 reads x, writes its result; relu().neg() reads the product, writes the result
            assert others[1:] == [2 * size, 2 * size] and len(kernels) == 4  # + the eager sum
        else:  # mul, add, relu, neg: each reads and writes one operand
            assert others[1:] == [2 * size] * 4 and len(kernels) == 6
    step = performance.projection(kernels, 2 * n**3)
    device = sum(k.device_s for k in kernels)
    assert step["step_ms_summed"] == pytest.approx((device + 6 * performance.PINNED.launch_s) * 1e3)
    assert step["step_ms_overlapped"] == pytest.approx(max(device, 6 * performance.PINNED.launch_s) * 1e3)


def test_the_pessimistic_projection_times_the_same_trace_with_its_own_constants():
    """A matmul-bound trace and a launch-bound one: under the pessimistic roofline each kernel's time
    follows from that roofline's constants (so the two traces lose different shares, no common
    factor), and each assumption made pessimistic alone moves only what it governs."""
    n = 4096
    with torch.device("meta"):
        big, small = torch.empty(n, n, dtype=torch.bfloat16), torch.empty(8, 8, dtype=torch.bfloat16)
    traces = {}
    for name, (x, body) in {"matmul": (big, lambda x: x @ x), "launches": (small, lambda x: (x * 2 + 1).neg())}.items():
        tracer = step_trace.StepTracer()
        with tracer:
            body(x)
        traces[name] = tracer.ops
    pinned, worst = performance.PINNED, performance.PESSIMISTIC
    [matmul] = performance.kernels_of(traces["matmul"], worst)
    assert matmul.device_s == max(2 * n**3 / worst.big_matmul_rate, 3 * n * n * 2 / worst.bandwidth)
    launches = performance.kernels_of(traces["launches"], worst)
    assert [k.device_s for k in launches] == [worst.min_kernel_s] * 3  # 128 bytes each: the smallest kernel
    shares = {}
    for name, ops in traces.items():
        flops = sum(op.flops for op in ops) or 1.0
        at = {label: performance.projection(performance.kernels_of(ops, roofline), flops, roofline)
              for label, roofline in {"pinned": pinned, "worst": worst}.items()}  # fmt: skip
        shares[name] = at["worst"]["step_ms_overlapped"] / at["pinned"]["step_ms_overlapped"]
    assert shares["matmul"] == pytest.approx(700 / 550)  # compute-bound: the matmul rate's ratio
    assert shares["launches"] == pytest.approx(10 / 5)  # launch-bound: the launch cost's ratio
    launch_only = performance.pessimistic_in("launch cost")
    assert launch_only == dataclasses.replace(pinned, launch_s=worst.launch_s)
    assert performance.kernels_of(traces["matmul"], launch_only) == performance.kernels_of(traces["matmul"], pinned)


def test_the_loss_chunks_are_fused_kernels_reading_each_chunk_once_each_way():
    """On the default path (dropout compiled on CUDA) the loss's chunks are compiled regions: a
    forward kernel per chunk reading that chunk's logits once (the max with the sum of exp), a
    backward kernel per chunk reading it and writing its gradient (chunk_grad_fused: no indexed
    write, which would split it)."""
    cfg = meta_trace.row_config({"model.dropout": "0.1", "training.micro_batch_size": "4"}, quick=True)
    kernels = performance.kernels_of(meta_trace.trace_model(cfg))
    chunks = [k for k in kernels if k.label == "loss chunk (fused)"]
    rows, vocab = 4 * cfg.model.max_length, cfg.model.vocab_size
    padded = math.ceil(vocab / 128) * 128
    logits_bytes = rows * padded * 2  # one chunk: the whole of these few rows, bf16
    forward, backward = chunks
    assert logits_bytes <= forward.device_s * performance.PINNED.bandwidth <= logits_bytes * 1.01  # + per-row outputs
    assert 2 * logits_bytes <= backward.device_s * performance.PINNED.bandwidth <= 2 * logits_bytes * 1.01


def test_project_row_gives_the_four_figures_bench_gpu_prints():
    row = step_projection.project_row(DEFAULT_ROW | {"training.micro_batch_size": "4"}, quick=True)
    assert set(row) == {"step_ms_overlapped", "step_ms_summed", "mfu_overlapped", "mfu_summed"}
    assert row["step_ms_overlapped"] <= row["step_ms_summed"] and row["mfu_summed"] <= row["mfu_overlapped"]
    assert step_projection.project_row({"model.dropout": "not a number"}, quick=True) is None


def test_a_graph_break_inside_a_region_runs_eagerly_and_splits_the_fused_run():
    """What torch.compile leaves out of a graph (a ``torch.compiler.disable`` function) is eager,
    and the graph resumes after it: x*2 | +1 (eager) | relu is three kernels, not one."""
    with torch.device("meta"):
        x = torch.empty(1024, 1024, dtype=torch.bfloat16)
    counts = []
    for broken in (False, True):
        tracer = step_trace.StepTracer()
        plus_one = tracer.graph_break(lambda t: t + 1) if broken else (lambda t: t + 1)
        with tracer:
            tracer.region(lambda t, plus_one=plus_one: plus_one(t * 2).relu(), "block")(x).sum()
        counts.append(len(performance.kernels_of(tracer.ops)) - 1)  # less the eager sum
    assert counts == [1, 3]


# --------------------------------------------------------------------------- #
# The whole step: the projection's operators are the real CPU step's.
# --------------------------------------------------------------------------- #

SMALL_ROW = {"model.dropout": "0.1", "training.micro_batch_size": "4"}


@pytest.fixture(scope="module")
def real_cpu_step(tmp_path_factory):
    """A real bf16 ``Trainer.train_step`` of the shrunk gpt2.yaml on the CPU (DeepSpeed ZeRO-2 and
    all), every operator it dispatched traced, with the config it ran."""
    import os

    from parallel_latent.config import load_config

    scratch = tmp_path_factory.mktemp("real-step")
    overrides = step_trace.real_step_overrides(scratch, quick=True, micro_batch=4) + ["model.dropout=0.1"]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return step_trace.real_step(overrides), load_config(harness.REPO / "configs" / "gpt2.yaml", overrides)


def test_the_projected_step_is_every_operator_a_real_cpu_step_dispatches(real_cpu_step):
    """The projection of a small config with the CPU's choices (its attention kernel, eager
    dropout and loss), the model's forward and backward traced on meta plus the rest of the step
    from the real one, dispatches exactly the operators of the real step: the model, the loss,
    the trainer's work, DeepSpeed's in backward and its optimizer step. A part of the step the
    projection leaves out, or a model operator meta does not see, fails it."""
    real, cfg = real_cpu_step
    projected = meta_trace.trace_model(cfg, "cpu") + real.rest
    assert Counter(op.name for op in projected) == Counter(op.name for op in real.ops)
    parts = Counter(op.part for op in real.ops)
    assert {"model", "loss", "trainer", "deepspeed backward", "optimizer"} <= parts.keys(), parts
    # Each part is charged: the whole-step kernel list has a kernel from every one of them.
    charged = {kernel.part for kernel in performance.kernels_of(projected)}
    assert {"model", "loss", "trainer", "deepspeed backward", "optimizer"} <= charged


def test_deepspeeds_backward_work_is_a_few_kernels_not_a_few_per_parameter(real_cpu_step, tmp_path):
    """Under the bulk gradient path DeepSpeed's backward work is one multi-tensor copy per
    parameter group and the loss's scaling, and the step's Python hook calls are a handful; with
    DeepSpeed's own hooks (``parallel.zero_gradients=deepspeed``) it is at least a copy per
    parameter and a hook call each."""
    real, cfg = real_cpu_step
    params = sum(1 for _ in _trainable(cfg))
    ours = [op for op in real.ops if op.part == "deepspeed backward"]
    assert Counter(op.name for op in ours)["aten._foreach_copy_.default"] == 2  # two parameter groups
    assert len(ours) <= 8 and real.hook_calls <= performance.HOOK_CALL_GOAL, (ours, real.hook_calls)
    overrides = step_trace.real_step_overrides(tmp_path, quick=True, micro_batch=4)
    theirs = step_trace.real_step([*overrides, "model.dropout=0.1", "parallel.zero_gradients=deepspeed"])
    their_ops = [op for op in theirs.rest if op.part == "deepspeed backward"]
    assert len(their_ops) >= params and theirs.hook_calls >= params


def _trainable(cfg):
    from parallel_latent.model import build_model

    return (p for p in build_model(cfg).parameters() if p.requires_grad)


@pytest.mark.parametrize(
    ("numels", "lists", "launches"),
    [
        ([320 * 65536], 2, 1),  # one launch holds 320 blocks of 65536 elements
        ([320 * 65536 + 1], 2, 2),
        ([10] * 64, 2, 1),  # and 64 tensors with two tensor lists
        ([10] * 65, 2, 2),
        ([10] * 110, 1, 1),  # 110 with one
        ([10] * 111, 1, 2),
        ([0, 10, 0], 4, 1),  # empty tensors take no place
    ],
)
def test_multi_tensor_launches_follow_torchs_tables(numels, lists, launches):
    assert performance.multi_tensor_launches(numels, lists) == launches


def test_a_gather_reads_what_it_gathers_a_host_scalar_costs_nothing_and_no_kernel_is_free():
    n = 4096
    with torch.device("meta"):
        table, rows = torch.empty(n, n, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.long)
    tracer = step_trace.StepTracer()
    tracer.on_meta = True
    with tracer:
        table.index_select(0, rows)
        torch.scalar_tensor(1.0)  # made on the host: no kernel on CUDA
        table[:1, :1].neg()  # one element: still a kernel's minimum
    gather, host, _ = tracer.ops
    assert performance.op_bytes(gather) == 2 * (8 * n * 2) + 8 * 8  # the rows read and written, the indices
    assert host.host and performance.kernels_per_op(host) == 0
    kernels = performance.kernels_of(tracer.ops)
    assert len(kernels) == 2 and kernels[1].device_s == performance.PINNED.min_kernel_s


# --------------------------------------------------------------------------- #
# --feature-model: the whole step per rank at TP > 1.
# --------------------------------------------------------------------------- #

FEATURE_MODEL = "llama-3.2-1b"


def test_the_whole_step_per_rank_is_the_perceiver_its_collectives_and_the_frozen_pass(capsys):
    """The rows at TP 1 and 2 (quick shapes, llama-3.2-1b's decoder): at TP=1 the model-alone
    projection with its frozen pass's traced kernels left out, plus bench_feature_models' frozen
    pass; at TP=2 the Perceiver's half of the matmuls (not exactly half: what is not split is not
    divided), its all-reduces (sequence parallelism off) at NVLink's rate, the same in both layouts,
    which differ by their frozen pass alone; tokens/s and MFU per rank from the TP group's
    micro-batch; the table and its figures."""
    name, row = FEATURE_MODEL, SMALL_ROW
    steps = {(s["tp"], s["layout"]): s for s in published_decoders.whole_steps(name, row, quick=True, tps=(1, 2))}
    assert set(steps) == {(1, "replicate"), (1, "shard"), (2, "replicate"), (2, "shard")}
    held, batch, length = published_decoders.held_on_meta(name), 4, 64

    setting = {**row, **published_decoders.feature_model_setting(name)}
    alone = step_projection.project(
        setting, quick=True, rest=False, recorded=published_decoders.feature_model_record(name)
    )
    perceiver = [k for k in alone["kernel_list"] if k.part != "features"]
    assert 0 < len(perceiver) < len(alone["kernel_list"])  # the frozen pass was traced, and is left out
    one = steps[1, "replicate"]
    assert one["perceiver"]["kernels"] == perceiver and one["perceiver"]["collectives"] == []
    frozen_ms = published_decoders.frozen_seconds(held, 1, "replicate", batch, length) * 1e3
    assert one["step_ms"] == performance.projection(perceiver, 0.0)["step_ms_overlapped"] + frozen_ms
    assert steps[1, "shard"]["step_ms"] == one["step_ms"]  # nothing to shard at TP=1

    two, sharded = steps[2, "replicate"], steps[2, "shard"]
    ours = two["perceiver"]
    assert sharded["perceiver"] is ours
    assert 0.5 < ours["matmul_flops"] / one["perceiver"]["matmul_flops"] < 0.51
    assert ours["collectives"] and {kind for kind, _ in ours["collectives"]} == {"all_reduce"}
    seconds = sum(performance.collective_seconds("all_reduce", nbytes, 2) for _, nbytes in ours["collectives"])
    assert ours["collective_ms"] == pytest.approx(seconds * 1e3)
    for step in (two, sharded):
        compute = ours["compute"]["step_ms_overlapped"]
        frozen_ms = published_decoders.frozen_seconds(held, 2, step["layout"], batch, length) * 1e3
        assert step["step_ms"] == pytest.approx(compute + ours["collective_ms"] + frozen_ms)
    flops = step_projection.model_flops(
        meta_trace.row_config(setting, True), published_decoders.feature_model_record(name)
    )
    for (tp, _), step in steps.items():
        assert step["tokens_per_s"] * tp * step["step_ms"] / 1e3 == pytest.approx(batch * length)
        assert step["mfu"] * performance.PEAK_FLOPS * tp * step["step_ms"] / 1e3 == pytest.approx(flops)

    report = harness.Report("bench_projection", argparse.Namespace(quick=True))
    bench_projection.report_whole_steps(name, "micro32", row, list(steps.values()), report)
    figures = {figure.name: figure.value for figure in report.figures}
    for tp, layout in steps:
        assert figures[f"{name}: MFU per rank, whole step, {layout}, TP={tp}, micro32"] == steps[tp, layout]["mfu"]
    assert figures[f"{name}: Perceiver TP collectives per step, TP=2, micro32"] == len(ours["collectives"])
    table = [line.split() for line in capsys.readouterr().out.splitlines() if line[:3].strip() in ("1", "2")]
    assert [line[:2] for line in table] == [["1", "replicate"], ["1", "shard"], ["2", "replicate"], ["2", "shard"]]


# How tests/helpers/tp_compare.count_collectives names what the traced c10d operators do.
COUNTED_AS = {"all_reduce": "all_reduce", "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather"}


def test_the_traced_collectives_at_tp2_are_those_real_ranks_count(pool4):
    """The model traced on meta over a fake group of 2 issues, at the shrunk row's shapes, exactly
    the collectives (what each does, its elements) that two real gloo ranks count for it; the only
    one of the frozen pass, the split features' all-gather, is marked as the frozen pass's (and
    timed with it, not with the Perceiver's)."""
    setting = {**SMALL_ROW, "parallel.tensor_parallel": "2"}
    cfg = meta_trace.row_config(setting, quick=True)
    with meta_trace.fake_tp_group(2) as group:
        traced = [op for op in meta_trace.trace_model(cfg, tp_group=group) if op.kind == "collective"]

    def elements(op) -> tuple[str, int]:
        kind, nbytes = published_decoders.collective_of(op)
        return kind, nbytes // op.reads[0][1][2]  # the element size of its tensors

    counted = pool4.run(model_collectives_task, 2, cfg, 4)[0]  # float32 on the CPU: the same calls
    assert Counter(map(elements, traced)) == Counter((COUNTED_AS[name], numel) for name, numel, _ in counted)
    features = [elements(op) for op in traced if op.part == "features"]
    assert features == [("all_gather", 4 * cfg.model.max_length * cfg.model.d_model)]
