"""The TP region entry with several projections: equal to the TP=1 projections (outputs, input and
weight gradients) with sequence parallelism on and off and the backward overlap on and off, and
exactly one collective for the input's gradient (plus the sequence all-gather in forward)."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from parallel_latent.parallel import initialize_model_parallel
from parallel_latent.parallel.projection import Projection, column_parallel_projections
from tests.helpers.tp_compare import count_collectives, max_abs, order_bound, terms_scale

B, L, D, Q_OUT, KV_OUT = 2, 8, 16, 16, 32


def _full():
    gen = torch.Generator().manual_seed(3)
    return {
        "x": torch.randn(B, L, D, generator=gen),
        "w_q": torch.randn(Q_OUT, D, generator=gen) * 0.1,
        "b_q": torch.randn(Q_OUT, generator=gen) * 0.1,
        "w_kv": torch.randn(KV_OUT, D, generator=gen) * 0.1,
        "out_weights": (torch.randn(B, L // 2, Q_OUT, generator=gen), torch.randn(B, L, KV_OUT, generator=gen)),
    }


def compare(tp: int, sequence_parallel: bool, overlap: bool) -> dict:
    state = initialize_model_parallel(tp)
    group, rank = state.tp_group, state.tp_rank
    t = _full()
    index = torch.arange(L // 2, L)  # the queries read the second half of the positions
    # TP=1 reference.
    x_ref = t["x"].clone().requires_grad_()
    w_q, b_q, w_kv = (t[k].clone().requires_grad_() for k in ("w_q", "b_q", "w_kv"))
    outs_ref = [F.linear(x_ref[:, index], w_q, b_q), F.linear(x_ref, w_kv)]
    sum(o.mul(w).sum() for o, w in zip(outs_ref, t["out_weights"], strict=True)).backward()
    # This rank: its slices of the output features (and of the positions under SP).
    x = (t["x"].chunk(tp, dim=1)[rank] if sequence_parallel else t["x"]).clone().requires_grad_()
    mine = {k: t[k].chunk(tp, dim=0)[rank].clone().requires_grad_() for k in ("w_q", "b_q", "w_kv")}
    log, restore = count_collectives()
    try:
        outs = column_parallel_projections(
            x,
            [Projection(mine["w_q"], mine["b_q"], index), Projection(mine["w_kv"])],
            group,
            sequence_parallel=sequence_parallel,
            overlap=overlap,
        )
        forward = list(log)
        log.clear()
        weights = [w.chunk(tp, dim=-1)[rank] for w in t["out_weights"]]
        sum(o.mul(w).sum() for o, w in zip(outs, weights, strict=True)).backward()
        backward = list(log)
    finally:
        restore()
    k = D + B * L + tp
    diffs = {
        "out_q": ((outs[0] - outs_ref[0].chunk(tp, dim=-1)[rank]).abs().max().item(), max_abs([outs_ref[0]])),
        "out_kv": ((outs[1] - outs_ref[1].chunk(tp, dim=-1)[rank]).abs().max().item(), max_abs([outs_ref[1]])),
        "x_grad": (
            (x.grad - (x_ref.grad.chunk(tp, dim=1)[rank] if sequence_parallel else x_ref.grad)).abs().max().item(),
            max_abs([x_ref.grad]),
        ),
    }
    for key, ref in (("w_q", w_q), ("b_q", b_q), ("w_kv", w_kv)):
        diffs[key] = ((mine[key].grad - ref.grad.chunk(tp, dim=0)[rank]).abs().max().item(), max_abs([ref.grad]))
    return {
        "diffs": {key: (d, order_bound(k, terms_scale(scale, k))) for key, (d, scale) in diffs.items()},
        "forward": Counter((name, numel) for name, numel, _ in forward),
        "backward": Counter((name, numel) for name, numel, _ in backward),
    }


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["no-sp", "sp"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_projections_equal_tp1_with_one_collective(pool4, tp, sequence_parallel, overlap):
    for rank, res in enumerate(pool4.run(compare, tp, sequence_parallel, overlap)):
        for key, (diff, bound) in res["diffs"].items():
            assert diff <= bound, f"rank {rank}: {key} differs by {diff:.3g} > {bound:.3g}"
        if sequence_parallel:
            # The "single" collectives log their output: the whole sequence, this rank's positions.
            assert res["forward"] == Counter({("all_gather_single", B * L * D): 1})
            assert res["backward"] == Counter({("reduce_scatter_single", B * L * D // tp): 1})
        else:
            assert res["forward"] == Counter()
            assert res["backward"] == Counter({("all_reduce", B * L * D): 1})
