"""Trainer benchmarks: one step through the real trainer (DeepSpeed ZeRO-2) against a plain PyTorch loop
with the trainer's own AdamW (goal <= 1.10); the trainable part's bytes per rank at TP2 x DP2 (torchrun)
against TP1 x DP1, from the engine's tensors (goal <= 0.30).

    python -m benchmarks.bench_train [--part step|memory] [--quick] [overrides...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import QUIET_RUN, TINY, Report, add_repeat_arguments, interleaved, started_trainer, visible_gpus
from benchmarks.processes import child_environment, run_checked
from parallel_latent.config import load_config

# A small model whose step is dominated by real work, not launch overhead.
DEFAULT_OVERRIDES = ["model.d_model=64", "model.n_heads=4", "model.n_encoder_layers=2", "model.n_decoder_layers=2",
                     "model.max_length=32", "model.dropout=0.1", "feature_model.n_embd=64", "feature_model.n_layer=4",
                     "data.max_samples=2000", "training.micro_batch_size=32"]  # fmt: skip
QUICK_OVERRIDES = ["model.max_length=16", "training.micro_batch_size=8", "data.max_samples=400"]


def load(overrides: list[str], run_dir: str):
    return load_config(TINY, [*DEFAULT_OVERRIDES, *QUIET_RUN, *overrides, f"logging.run_dir={run_dir}"])


def bench_step_time(args, measure_memory: bool = False) -> dict:
    import torch

    from parallel_latent.data import ShardedBatchSampler, get_batch
    from parallel_latent.model import build_model
    from parallel_latent.training.engine_setup import build_lr_scheduler, build_optimizer

    overrides = [*args.overrides, "parallel.tensor_parallel=1", "parallel.zero_stage=2"]
    with tempfile.TemporaryDirectory() as run_dir, started_trainer(load(overrides, run_dir)) as trainer:
        cfg, device = trainer.cfg, trainer.device  # the config with the tokenizer's facts
        plain_model = build_model(cfg).to(device).train()
        trainable = plain_model.trainable_parameters()
        # The trainer's own optimizer (class and flags); ZeRO hands it one flat partition per group,
        # the plain loop its parameters one by one: that layout is the difference, and is ZeRO's.
        optimizer = build_optimizer(trainable, cfg, device.type, mpu=None)
        scheduler = build_lr_scheduler(optimizer, cfg)
        sampler = ShardedBatchSampler(len(trainer.train_set), cfg.training.micro_batch_size, seed=cfg.training.seed)
        optimizer_times = []  # one per plain step done
        synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda: None

        def plain_step() -> float:
            # The batch is fetched before the clock starts, as the trainer's is read ahead.
            batch = get_batch(trainer.train_set, sampler.next_batch())
            synchronize()
            started = time.perf_counter()
            plain_model.dropout_rng.step = len(optimizer_times)
            out = plain_model(batch["input_ids"].to(device), batch["attention_mask"].to(device))
            (out.loss_sum / out.num_tokens.clamp(min=1)).backward()
            torch.nn.utils.clip_grad_norm_(trainable, cfg.optimizer.grad_clip)
            synchronize()
            stepping = time.perf_counter()
            optimizer.step()
            synchronize()
            optimizer_times.append(time.perf_counter() - stepping)
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize()
            return time.perf_counter() - started

        def trainer_step() -> float:
            synchronize()
            started = time.perf_counter()
            trainer.train_step()  # its statistics stay on the device until a log line
            synchronize()
            trainer.step += 1
            return time.perf_counter() - started

        samples = interleaved({"trainer": trainer_step, "plain": plain_step}, args.repeats, warmup=args.warmup,
                              ratios=[("trainer", "plain")], most=args.most_repeats)  # fmt: skip
        # --quick: this trainer is the fp32 TP1xDP1 memory run's (ZeRO-2, TP=1, one rank, the same
        # overrides), so it measures that run's tensors here instead of a torchrun of its own.
        memory = measure_engine_memory(trainer) if measure_memory and cfg.training.precision == "fp32" else None
    return {"samples": samples, "plain_optimizer_share": statistics.median(optimizer_times) / samples.median("plain"),
            "device": str(device), "threads": torch.get_num_threads(), "tp1_dp1_memory": memory}  # fmt: skip


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def measure_engine_memory(trainer) -> dict:
    """Trainable parameters + gradients + optimizer state on this rank (bytes) before a second step's update."""
    import torch

    from parallel_latent.data import get_batch

    engine, optimizer = trainer.engine, trainer.engine.optimizer
    trainer.train_step()
    batch = get_batch(trainer.train_set, trainer.sampler.next_batch())
    out = engine(batch["input_ids"].to(trainer.device), batch["attention_mask"].to(trainer.device))
    engine.backward(out.loss_sum.float() / out.num_tokens.clamp(min=1))
    trainable = [p for p in engine.module.parameters() if p.requires_grad]
    frozen = [p for p in engine.module.parameters() if not p.requires_grad]
    # No ZeRO wrapper: the module's own parameters are the master copy, their .grad the gradients.
    parameters, master, gradients, base = _bytes(trainable), 0, 0, optimizer
    if hasattr(optimizer, "single_partition_of_fp32_groups"):  # ZeRO 1/2
        master, base = _bytes(optimizer.single_partition_of_fp32_groups), optimizer.optimizer
        # Stage 2 keeps this rank's partition of the reduced gradients (stage 1 the full ones).
        gradients = sum(_bytes(group) for group in optimizer.averaged_gradients.values() if isinstance(group, list))
    gradients = gradients or _bytes(p.grad for p in trainable)
    states = [value for state in base.state.values() for value in state.values()]
    optimizer_state = _bytes(v for v in states if isinstance(v, torch.Tensor) and v.dim() > 0)
    engine.step()
    return {"parameters": parameters, "master_weights": master, "gradients": gradients,
            "optimizer_state": optimizer_state, "total": parameters + master + gradients + optimizer_state,
            "frozen_parameters": _bytes(frozen)}  # fmt: skip


def run_memory_layout(nproc: int, overrides: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "memory.json"
        env = child_environment(1, cpu=not visible_gpus(), PYTHONUNBUFFERED="1")
        run_checked([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                     "-m", "benchmarks.bench_train", "--memory-worker", str(output), "--run-dir",
                     str(Path(scratch) / "run"), *overrides], env, "memory worker")  # fmt: skip
        return json.loads(output.read_text())


def body(args, report: Report) -> None:
    if not visible_gpus():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.quick:
        args.overrides = [*QUICK_OVERRIDES, *args.overrides]
        args.repeats, args.most_repeats, args.warmup, args.precisions = 4, None, 1, args.precisions or "fp32"
    step = {}
    if args.part in ("step", "all"):
        step = bench_step_time(args, measure_memory=args.quick and args.part == "all")
        samples = step["samples"]
        print(f"step time, TP=1, {step['device']}, {step['threads']} thread(s), medians of "
              f"{len(samples.wall['plain'])}:")  # fmt: skip
        print(f"  plain PyTorch loop (AdamW)      {samples.median('plain') * 1e3:8.1f} ms")
        print(f"  parallel-latent trainer, ZeRO-2 {samples.median('trainer') * 1e3:8.1f} ms")
        report.figure("plain PyTorch step", samples.median("plain") * 1e3, "ms")
        report.figure("trainer (ZeRO-2) step", samples.median("trainer") * 1e3, "ms")
        report.figure("plain step's AdamW (per-parameter tensors), share of the step", step["plain_optimizer_share"])
        report.ratio("trainer / plain step time", samples, "trainer", "plain", at_most=1.10)
    if args.part in ("memory", "all"):
        for precision in (args.precisions or "bf16,fp32").split(","):
            common = [*args.overrides, "parallel.zero_stage=2", f"training.precision={precision}"]
            # The TP1xDP1 run's numbers where they were measured already (--quick).
            single = step.get("tp1_dp1_memory") if precision == "fp32" else None
            single = single or run_memory_layout(1, [*common, "parallel.tensor_parallel=1"])[0]
            worst = max(run_memory_layout(4, [*common, "parallel.tensor_parallel=2"]), key=lambda r: r["total"])
            print(f"trainable-part memory per rank, ZeRO-2, {precision} (parameters + fp32 master + gradients + "
                  "AdamW moments):")  # fmt: skip
            for name in ("parameters", "master_weights", "gradients", "optimizer_state", "total"):
                print(f"  {name:16s} TP1xDP1 {single[name] / 2**20:8.2f} MiB   TP2xDP2 (rank {worst['rank']}) "
                      f"{worst[name] / 2**20:8.2f} MiB")  # fmt: skip
            print(f"  frozen GPT-2, not included: {single['frozen_parameters'] / 2**20:8.2f} MiB per rank, replicated")
            report.figure(f"{precision} trainable-part memory, TP1xDP1", single["total"] / 2**20, "MiB")
            report.figure(f"{precision} trainable-part memory, TP2xDP2 worst rank", worst["total"] / 2**20, "MiB")
            ratio = worst["total"] / single["total"]
            report.figure(f"{precision} memory per rank TP2xDP2 / TP1xDP1", ratio, "x", at_most=0.30)


def arguments(parser) -> None:
    parser.add_argument("--part", choices=["step", "memory", "all"], default="all")
    add_repeat_arguments(parser, repeats=8, most=48)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--precisions", help="memory benchmark precisions, comma-separated (default: bf16,fp32)")
    parser.add_argument("--memory-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="config overrides (section.key=value)")


def main() -> int:
    parser = harness.script_parser(__doc__, arguments)
    args, _ = parser.parse_known_args()
    if not args.memory_worker:
        return harness.run("bench_train", parser, body)
    # One rank of the memory run (the launching process reports), in --run-dir made by the launching
    # process (the trainer checks that every rank sees one run directory, as on a cluster).
    if not visible_gpus():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from parallel_latent.coordination import all_gather_value, barrier

    with started_trainer(load(args.overrides, args.run_dir)) as trainer:
        numbers = measure_engine_memory(trainer)
        numbers.update({"rank": trainer.state.rank, "tp": trainer.state.tp_size, "dp": trainer.state.dp_size})
        gathered = all_gather_value(numbers)
        if trainer.state.rank == 0:
            Path(args.memory_worker).write_text(json.dumps(gathered))
        barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
