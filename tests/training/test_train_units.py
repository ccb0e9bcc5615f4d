"""Fast checks of the trainer's pieces: the DeepSpeed config, the schedule, parameter groups,
the FLOP count behind MFU, the metric sinks and the plots.  No process groups, no launches."""

from __future__ import annotations

import itertools
import json
import math
import re
import signal

import pytest
import torch

from parallel_latent.config import ConfigError, config_from_dict, load_config
from parallel_latent.files import read_jsonl
from parallel_latent.training.engine_setup import (
    build_optimizer,
    deepspeed_config,
    lr_factor,
    merge_overrides,
    parameter_groups,
    uses_stage0_guard,
)
from parallel_latent.training.flops import PEAK_FLOPS_ENV, gpu_peak_flops, model_flops_per_sample, peak_flops_per_device
from parallel_latent.training.metrics import MetricsLogger
from tests.helpers.trainer_runs import TINY_CONFIG


def cfg_with(**sections):
    return config_from_dict(sections)


# --------------------------------------------------------------------------- #
# DeepSpeed config
# --------------------------------------------------------------------------- #


def test_deepspeed_batch_sizes_count_data_parallel_ranks_only():
    cfg = cfg_with(
        parallel={"tensor_parallel": 2, "zero_stage": 3}, training={"micro_batch_size": 4, "grad_accum_steps": 3}
    )
    ds = deepspeed_config(cfg, world_size=8)  # TP 2 x DP 4
    assert ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == 4 * 3 * 4
    assert ds["zero_optimization"]["stage"] == 3


def test_deepspeed_world_not_divisible_by_tp_is_a_config_error():
    cfg = cfg_with(parallel={"tensor_parallel": 2})
    with pytest.raises(ConfigError, match=r"world size 3 is not divisible by parallel\.tensor_parallel=2"):
        deepspeed_config(cfg, world_size=3)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_deepspeed_precision_sections(precision):
    ds = deepspeed_config(cfg_with(training={"precision": precision}), world_size=1)
    assert ds["bf16"]["enabled"] is (precision == "bf16")
    assert ds["fp16"]["enabled"] is (precision == "fp16")
    if precision == "fp16":
        assert ds["fp16"]["loss_scale"] == 0  # dynamic loss scaling by DeepSpeed


def test_clipping_goes_to_deepspeed_except_at_stage0_fp32_where_our_guard_clips():
    stage2 = cfg_with(optimizer={"grad_clip": 0.5}, parallel={"zero_stage": 2})
    stage0 = cfg_with(optimizer={"grad_clip": 0.5}, parallel={"zero_stage": 0})
    stage0_bf16 = cfg_with(optimizer={"grad_clip": 0.5}, parallel={"zero_stage": 0}, training={"precision": "bf16"})
    assert deepspeed_config(stage2, 1)["gradient_clipping"] == 0.5 and not uses_stage0_guard(stage2)
    assert deepspeed_config(stage0, 1)["gradient_clipping"] == 0.0 and uses_stage0_guard(stage0)
    assert deepspeed_config(stage0_bf16, 1)["gradient_clipping"] == 0.5 and not uses_stage0_guard(stage0_bf16)


@pytest.mark.parametrize("data_parallel", [1, 2])
def test_bf16_reduces_gradients_in_fp32_and_overlaps_only_with_data_parallel_ranks(data_parallel):
    """On a GPU under bf16: the data-parallel reduction in fp32 unless asked for bf16; ZeRO's overlap
    (which synchronises the device at the end of every backward) only when there is a reduction."""
    bf16 = {"precision": "bf16", "micro_batch_size": 2}
    ds = deepspeed_config(cfg_with(training=bf16), world_size=data_parallel, device="cuda")
    assert ds["communication_data_type"] == "fp32"
    assert ds["zero_optimization"]["overlap_comm"] is (data_parallel > 1)
    halved = deepspeed_config(
        cfg_with(training=bf16, parallel={"grad_reduce_dtype": "bf16"}), data_parallel, device="cuda"
    )
    assert halved["communication_data_type"] == "bf16"
    fp32 = deepspeed_config(cfg_with(), world_size=data_parallel, device="cuda")
    assert "communication_data_type" not in fp32  # DeepSpeed's default is the training dtype: fp32


def test_bf16_gradient_reduction_needs_bf16_training():
    with pytest.raises(ConfigError, match=r"parallel\.grad_reduce_dtype=bf16 needs training\.precision=bf16"):
        cfg_with(parallel={"grad_reduce_dtype": "bf16"})


@pytest.mark.parametrize(
    ("fused", "device", "expected"),
    [("auto", "cpu", False), ("auto", "cuda", True), ("on", "cpu", True), ("off", "cuda", False)],
)
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_the_fused_optimizer_kernel_where_asked(fused, device, expected, name):
    """optimizer.fused: auto = torch's fused kernel with CUDA only; on = on the CPU too (what the
    step projection counts); off = never. The choice is made before any parameter moves, so the
    CUDA rows only inspect the constructor's arguments (no GPU needed to build them on the CPU)."""
    cfg = config_from_dict({"optimizer": {"name": name, "fused": fused, "momentum": 0.9}})
    params = [torch.nn.Parameter(torch.zeros(2, 2))]
    optimizer = build_optimizer(params, cfg, device, mpu=None)
    assert bool(optimizer.defaults.get("fused")) is expected


def test_deepspeed_overrides_merge_deeply():
    ds = deepspeed_config(
        cfg_with(), 1, overrides={"zero_optimization": {"reduce_bucket_size": 123}, "steps_per_print": 5}
    )
    assert ds["zero_optimization"] == {
        "stage": 2,
        "contiguous_gradients": True,
        "overlap_comm": False,  # auto: off on CPU
        "reduce_bucket_size": 123,
        "allgather_bucket_size": 50_000_000,
    }
    assert ds["steps_per_print"] == 5
    assert ds["timers"] == {"throughput": {"enabled": False, "synchronized": False}}  # no device syncs
    tuned = deepspeed_config(
        cfg_with(parallel={"zero_overlap_comm": "on", "reduce_bucket_size": 1000, "allgather_bucket_size": 2000}), 1
    )
    assert tuned["zero_optimization"]["overlap_comm"] is True
    assert (tuned["zero_optimization"]["reduce_bucket_size"], tuned["zero_optimization"]["allgather_bucket_size"]) == (
        1000,
        2000,
    )
    base = {"a": {"b": 1}}
    assert merge_overrides(base, {"a": {"c": 2}}) == {"a": {"b": 1, "c": 2}} and base == {"a": {"b": 1}}


# --------------------------------------------------------------------------- #
# Schedule and optimizer groups
# --------------------------------------------------------------------------- #


def test_warmup_then_cosine_to_the_floor():
    schedule = cfg_with(schedule={"warmup_steps": 10, "decay": "cosine", "min_lr_ratio": 0.1}).schedule
    assert lr_factor(0, schedule, 110) == pytest.approx(0.1)
    assert lr_factor(9, schedule, 110) == pytest.approx(1.0)
    assert lr_factor(10, schedule, 110) == pytest.approx(1.0)
    assert lr_factor(60, schedule, 110) == pytest.approx(0.55)  # half way: mean of 1 and 0.1
    assert lr_factor(110, schedule, 110) == pytest.approx(0.1)
    assert lr_factor(500, schedule, 110) == pytest.approx(0.1)
    factors = [lr_factor(s, schedule, 110) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(factors))


def test_linear_and_constant_decay():
    linear = cfg_with(schedule={"warmup_steps": 0, "decay": "linear", "min_lr_ratio": 0.0}).schedule
    constant = cfg_with(schedule={"warmup_steps": 0, "decay": "constant"}).schedule
    assert [lr_factor(s, linear, 4) for s in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert {lr_factor(s, constant, 4) for s in range(5)} == {1.0}


def test_weight_decay_only_on_matrices():
    layer, norm = torch.nn.Linear(3, 4), torch.nn.LayerNorm(4)
    params = [layer.weight, layer.bias, norm.weight, norm.bias]
    decay, no_decay = parameter_groups(params, 0.1)
    assert decay == {"params": [layer.weight], "weight_decay": 0.1}
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3


# --------------------------------------------------------------------------- #
# FLOPs and MFU inputs
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("head", "head_rows", "dropout", "latents"),
    [("normal", 1024, 0.1, {}), ("tied", 1000, 0.1, {}), ("tied", 1000, 0.0, {}),
     ("tied", 1000, 0.1, {"num_latents": 4, "latent_dim": 8}),
     ("nearest", 1000, 0.1, {"num_latents": 4, "latent_dim": 8})],
)  # fmt: skip
def test_flop_formula_matches_the_real_models_forward_matmuls(head, head_rows, dropout, latents):
    """The docstring formula counts the linear-layer FLOPs that torch's FlopCounterMode measures
    on the real model (TP=1, train mode: with dropout the query MLP runs on [B, T, d], without it
    once on the mask vector).  The counter does not see the fused CPU attention kernel; the normal
    head is padded to 1024 rows here, the tied one multiplies the 1000 rows of the token table only."""
    from torch.utils.flop_counter import FlopCounterMode

    from parallel_latent.model import build_model

    cfg = config_from_dict(
        {
            "model": {
                "d_model": 32,
                "n_heads": 4,
                "n_encoder_layers": 2,
                "n_decoder_layers": 1,
                "max_length": 8,
                "vocab_size": 1000,
                "mask_token_id": 998,
                "pad_token_id": 999,
                "dropout": dropout,
                "head": head,
                **latents,
            },
            "feature_model": {"n_layer": 4, "n_head": 4, "n_embd": 32},
            "training": {"micro_batch_size": 3},
        }
    )
    model = build_model(cfg).train()
    batch = 3
    ids = torch.randint(0, 990, (batch, 8))
    with FlopCounterMode(display=False) as counter:
        model(ids, torch.ones_like(ids))
    parts = model_flops_per_sample(cfg)
    linear = parts["perceiver_linear"] + parts["query_mlp"] + parts["head"] * head_rows / 1000 + parts["feature_linear"]
    linear += parts["bottleneck"] + parts["head_codes"]  # the nearest head's codes, once per micro-batch of 3
    assert counter.get_total_flops() / batch == pytest.approx(linear, rel=1e-6)
    # What reads the frozen table computes no gradient for it: its backward is one forward's work.
    table_read = {"tied": parts["head"], "nearest": parts["head_codes"]}.get(head, 0.0)
    assert parts["train"] == 3 * parts["trainable_forward"] + parts["frozen_forward"] - table_read
    assert parts["frozen_forward"] == parts["feature_linear"] + parts["feature_attention"]


def test_flops_count_the_loaded_gpt2_not_the_yaml(tmp_path):
    """A pretrained feature model brings its own depth: FLOPs follow the GPT-2 that was loaded."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import GPT2Config, GPT2Model

    from parallel_latent.model import build_model

    GPT2Model(GPT2Config(n_layer=7, n_head=4, n_embd=32, vocab_size=1000)).save_pretrained(tmp_path / "gpt2")
    model_section = {"d_model": 32, "n_heads": 4, "max_length": 8, "vocab_size": 1000, "mask_token_id": 998,
                     "pad_token_id": 999, "dropout": 0.0}  # fmt: skip
    yaml_says = {"pretrained": True, "name_or_path": str(tmp_path / "gpt2"), "n_layer": 4, "n_embd": 32}
    cfg = config_from_dict({"model": model_section, "feature_model": yaml_says})
    model = build_model(cfg)
    features = model.feature_model
    assert (features.blocks, features.width) == (5, 32)
    loaded = model_flops_per_sample(cfg, features.blocks, features.width)
    assert loaded["feature_linear"] == 5 / 2 * model_flops_per_sample(cfg)["feature_linear"]
    ids = torch.randint(0, 990, (2, 8))
    with FlopCounterMode(display=False) as counter:
        features(ids, torch.ones_like(ids))
    assert counter.get_total_flops() / 2 == pytest.approx(loaded["feature_linear"], rel=1e-6)


def test_flops_trainable_feature_model_costs_backward_too():
    frozen = model_flops_per_sample(cfg_with())
    trainable = model_flops_per_sample(cfg_with(feature_model={"frozen": False}))
    # The tied table trains too then: the head costs its full 3x.
    assert trainable["train"] == 3 * (frozen["trainable_forward"] + frozen["frozen_forward"])


def test_peak_flops_env_override_and_cpu_assumption(monkeypatch):
    assert peak_flops_per_device("cpu", "fp32", env={PEAK_FLOPS_ENV: "1.5e12"}) == (1.5e12, f"${PEAK_FLOPS_ENV}")
    peak, source = peak_flops_per_device("cpu", "fp32", env={})
    assert peak == torch.get_num_threads() * 96e9 and "CPU assumption" in source
    assert peak_flops_per_device("cpu", "fp64", env={})[0] == torch.get_num_threads() * 48e9


def test_gpu_peaks_use_the_most_specific_table_row():
    assert gpu_peak_flops("NVIDIA H200", "bf16") == (989e12, "table: H200 bf16")
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", "bf16")[0] == 989e12
    # NVL parts have their own dense peaks, not the SXM ones their names contain.
    assert gpu_peak_flops("NVIDIA H100 NVL", "bf16") == (835e12, "table: H100 NVL bf16")
    assert gpu_peak_flops("NVIDIA H200 NVL", "bf16")[0] == 835e12
    assert gpu_peak_flops("NVIDIA H100 PCIe", "bf16")[0] == 756e12
    assert math.isnan(gpu_peak_flops("Some Future GPU", "bf16")[0])
    assert math.isnan(gpu_peak_flops("NVIDIA H200", "fp64")[0])  # not in the table: MFU is null, not invented


# --------------------------------------------------------------------------- #
# Metric sinks and plots
# --------------------------------------------------------------------------- #


def test_metrics_jsonl_is_strict_json_and_resume_drops_lines_after_the_checkpoint(tmp_path):
    logger = MetricsLogger(tmp_path, enabled=True, total_steps=5, tensorboard=False, progress_bar=False)
    for step in range(1, 5):
        logger.write({"kind": "train", "step": step, "loss": math.nan if step == 3 else 1.0 / step})
    logger.write({"kind": "eval", "step": 4, "eval_loss": 0.5})
    logger.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # strict JSON: no NaN literal
    assert records[2] == {"kind": "train", "step": 3, "loss": None}
    assert "NaN" not in "".join(lines)

    resumed = MetricsLogger(tmp_path, enabled=True, total_steps=5, start_step=2, tensorboard=False, progress_bar=False)
    resumed.write({"kind": "train", "step": 3, "loss": 0.3})
    resumed.close()
    assert [(r["kind"], r["step"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [
        ("train", 1),
        ("train", 2),
        ("train", 3),
    ]


def test_disabled_logger_writes_nothing(tmp_path):
    logger = MetricsLogger(tmp_path / "run", enabled=False, total_steps=5)
    logger.write({"kind": "train", "step": 1, "loss": 1.0})
    logger.close()
    assert not (tmp_path / "run").exists()


def test_torn_last_line_is_ignored(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1, "loss": 2.0}\n{"kind": "tra')
    assert read_jsonl(path) == [{"kind": "train", "step": 1, "loss": 2.0}]


def test_plot_writes_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    from parallel_latent.plot import plot_run

    records = [
        {
            "kind": "train",
            "step": s,
            "loss": 5.0 / s,
            "token_accuracy": s / 10,
            "lr": 1e-3,
            "grad_norm": 1.0,
            "tokens_per_s": 100.0 + s,
        }
        for s in range(1, 6)
    ]
    records.append({"kind": "eval", "step": 5, "eval_loss": 1.2, "eval_token_accuracy": 0.4, "eval_exact_match": 0.1})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    written = plot_run(tmp_path)
    assert sorted(p.name for p in written) == ["accuracy.png", "loss.png", "lr.png", "throughput.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_a_directory_without_metrics_is_a_one_line_error(tmp_path):
    from parallel_latent.plot import PlotError, plot_run

    with pytest.raises(PlotError, match=re.escape(f"{tmp_path}: no metrics.jsonl")):
        plot_run(tmp_path)


def test_tiny_config_is_the_documented_demo():
    cfg = load_config(TINY_CONFIG)
    assert cfg.parallel.tensor_parallel == 2 and cfg.data.path == ""
    assert not cfg.feature_model.pretrained


def test_tensorboard_events_when_installed(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, enabled=True, total_steps=3, tensorboard=True, progress_bar=False)
    for step in (1, 2, 3):
        logger.write({"kind": "train", "step": step, "loss": 1.0 / step, "grad_norm": None})
    logger.write({"kind": "eval", "step": 3, "eval_loss": 0.5})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"train/loss", "eval/eval_loss"}
    assert [(e.step, round(e.value, 3)) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 0.5), (3, 0.333)]


def test_a_signal_before_training_does_what_it_did_before_and_after_it_asks_the_loop_to_stop():
    """Before the loop there is no step to finish and nothing new to save: SIGTERM and SIGINT do at
    once what they did before the request was installed (here: record it, and KeyboardInterrupt), so
    a rank still starting when its job is torn down leaves then. Once the loop runs they set the
    flag it polls, and a second SIGINT interrupts."""
    from parallel_latent.training.trainer import StopRequest

    seen = []
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum)),
                signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler)}  # fmt: skip
    try:
        starting = StopRequest()
        with starting.installed():
            signal.raise_signal(signal.SIGTERM)
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
        assert seen == [signal.SIGTERM] and not starting.requested
        training = StopRequest()
        with training.installed():
            training.training = True
            signal.raise_signal(signal.SIGTERM)
            assert training.signal_name == "SIGTERM" and seen == [signal.SIGTERM]
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
