"""Collectives are counted by wrapping torch.distributed itself, not by trusting the layers.

A pre-LayerNorm transformer block (attention + MLP) must cost exactly the Megatron minimum: two
all-reduces of B*T*d forward (attention output, MLP output) and two backward (the two region
entries). The vocabulary-parallel loss adds only [B, T]-sized reductions."""

import torch
import torch.distributed as dist

from parallel_latent.parallel import (
    VocabParallelHead,
    initialize_model_parallel,
    vocab_parallel_cross_entropy,
    with_gradients_summed_together,
)
from tests.helpers.blocks import VOCAB, B, Block, D, S, T
from tests.helpers.tp_compare import collectives_of, count_collectives


def count_block(tp: int, context_kind: str) -> dict:
    state = initialize_model_parallel(tp)
    torch.manual_seed(0)
    block = Block(state.tp_group)
    x = torch.randn(B, T, D, requires_grad=True)
    context = None
    if context_kind == "frozen":
        context = torch.randn(B, S, D)
    elif context_kind == "trained":
        context = torch.randn(B, S, D, requires_grad=True)
    forward, backward = collectives_of(lambda: block(x, context).sum())
    return {"forward": forward, "backward": backward}


def count_sequence_parallel_block(tp: int) -> dict:
    """A block whose stream and trained context hold this rank's T/tp and S'/tp positions."""
    state = initialize_model_parallel(tp)
    torch.manual_seed(0)
    block = Block(state.tp_group, sequence_parallel=True)
    n_context = 2 * T  # divisible by 4, like T
    x = torch.randn(B, T // tp, D, requires_grad=True)
    context = torch.randn(B, n_context // tp, D, requires_grad=True)
    shape = []

    def forward():
        out = block(x, context)
        shape.append(tuple(out.shape))
        return out.sum()

    forward_log, backward_log = collectives_of(forward)
    return {"forward": forward_log, "backward": backward_log, "out_shape": shape[0], "n_context": n_context}


def count_head_and_loss(tp: int) -> dict:
    state = initialize_model_parallel(tp)
    torch.manual_seed(0)
    head = VocabParallelHead(D, VOCAB, tp_group=state.tp_group)
    hidden = torch.randn(B, T, D, requires_grad=True)
    target = torch.randint(0, VOCAB, (B, T))
    log, restore = count_collectives()
    try:
        logits = head(hidden)
        after_head = list(log)
        loss, _correct = vocab_parallel_cross_entropy(logits, target, VOCAB, state.tp_group)
        forward = list(log)[len(after_head) :]
        log.clear()
        loss.mean().backward()
        backward = list(log)
    finally:
        restore()
    return {"head_forward": after_head, "loss_forward": forward, "backward": backward}


def test_block_costs_two_all_reduces_each_way(pool4):
    for tp in (2, 4):
        for kind in ("none", "frozen"):
            res = pool4.run(count_block, tp, kind)[0]
            assert res["forward"] == [("all_reduce", B * T * D, "SUM")] * 2, (tp, kind, res)
            assert res["backward"] == [("all_reduce", B * T * D, "SUM")] * 2, (tp, kind, res)


def test_trained_context_enters_the_region_once(pool4):
    # The context needs a gradient too (a trained LayerNorm on it, or a trained producer): keys and
    # values read cat(context, x), entered as one tensor, so still one all-reduce for the attention.
    res = pool4.run(count_block, 2, "trained")[0]
    assert res["forward"] == [("all_reduce", B * T * D, "SUM")] * 2
    assert sorted(res["backward"]) == sorted([("all_reduce", B * (S + T) * D, "SUM"), ("all_reduce", B * T * D, "SUM")])


def test_sequence_parallel_block_costs_two_all_gathers_and_two_reduce_scatters_each_way(pool4):
    """Megatron's sequence parallelism: each all-reduce becomes a reduce-scatter plus an all-gather
    of the same total bytes. Forward: the attention entry all-gathers cat(context, stream) once, its
    exit reduce-scatters the stream; the MLP entry all-gathers, its exit reduce-scatters. Backward:
    the transpose of each (the "single" collectives log their output size)."""
    for tp in (2, 4):
        res = pool4.run(count_sequence_parallel_block, tp)[0]
        joint, stream = B * (res["n_context"] + T) * D, B * T * D
        gather, scatter = "all_gather_single", "reduce_scatter_single"
        assert [(name, numel) for name, numel, _ in res["forward"]] == [
            (gather, joint),  # attention entry: cat(context, stream), once
            (scatter, stream // tp),  # attention exit
            (gather, stream),  # MLP entry
            (scatter, stream // tp),  # MLP exit
        ], (tp, res["forward"])
        backward = [(name, numel) for name, numel, _ in res["backward"]]
        assert [c for c in backward if c[0] != "all_reduce"] == [
            (gather, stream),  # MLP exit's transpose
            (scatter, stream // tp),  # MLP entry's
            (gather, stream),  # attention exit's
            (scatter, joint // tp),  # attention entry's: the context's and the stream's gradients
        ], (tp, backward)
        # Besides: the gradients of the two row-parallel biases, added on this rank's positions
        # only, summed over the TP group (d elements each).
        assert [c for c in backward if c[0] == "all_reduce"] == [("all_reduce", D)] * 2
        assert res["out_shape"] == (B, T // tp, D)


def test_tp1_in_a_multi_rank_world_communicates_nothing(pool4):
    res = pool4.run(count_block, 1, "frozen")[0]
    assert res == {"forward": [], "backward": []}


def test_loss_adds_only_bt_sized_reductions(pool4):
    res = pool4.run(count_head_and_loss, 2)[0]
    assert res["head_forward"] == []  # logits are never gathered
    assert res["loss_forward"] == [
        ("all_reduce", B * T, str(dist.ReduceOp.MAX)),
        ("all_reduce", 2 * B * T, str(dist.ReduceOp.SUM)),
        ("all_reduce", B * T, str(dist.ReduceOp.MIN)),
    ]
    # Backward: only the head's region entry (the gradient of the hidden state).
    assert res["backward"] == [("all_reduce", B * T * D, "SUM")]


def summed_together(tp: int) -> dict:
    """Three replicated parameters used on this rank's share of the positions: their gradients
    through one flat all-reduce, against each rank's partial gradients summed by hand."""
    state = initialize_model_parallel(tp)
    group, rank = state.tp_group, dist.get_rank(state.tp_group)
    torch.manual_seed(3)  # the same parameters and data on every rank
    table, weight, bias = torch.randn(T, D), torch.randn(D, S), torch.randn(S)
    x = torch.randn(T, D)
    rows = slice(rank * T // tp, (rank + 1) * T // tp)

    def loss_of(params):
        table_, weight_, bias_ = params
        return ((x[rows] + table_[rows]) @ weight_ + bias_).square().sum()

    params = [p.clone().requires_grad_() for p in (table, weight, bias)]
    forward, backward = collectives_of(lambda: loss_of(with_gradients_summed_together(params, group)))
    partial = [p.clone().requires_grad_() for p in (table, weight, bias)]
    loss_of(partial).backward()
    excess = []
    for p, part in zip(params, partial, strict=True):
        whole, magnitude = part.grad.clone(), part.grad.abs()
        dist.all_reduce(whole, group=group)
        dist.all_reduce(magnitude, group=group)
        # The same tp terms per element, perhaps added in another order (gloo picks its algorithm
        # by buffer size): at most (tp - 1) roundings of at most the sum of their magnitudes.
        bound = (tp - 1) * torch.finfo(torch.float32).eps * magnitude
        excess.append(((p.grad - whole).abs() - bound).max().item())
    return {"forward": forward, "backward": backward, "excess": excess}


def test_gradients_summed_together_cost_one_all_reduce_and_equal_the_sum_of_the_parts(pool4):
    for tp in (2, 4):
        res = pool4.run(summed_together, tp)[0]
        assert res["forward"] == []
        assert res["backward"] == [("all_reduce", T * D + D * S + S, "SUM")], tp
        assert all(excess <= 0 for excess in res["excess"]), (tp, res["excess"])
