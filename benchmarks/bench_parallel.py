"""Tensor-parallel core benchmarks: ParallelMLP at TP=1 against nn.Sequential (goal <= 1.02 without
dropout), at TP=2 against torch's DTensor; the frozen pass's FLOPs per rank split against replicated;
activations saved per rank with and without sequence parallelism; the TP=2 step's switches, timed.

Usage: python -m benchmarks.bench_parallel [--batch 16 --seq 128 --hidden 512 --repeats 16] [--quick]
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.harness import GPT2, Report, add_repeat_arguments, command, interleaved
from benchmarks.performance import block_activation_bytes
from benchmarks.plain_twins import plain_mlp
from benchmarks.processes import on_ranks
from parallel_latent.config import Config, FeatureModelConfig, ModelConfig, load_config
from parallel_latent.coordination import all_ranks_agree
from parallel_latent.model import LatentAutoencoder
from parallel_latent.model.perceiver import PerceiverStack
from parallel_latent.parallel import DropoutRNG, ParallelMLP, TensorParallelOptions, initialize_model_parallel
from parallel_latent.parallel.mappings import split_along_sequence
from parallel_latent.training.flops import model_flops_per_sample


def step_time(module: nn.Module, *inputs, before=None, loss=torch.sum) -> float:
    """Wall time of ``module``'s forward and backward of ``loss(output)``, after ``before()`` (a barrier)."""
    if before:
        before()
    start = time.perf_counter()
    loss(module(*inputs)).backward()
    return time.perf_counter() - start


def tp1_overhead(args, report: Report) -> None:
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.seq, args.hidden, requires_grad=True)
    for dropout in (0.0, 0.1):
        rng = DropoutRNG(seed=0)
        ours = ParallelMLP(args.hidden, 4 * args.hidden, dropout=dropout, rng=rng)
        plain = plain_mlp(args.hidden, dropout)
        with torch.no_grad():
            plain[0].weight.copy_(ours.dense_h_to_4h.weight)
            plain[3].weight.copy_(ours.dense_4h_to_h.weight)

        def advance(rng=rng):
            rng.step += 1

        variants = {"ours": lambda ours=ours, advance=advance: step_time(ours, x, before=advance),
                    "plain": lambda plain=plain: step_time(plain, x)}  # fmt: skip
        samples = interleaved(variants, args.repeats, ratios=[("ours", "plain")], most=args.most_repeats)
        print(f"TP=1 MLP fwd+bwd, dropout={dropout}: ours {samples.median('ours') * 1e3:.2f} ms, nn.Sequential "
              f"{samples.median('plain') * 1e3:.2f} ms")  # fmt: skip
        goal = 1.02 if dropout == 0.0 else None
        report.ratio(f"TP=1 MLP ours / nn.Sequential, dropout {dropout}", samples, "ours", "plain", at_most=goal)


def _tp2_task(args) -> dict:
    """Ours vs torch's DTensor tensor parallelism on one MLP, timed in the same 2 processes."""
    state = initialize_model_parallel(2)
    torch.manual_seed(0)
    ours = ParallelMLP(args.hidden, 4 * args.hidden, tp_group=state.tp_group)
    torch.manual_seed(0)
    theirs = nn.Sequential(nn.Linear(args.hidden, 4 * args.hidden), nn.GELU(), nn.Linear(4 * args.hidden, args.hidden))
    mesh = init_device_mesh("cpu", (2,))
    theirs = parallelize_module(theirs, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(args.batch, args.seq, args.hidden, generator=torch.Generator().manual_seed(1), requires_grad=True)
    variants = {"ours": lambda: step_time(ours, x, before=dist.barrier),
                "torch": lambda: step_time(theirs, x, before=dist.barrier)}  # fmt: skip
    return interleaved(variants, args.repeats, ratios=[("ours", "torch")], most=args.most_repeats,
                       agree=all_ranks_agree)  # fmt: skip


def tp2_vs_torch(samples, args, report: Report) -> None:
    print(f"TP=2 MLP fwd+bwd on 2 CPU processes: ours {samples.median('ours') * 1e3:.2f} ms, "
          f"torch.distributed.tensor.parallel {samples.median('torch') * 1e3:.2f} ms")  # fmt: skip
    report.ratio("TP=2 MLP ours / torch.distributed.tensor.parallel", samples, "ours", "torch", at_most=1.0)


def _model_and_batch(d: int, t: int, gpt2_layers: int, batch: int, vocab: int = 512):
    """Configs of 1 + 1 Perceiver blocks of width ``d`` over ``gpt2_layers`` GPT-2 layers, T = ``t``; a batch."""
    model = ModelConfig(d_model=d, n_heads=4, n_encoder_layers=1, n_decoder_layers=1, max_length=t, dropout=0.1,
                        vocab_size=vocab, mask_token_id=vocab - 2, pad_token_id=vocab - 1)  # fmt: skip
    ids = torch.randint(0, vocab - 2, (batch, t), generator=torch.Generator().manual_seed(0))
    features = FeatureModelConfig(n_layer=gpt2_layers, n_head=4, n_embd=d, n_positions=max(64, t))
    return model, features, ids, torch.ones(batch, t, dtype=torch.long)


def _tasks(tasks: list, args) -> list:
    """Each of ``tasks`` in turn on this rank, in one gloo group (harness.on_ranks starts the ranks once)."""
    dist.init_process_group("gloo")
    out = [task(args) for task in tasks]
    dist.destroy_process_group()
    return out


def _frozen_flops(args) -> list[tuple[int, float, float]]:
    rows = []
    for tp in (2, 4):
        state = initialize_model_parallel(tp)
        model_cfg, feature_cfg, ids, mask = _model_and_batch(args.flops_width, 64, 12, 8)  # gpt2.yaml's GPT-2, T=64
        counts = []
        for split in (False, True):
            model = LatentAutoencoder(model_cfg, feature_cfg, tp_group=state.tp_group, split_feature_model=split)
            with FlopCounterMode(display=False) as counter:
                model.features(ids, mask)
            counts.append(counter.get_total_flops())
        rows.append((tp, *counts))
    return rows


def frozen_pass_flops(rows: list, args, report: Report) -> None:
    # What splitting saves in the real configuration: the replicated frozen pass's share of a rank's
    # model FLOPs in configs/gpt2.yaml, from the formula MFU uses (the trainable part divides by TP).
    flops = model_flops_per_sample(load_config(GPT2))
    frozen, trainable = flops["frozen_forward"], flops["train"] - flops["frozen_forward"]
    for tp in (2, 4, 8):
        share = frozen / (frozen + trainable / tp)
        report.figure(f"gpt2.yaml replicated frozen pass, share of a rank's model FLOPs, TP={tp}", share * 100, "%")
    for tp, replicated, split in rows:
        print(f"frozen feature pass per rank at TP={tp} (a 12-layer GPT-2 of width {args.flops_width}, 10 blocks "
              f"run, micro-batch 8 x 64): replicated {replicated / 1e9:.2f} GFLOP, split "
              f"{split / 1e9:.2f} GFLOP")  # fmt: skip
        report.figure(f"frozen pass FLOPs per rank split / replicated, TP={tp}", split / replicated, "x",
                      at_most=1 / tp)  # fmt: skip


def _saved_bytes(args) -> list[tuple]:
    b, s, h, a, layers = 4, 64, 128, 4, 2
    cfg = ModelConfig(d_model=h, n_heads=a, max_length=s, dropout=0.1)
    rows = []
    for tp in (2, 4):
        state = initialize_model_parallel(tp)
        for sp in (False, True):
            stack = PerceiverStack(cfg, layers, DropoutRNG(seed=1), state.tp_group, TensorParallelOptions(sp)).train()
            parameters = {p.untyped_storage().data_ptr() for p in stack.parameters()}
            gen = torch.Generator().manual_seed(0)
            x, context = torch.randn(b, s, h, generator=gen), torch.randn(b, s, h, generator=gen)
            mask = torch.ones(b, s, dtype=torch.bool)
            if sp:
                x, context = split_along_sequence(x, state.tp_group), split_along_sequence(context, state.tp_group)
            x.requires_grad_()
            seen: dict[int, int] = {}

            def pack(tensor, seen=seen, parameters=parameters):
                pointer = tensor.untyped_storage().data_ptr()
                if pointer not in parameters:
                    seen[pointer] = max(seen.get(pointer, 0), tensor.untyped_storage().nbytes())
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                stack(x, context, mask)
            predicted = layers * block_activation_bytes(b, s, s, h, a, tp, sp)
            rows.append((tp, sp, sum(seen.values()), predicted))
    return rows


def saved_activation_bytes(rows: list, args, report: Report) -> None:
    for tp, sp, measured, predicted in rows:
        print(f"activations saved for backward per rank, 2 Perceiver blocks (B=4, T=S=64, d=128, 4 heads), "
              f"TP={tp}, sequence parallel {'on ' if sp else 'off'}: {measured / 2**20:.2f} MiB measured, "
              f"{predicted / 2**20:.2f} MiB by the accounting")  # fmt: skip
    for tp in (2, 4):
        (off,), (on,) = ([r for r in rows if r[:2] == (tp, sp)] for sp in (False, True))
        print(f"TP={tp}: sequence parallel / not: accounting {on[3] / off[3]:.3f}")
        report.figure(f"saved activations sequence parallel / not, TP={tp}", on[2] / off[2], "x", at_most=1.0)


def _timed(args) -> dict:
    state = initialize_model_parallel(2)
    model_cfg, feature_cfg, ids, mask = _model_and_batch(128, 32, args.switch_gpt2_layers, args.batch)  # deep GPT-2
    flops = model_flops_per_sample(Config(model=model_cfg, feature_model=feature_cfg))
    per_rank_trainable = 3 * flops["trainable_forward"] / 2
    share = flops["frozen_forward"] / (flops["frozen_forward"] + per_rank_trainable)
    split = {"split_feature_model": True}
    variants = {"replicated": {"split_feature_model": False}, "split": split,
                "overlap on": {**split, "tp_options": TensorParallelOptions(overlap_comm=True)},
                "overlap off": {**split, "tp_options": TensorParallelOptions(overlap_comm=False)}}  # fmt: skip
    models = {name: LatentAutoencoder(model_cfg, feature_cfg, tp_group=state.tp_group, **kw).train()
              for name, kw in variants.items()}  # fmt: skip
    steps = {name: lambda model=model: step_time(model, ids, mask, before=dist.barrier, loss=lambda out: out.loss)
             for name, model in models.items()}  # fmt: skip
    ratios = [("split", "replicated"), ("overlap on", "overlap off")]
    samples = interleaved(steps, args.repeats, ratios=ratios, most=args.most_repeats, agree=all_ranks_agree)
    return {"share": share, "samples": samples}


def timed_switches(result: dict, args, report: Report) -> None:
    samples = result["samples"]
    ms = {name: samples.median(name) * 1e3 for name in samples.wall}
    print(f"TP=2 step (fwd+bwd, 2 CPU processes, micro-batch {args.batch} x 32, {args.switch_gpt2_layers - 2} frozen "
          f"GPT-2 blocks of width 128 under 1+1 Perceiver blocks): the frozen pass is {result['share'] * 100:.0f}% of "
          f"a rank's replicated work; split feature pass {ms['split']:.1f} ms vs replicated {ms['replicated']:.1f} ms; "
          f"backward collective overlapped {ms['overlap on']:.1f} ms vs not {ms['overlap off']:.1f} ms")  # fmt: skip
    report.ratio("TP=2 step split feature pass / replicated", samples, "split", "replicated", at_most=0.85)
    report.ratio("TP=2 step overlapped / not overlapped backward", samples, "overlap on", "overlap off", at_most=1.0)


def body(args, report: Report) -> None:
    if args.quick:
        args.batch, args.seq, args.hidden, args.repeats, args.most_repeats = 2, 8, 32, 3, None
        args.flops_width, args.switch_gpt2_layers = 64, 4
    torch.set_num_threads(args.threads)
    if args.only in (None, "tp1"):
        tp1_overhead(args, report)
    # The multi-process sections: (processes, task run in them, what prints its result); the tasks
    # of one size share one start of their processes.
    sections = {"tp2": (2, _tp2_task, tp2_vs_torch), "switches": (2, _timed, timed_switches),
                "flops": (4, _frozen_flops, frozen_pass_flops),
                "memory": (4, _saved_bytes, saved_activation_bytes)}  # fmt: skip
    for world in (2, 4):
        chosen = [(name, task, show) for name, (w, task, show) in sections.items() if w == world and
                  args.only in (None, name)]  # fmt: skip
        if chosen:
            results = on_ranks(world, _tasks, [task for _, task, _ in chosen], args)
            for (_, _, show), result in zip(chosen, results, strict=True):
                show(result, args, report)


def arguments(parser) -> None:
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    add_repeat_arguments(parser, repeats=16, most=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--flops-width", type=int, default=768, help="GPT-2 width of the FLOP count")
    parser.add_argument("--switch-gpt2-layers", type=int, default=14, help="GPT-2 depth of the timed switches")
    parser.add_argument("--only", choices=["tp1", "tp2", "flops", "memory", "switches"], default=None)


main = command("bench_parallel", __doc__, body, arguments, __name__)
