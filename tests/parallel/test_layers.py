"""TP=2 and TP=4 layers equal the TP=1 layers: forward, loss, input and parameter gradients after
one step (fp32, bounds from :mod:`tests.helpers.tp_compare`), and weights after five AdamW steps (float64,
where summation-order noise cannot be amplified by Adam). Real gloo ranks; the TP=1 twin is built
inside each rank from the same seed. Deliberately broken layers must fail the same checks."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallel_latent.parallel import (
    ColumnParallelLinear,
    DropoutRNG,
    ParallelAttention,
    ParallelMLP,
    RowParallelLinear,
    TensorParallelOptions,
    VocabParallelHead,
    initialize_model_parallel,
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
)
from parallel_latent.parallel.layers import NearestVocabParallelHead
from parallel_latent.parallel.mappings import gather_along_sequence, reduce_from_tp_region, split_along_sequence
from parallel_latent.parallel.utils import group_rank, group_size, mark_replicated
from tests.helpers.tp_compare import (
    gather_full,
    gather_last_dim,
    max_abs,
    max_param_diff,
    order_bound,
    scatter_last_dim,
    terms_scale,
    weights_after_adam,
)

B, T, S, D, HEADS, VOCAB = 3, 8, 4, 32, 4, 300  # T and S divisible by TP (sequence parallelism)
RANK = 8  # the nearest head's space
STEPS, LR, ADAM_EPS = 5, 1e-2, 1e-8


class SPLIT_ON_LAST_DIM:  # describes vocab-parallel logits to gather_full
    tensor_model_parallel, partition_dim = True, -1


def reduction_length(kind: str, tp: int) -> int:
    """Terms summed on the longest path to any compared quantity (forward GEMMs, softmax sums, the
    all-reduce over tp slices, and the B*T tokens a weight gradient sums over)."""
    tokens = B * T
    return {
        "mlp": D + 4 * D + tp + tokens,
        "mlp_sp": D + 4 * D + tp + tokens,
        "attention": D + D // HEADS + 2 * (S + T) + D + tp + tokens,
        "attention_sp": D + D // HEADS + 2 * (S + T) + D + tp + tokens,
        "head": D + VOCAB + tp + tokens,
        "nearest": 2 * D + RANK + VOCAB + tp + tokens,
        "nearest_sp": 2 * D + RANK + VOCAB + tp + tokens,
        "column_gather": D + tokens,
        "column_no_reduce": D + tokens,
        "row_scatter": 2 * D + tp + tokens,
    }[kind]


class ScatterThenRow(RowParallelLinear):
    """A row-parallel layer fed a whole input: the harness hands it this rank's slice."""

    def forward(self, x):
        return super().forward(scatter_last_dim(x, self.tp_group))


class RowParallelBiasPerRank(RowParallelLinear):
    """BROKEN on purpose: adds its bias before the all-reduce, so TP ranks add it TP times."""

    def forward(self, x):
        x = scatter_last_dim(x, self.tp_group)
        return reduce_from_tp_region(F.linear(x, self.weight, self.bias), self.tp_group)


class NearestHeadWithItsTable(nn.Module):
    """The nearest head and the (trainable) table it reads, so that the table's gradient, which
    every rank must hold whole, is compared too."""

    def __init__(self, tp_group, options):
        super().__init__()
        self.table = nn.Embedding(VOCAB, D)
        self.head = NearestVocabParallelHead(self.table, VOCAB, RANK, tp_group=tp_group, options=options, scale=0.5)
        mark_replicated(self)

    def forward(self, x):
        return self.head(x)


class ColumnThenGather(ColumnParallelLinear):
    """A column-parallel layer whose split output the harness gathers, to compare it whole."""

    def forward(self, x):
        return gather_last_dim(super().forward(x), self.tp_group)


class ColumnParallelNoBackwardReduce(ColumnParallelLinear):
    """BROKEN on purpose: skips the input-gradient all-reduce at the region's entry."""

    def forward(self, x):
        return gather_last_dim(F.linear(x, self.weight, self.bias), self.tp_group)


def _build(kind: str, tp_group, dropout: float, broken: str | None = None):
    torch.manual_seed(1234)
    rng = DropoutRNG(seed=99)
    sp = {"options": TensorParallelOptions(sequence_parallel=kind.endswith("_sp")).active(tp_group)}
    if kind.startswith("mlp"):
        module = ParallelMLP(D, 4 * D, dropout=dropout, rng=rng, tp_group=tp_group, **sp)
    elif kind.startswith("attention"):
        module = ParallelAttention(D, HEADS, dropout=dropout, rng=rng, tp_group=tp_group, **sp)
    elif kind == "head":
        module = VocabParallelHead(D, VOCAB, tp_group=tp_group)
    elif kind.startswith("nearest"):
        module = NearestHeadWithItsTable(tp_group, **sp)
    elif kind == "column_gather":
        module = ColumnThenGather(D, 2 * D, tp_group=tp_group)
    elif kind == "row_scatter":
        cls = RowParallelBiasPerRank if broken == "bias_per_rank" else ScatterThenRow
        module = cls(D, 2 * D, tp_group=tp_group)
    elif kind == "column_no_reduce":
        cls = ColumnParallelNoBackwardReduce if broken == "no_backward_reduce" else ColumnThenGather
        module = cls(D, 2 * D, tp_group=tp_group)
    else:
        raise ValueError(kind)
    # Non-zero biases (the same full vector at every TP degree, sliced like the weights), so a bias
    # applied the wrong number of times shows from the first forward.
    size, rank = group_size(tp_group), group_rank(tp_group)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("bias"):
                split = param.tensor_model_parallel
                full = torch.linspace(-0.5, 0.5, param.numel() * (size if split else 1))
                param.copy_(full.chunk(size)[rank] if split else full)
    return module, rng


def _inputs(step: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(B, T, D, generator=gen).to(dtype)
    context = torch.randn(B, S, D, generator=gen).to(dtype)
    mask = torch.rand(B, S, generator=gen) > 0.3
    target = torch.randint(0, VOCAB, (B, T), generator=gen)
    target[0, 0] = -100  # an ignored position
    return x, context, mask, target


def _forward_loss(kind, module, x, context, mask, target, tp_group):
    out = module(x, context=context, context_mask=mask) if kind.startswith("attention") else module(x)
    if kind.startswith(("head", "nearest")):
        loss, correct = vocab_parallel_cross_entropy(out, target, VOCAB, tp_group)
        return out, loss.mean(), correct
    weight = torch.linspace(-1, 1, B * T * out.shape[-1], dtype=out.dtype).view(B, T, -1)
    if out.shape[1] != T:  # sequence parallel: this rank's positions
        weight = split_along_sequence(weight, tp_group)
    return out, (out * weight).sum(), None


def _step(kind, module, rng, step, dtype, tp_group):
    """One forward and backward; outputs and input gradients of the whole sequence."""
    rng.step = step
    x, context, mask, target = _inputs(step, dtype)
    sequence_parallel = kind.endswith("_sp") and group_size(tp_group) > 1
    if sequence_parallel:  # each rank holds its positions of the stream and the context
        x, context = split_along_sequence(x, tp_group), split_along_sequence(context, tp_group)
    x.requires_grad_()
    context.requires_grad_()
    out, loss, correct = _forward_loss(kind, module, x, context, mask, target, tp_group)
    loss.backward()
    x_grad, ctx_grad, loss = x.grad, context.grad, loss.detach()
    head = kind.startswith(("head", "nearest"))
    if head:  # every position's logits (a head's entry gathers the positions), split by vocabulary
        out = gather_full(out, SPLIT_ON_LAST_DIM, tp_group)[..., :VOCAB]
    if sequence_parallel and head:
        x_grad = gather_along_sequence(x_grad, tp_group)
    elif sequence_parallel:
        out, x_grad = gather_along_sequence(out.detach(), tp_group), gather_along_sequence(x_grad, tp_group)
        if ctx_grad is not None:
            ctx_grad = gather_along_sequence(ctx_grad, tp_group)
        loss = loss.clone()
        torch.distributed.all_reduce(loss, group=tp_group)  # the ranks' positions' shares
    return out.detach(), loss, correct, x_grad, ctx_grad, target


def compare_with_tp1(tp: int, kind: str, dropout: float, broken: str | None = None) -> dict:
    """{quantity: (difference from TP=1, its bound)} for one fp32 step and five float64 AdamW steps."""
    state = initialize_model_parallel(tp)
    group, k = state.tp_group, reduction_length(kind, tp)
    ref, ref_rng = _build(kind, None, dropout)
    par, par_rng = _build(kind, group, dropout, broken)

    r = _step(kind, ref, ref_rng, 0, torch.float32, None)
    p = _step(kind, par, par_rng, 0, torch.float32, group)
    result = {}
    for key, index in (("out", 0), ("loss", 1), ("x_grad", 3), ("ctx_grad", 4)):
        if r[index] is not None and p[index] is not None:
            diff = (r[index] - p[index]).abs().max().item()
            result[key] = (diff, order_bound(k, terms_scale(max_abs([r[index]]), k)))
    ref_grads = [q.grad for q in ref.parameters()]
    result["param_grad"] = (
        max(max_param_diff(ref, par, group, grads=True).values()),
        order_bound(k, terms_scale(max_abs(ref_grads), k)),
    )
    if kind.startswith(("head", "nearest")):
        result["correct_equal"] = bool(torch.equal(r[2], p[2]))
        full = r[0]
        want = F.cross_entropy(full.reshape(-1, VOCAB), r[5].reshape(-1), ignore_index=-100, reduction="sum")
        want = want / r[5].numel()
        result["torch_loss"] = (abs(want.item() - p[1].item()), order_bound(k, terms_scale(abs(want.item()), k)))

    # Five AdamW steps in float64: gradients differ by at most the fp64 bound, which Adam turns into
    # at most adam_steps_bound of weight difference.
    ref64, ref_rng = _build(kind, None, dropout)
    par64, par_rng = _build(kind, group, dropout, broken)
    ref64.double(), par64.double()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR, eps=ADAM_EPS) for m in (ref64, par64)]
    grad_scale = 0.0
    for step in range(STEPS):
        r = _step(kind, ref64, ref_rng, step, torch.float64, None)
        _step(kind, par64, par_rng, step, torch.float64, group)
        grad_scale = max(grad_scale, max_abs([q.grad for q in ref64.parameters()]))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    result["weights"] = weights_after_adam(ref64, par64, group, STEPS, LR, ADAM_EPS, grad_scale, k)
    return result


def failures(result: dict) -> list[str]:
    bad = [
        f"{key} differs by {diff:.3g} > bound {bound:.3g}"
        for key, value in result.items()
        if isinstance(value, tuple)
        for diff, bound in [value]
        if not diff <= bound
    ]
    if result.get("correct_equal") is False:
        bad.append("token accuracy differs from TP=1")
    return bad


CASES = [
    ("mlp", 0.0),
    ("mlp", 0.1),
    ("mlp_sp", 0.1),
    ("attention", 0.0),
    ("attention", 0.1),
    ("attention_sp", 0.1),
    ("head", 0.0),
    ("nearest", 0.0),
    ("nearest_sp", 0.0),
    ("column_gather", 0.0),
    ("row_scatter", 0.0),
]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(("kind", "dropout"), CASES)
def test_tensor_parallel_equals_tp1(pool4, tp, kind, dropout):
    for rank, res in enumerate(pool4.run(compare_with_tp1, tp, kind, dropout)):
        assert failures(res) == [], f"rank {rank} {kind} tp={tp} dropout={dropout}"


@pytest.mark.parametrize(
    ("kind", "broken", "expected"),
    [
        ("row_scatter", "bias_per_rank", "out"),
        ("column_no_reduce", "no_backward_reduce", "x_grad"),
    ],
)
def test_a_broken_layer_fails_the_same_checks(pool4, kind, broken, expected):
    """The checks above can fail: a row-parallel bias added on every rank, and a column-parallel
    entry without its backward all-reduce, each exceed the bounds by orders of magnitude."""
    for rank, res in enumerate(pool4.run(compare_with_tp1, 2, kind, 0.0, broken)):
        diff, bound = res[expected]
        assert diff > 100 * bound, f"rank {rank}: {broken} went unnoticed ({expected} {diff:.3g} vs {bound:.3g})"
        assert failures(res), rank
    correct = pool4.run(compare_with_tp1, 2, kind, 0.0)
    assert all(failures(res) == [] for res in correct)


def test_master_weight_split_is_bit_identical(pool4):
    for tp in (2, 4):
        assert pool4.run(gathered_weights_bitwise, tp) == [0.0] * 4


def gathered_weights_bitwise(tp: int) -> float:
    state = initialize_model_parallel(tp)
    worst = 0.0
    for kind in ("mlp", "attention", "head", "nearest"):
        ref, _ = _build(kind, None, 0.0)
        par, _ = _build(kind, state.tp_group, 0.0)
        worst = max(worst, *max_param_diff(ref, par, state.tp_group).values())
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
    # Same formula, same order: log-sum-exp of VOCAB terms, each evaluated once.
    assert (loss.reshape(-1) - want).abs().max().item() <= order_bound(VOCAB, 10.0)
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
        for build in (
            lambda: ParallelAttention(D, HEADS, tp_group=group),
            lambda: ParallelMLP(D, 4 * D, tp_group=group),
        ):
            try:
                build()
            except ValueError as err:
                messages.append(str(err))
    return messages


def test_bad_tp_degree_is_one_clear_error(pool4):
    messages = pool4.run(bad_tp_errors)
    assert messages[0] == [
        "tensor_parallel=3 does not divide the world size 4",
        "attention heads=4 is not divisible by tensor_parallel=3",
        "output features=128 is not divisible by tensor_parallel=3",
    ]
    assert all("\n" not in m for m in messages[0])


def test_the_nearest_head_reads_back_every_row_of_its_table_at_a_narrow_rank():
    """The nearest head is nearest-neighbour decoding: a hidden state whose reading is a token's code
    scores that token highest, for every row of the table, at a rank far below the width (here 8 of
    32 features, 2,000 tokens). The same readings scored against the codes before their
    normalisation (the head without it: an inner product with rows of unequal length) pick the right
    row for few of them: the tokens with the longest codes win."""
    torch.manual_seed(7)
    vocab, rank = 2000, 8
    table = nn.Embedding(vocab, D).double()
    head = NearestVocabParallelHead(table, vocab, rank).double()
    with torch.no_grad():
        head.read.copy_(head.code)  # the state is the token's own (normalised) row: its reading, the code
        rows = F.layer_norm(table.weight, (D,))
        read_back = vocab_parallel_argmax(head(rows), vocab)
        codes = rows @ head.code.t()
        unnormalised = (codes @ codes.t()).argmax(dim=1)
    assert torch.equal(read_back, torch.arange(vocab))
    assert (unnormalised == torch.arange(vocab)).double().mean().item() < 0.5
