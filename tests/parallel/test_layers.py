"""TP=2 and TP=4 layers equal the TP=1 layers: forward, loss, input and parameter gradients, and
weights after optimizer steps. Real gloo ranks; the TP=1 twin is built inside each rank from the
same seed, so every comparison is exact up to float reassociation."""
import pytest
import torch
import torch.nn.functional as F

from parallel_latent.parallel import (ColumnParallelLinear, DropoutRNG, ParallelAttention, ParallelMLP,
                                      RowParallelLinear, VocabParallelHead, initialize_model_parallel,
                                      vocab_parallel_cross_entropy)
from tests.tp_compare import gather_full, max_param_diff

B, T, S, D, HEADS, VOCAB = 3, 8, 5, 32, 4, 300
# fp32 sums taken in a different order (per-rank partial products, then the all-reduce)
ATOL = 2e-5


class SPLIT_ON_LAST_DIM:  # describes vocab-parallel logits to gather_full
    tensor_model_parallel, partition_dim = True, -1


def _build(kind: str, tp_group, dropout: float):
    torch.manual_seed(1234)
    rng = DropoutRNG(seed=99)
    if kind == "mlp":
        return ParallelMLP(D, 4 * D, dropout=dropout, rng=rng, tp_group=tp_group), rng
    if kind == "attention":
        return ParallelAttention(D, HEADS, dropout=dropout, rng=rng, tp_group=tp_group), rng
    if kind == "head":
        return VocabParallelHead(D, VOCAB, tp_group=tp_group), rng
    if kind == "column_gather":
        return ColumnParallelLinear(D, 2 * D, gather_output=True, tp_group=tp_group), rng
    if kind == "row_scatter":
        return RowParallelLinear(D, 2 * D, input_is_parallel=False, tp_group=tp_group), rng
    raise ValueError(kind)


def _forward_loss(kind, module, x, context, mask, target, tp_group, vocab=VOCAB):
    if kind == "attention":
        out = module(x, context=context, context_mask=mask)
    else:
        out = module(x)
    if kind == "head":
        loss, correct = vocab_parallel_cross_entropy(out, target, vocab, tp_group)
        return out, loss.mean(), correct
    weight = torch.linspace(-1, 1, out.numel()).view_as(out)
    return out, (out * weight).sum(), None


def compare_with_tp1(tp: int, kind: str, dropout: float, steps: int = 5) -> dict:
    state = initialize_model_parallel(tp)
    ref, ref_rng = _build(kind, None, dropout)
    par, par_rng = _build(kind, state.tp_group, dropout)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    par_opt = torch.optim.AdamW(par.parameters(), lr=1e-2)
    result = {"out": 0.0, "loss": 0.0, "x_grad": 0.0, "ctx_grad": 0.0, "param_grad": 0.0, "weights": 0.0,
              "correct_equal": True}
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(B, T, D, generator=gen)
        context = torch.randn(B, S, D, generator=gen)
        mask = torch.rand(B, S, generator=gen) > 0.3
        target = torch.randint(0, VOCAB, (B, T), generator=gen)
        target[0, 0] = -100  # an ignored position
        outs = {}
        for name, module, rng in (("ref", ref, ref_rng), ("par", par, par_rng)):
            rng.step = step
            xi = x.clone().requires_grad_()
            ci = context.clone().requires_grad_()
            out, loss, correct = _forward_loss(kind, module, xi, ci, mask, target, None if name == "ref" else state.tp_group)
            loss.backward()
            outs[name] = (out, loss, correct, xi.grad, ci.grad)
        if step == 0:
            ref_out, par_out = outs["ref"][0], outs["par"][0]
            if kind == "head":  # logits stay split: gather only to compare
                par_out = gather_full(par_out, SPLIT_ON_LAST_DIM, state.tp_group)
                par_out = par_out[..., :VOCAB]
                ref_out = ref_out[..., :VOCAB]
            result["out"] = (ref_out - par_out).abs().max().item()
            result["loss"] = abs(outs["ref"][1].item() - outs["par"][1].item())
            result["x_grad"] = (outs["ref"][3] - outs["par"][3]).abs().max().item()
            if outs["ref"][4] is not None:
                result["ctx_grad"] = (outs["ref"][4] - outs["par"][4]).abs().max().item()
            result["param_grad"] = max(max_param_diff(ref, par, state.tp_group, grads=True).values())
            if kind == "head":
                result["correct_equal"] = bool(torch.equal(outs["ref"][2], outs["par"][2]))
                # and against torch's own loss on full logits
                full = outs["ref"][0][..., :VOCAB]
                want = F.cross_entropy(full.reshape(-1, VOCAB), target.reshape(-1), ignore_index=-100,
                                       reduction="sum") / target.numel()
                result["torch_loss"] = abs(want.item() - outs["par"][1].item())
        ref_opt.step(), par_opt.step()
        ref_opt.zero_grad(), par_opt.zero_grad()
    result["weights"] = max(max_param_diff(ref, par, state.tp_group).values())
    return result


CASES = [("mlp", 0.0), ("mlp", 0.1), ("attention", 0.0), ("attention", 0.1), ("head", 0.0),
         ("column_gather", 0.0), ("row_scatter", 0.0)]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("kind,dropout", CASES)
def test_tensor_parallel_equals_tp1(pool4, tp, kind, dropout):
    for rank, res in enumerate(pool4.run(compare_with_tp1, tp, kind, dropout)):
        for key in ("out", "loss", "x_grad", "ctx_grad", "param_grad", "weights", "torch_loss"):
            if key in res:
                assert res[key] <= ATOL, f"rank {rank} {kind} tp={tp}: {key} differs by {res[key]:.3g}"
        assert res["correct_equal"], f"rank {rank}: token accuracy differs from TP=1"


def test_master_weight_split_is_bit_identical(pool4):
    for tp in (2, 4):
        assert pool4.run(gathered_weights_bitwise, tp) == [0.0] * 4


def gathered_weights_bitwise(tp: int) -> float:
    state = initialize_model_parallel(tp)
    worst = 0.0
    for kind in ("mlp", "attention", "head"):
        ref, _ = _build(kind, None, 0.0)
        par, _ = _build(kind, state.tp_group, 0.0)
        worst = max(worst, max(max_param_diff(ref, par, state.tp_group).values()))
    return worst


def test_partition_flags_single_process():
    mlp = ParallelMLP(D, 4 * D)
    flags = {n: (p.tensor_model_parallel, p.partition_dim, p.partition_stride) for n, p in mlp.named_parameters()}
    assert flags["dense_h_to_4h.weight"] == (True, 0, 1)
    assert flags["dense_h_to_4h.bias"] == (True, 0, 1)
    assert flags["dense_4h_to_h.weight"] == (True, 1, 1)
    assert flags["dense_4h_to_h.bias"] == (False, None, 1)
    head = VocabParallelHead(D, VOCAB)
    assert head.padded_vocab_size == 384 and head.weight.shape == (384, D)
    assert torch.count_nonzero(head.weight[VOCAB:]) == 0


def test_padded_vocab_never_wins_single_process():
    logits = torch.zeros(2, 3, 384)
    logits[..., VOCAB:] = 1e4  # padding columns hold huge logits and must still be ignored
    logits[0, 0, 7] = 5.0
    target = torch.full((2, 3), 7)
    loss, correct = vocab_parallel_cross_entropy(logits, target, VOCAB)
    want = F.cross_entropy(logits[..., :VOCAB].reshape(-1, VOCAB), target.reshape(-1), reduction="none")
    assert torch.allclose(loss.reshape(-1), want)
    assert correct[0, 0] and not correct[0, 1]  # ties at 0 resolve to index 0, not 7


def bad_tp_errors() -> list:
    import torch.distributed as dist
    messages = []
    try:
        initialize_model_parallel(3)
    except ValueError as err:
        messages.append(str(err))
    group = dist.new_group([0, 1, 2])  # collective: every rank creates it
    if dist.get_rank() < 3:
        for build in (lambda: ParallelAttention(D, HEADS, tp_group=group),
                      lambda: ParallelMLP(D, 4 * D, tp_group=group)):
            try:
                build()
            except ValueError as err:
                messages.append(str(err))
    return messages


def test_bad_tp_degree_is_one_clear_error(pool4):
    messages = pool4.run(bad_tp_errors)
    assert messages[0] == ["tensor_parallel=3 does not divide the world size 4",
                           "attention heads=4 is not divisible by tensor_parallel=3",
                           "output features=128 is not divisible by tensor_parallel=3"]
    assert all("\n" not in m for m in messages[0])
