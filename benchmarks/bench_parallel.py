"""Tensor-parallel core benchmarks. Prints ratios against a baseline timed in the same run.

1. TP=1 overhead: ParallelMLP at TP=1 vs a plain nn.Sequential MLP of the same shape (one process).
2. TP=2 on two CPU processes: our Column/Row MLP vs torch.distributed.tensor.parallel's
   ColwiseParallel/RowwiseParallel on the same shapes, both timed in the same processes.

Repeats are interleaved (A, B, A, B, ...) and medians compared, so machine noise hits both sides.
Usage: python benchmarks/bench_parallel.py [--batch 16 --seq 128 --hidden 512 --repeats 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from parallel_latent.parallel import DropoutRNG, ParallelMLP


def plain_mlp(hidden: int, dropout: float) -> nn.Module:
    return nn.Sequential(
        nn.Linear(hidden, 4 * hidden),
        nn.GELU(),
        nn.Dropout(dropout),
        nn.Linear(4 * hidden, hidden),
        nn.Dropout(dropout),
    )


def step_time(module: nn.Module, x: torch.Tensor, before=None) -> float:
    if before:
        before()
    start = time.perf_counter()
    module(x).sum().backward()
    return time.perf_counter() - start


def interleaved(fns: dict, repeats: int, warmup: int = 3) -> dict:
    times = {name: [] for name in fns}
    for i in range(warmup + repeats):
        for name, fn in fns.items():
            t = fn()
            if i >= warmup:
                times[name].append(t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def tp1_overhead(args) -> None:
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

        med = interleaved(
            {
                "ours": lambda ours=ours, advance=advance: step_time(ours, x, advance),
                "plain": lambda plain=plain: step_time(plain, x),
            },
            args.repeats,
        )
        print(
            f"TP=1 MLP fwd+bwd, dropout={dropout}: ours {med['ours'] * 1e3:.2f} ms, nn.Sequential "
            f"{med['plain'] * 1e3:.2f} ms, ratio {med['ours'] / med['plain']:.3f} (goal <= 1.02)"
        )


def _tp2_worker(rank: int, port: int, args) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from parallel_latent.parallel import initialize_model_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    state = initialize_model_parallel(2)
    torch.manual_seed(0)
    ours = ParallelMLP(args.hidden, 4 * args.hidden, tp_group=state.tp_group)
    torch.manual_seed(0)
    theirs = nn.Sequential(nn.Linear(args.hidden, 4 * args.hidden), nn.GELU(), nn.Linear(4 * args.hidden, args.hidden))
    mesh = init_device_mesh("cpu", (2,))
    theirs = parallelize_module(theirs, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(args.batch, args.seq, args.hidden, generator=torch.Generator().manual_seed(1), requires_grad=True)

    def synced(module):
        def run():
            dist.barrier()
            return step_time(module, x)

        return run

    med = interleaved({"ours": synced(ours), "torch": synced(theirs)}, args.repeats)
    if rank == 0:
        print(
            f"TP=2 MLP fwd+bwd on 2 CPU processes: ours {med['ours'] * 1e3:.2f} ms, "
            f"torch.distributed.tensor.parallel {med['torch'] * 1e3:.2f} ms, ratio "
            f"{med['ours'] / med['torch']:.3f} (goal <= 1.0)"
        )
    dist.destroy_process_group()


def tp2_vs_torch(args) -> None:
    import torch.multiprocessing as mp

    from tests.distributed import free_port

    mp.spawn(_tp2_worker, args=(free_port(), args), nprocs=2, join=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tp1_overhead(args)
    tp2_vs_torch(args)


if __name__ == "__main__":
    main()
