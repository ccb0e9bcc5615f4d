"""Column- and row-parallel linear layers and the vocabulary-parallel head.

Initialization follows Megatron's master-weight split: every rank generates the *full* weight from
the same generator state, exactly as a TP=1 model would, and keeps its slice. The generator is
therefore consumed identically at every TP degree, and gathered TP=N weights equal TP=1 weights
bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .mappings import (
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
)
from .projection import Projection, column_parallel_projections
from .utils import (
    SINGLE_PROCESS,
    TensorParallelOptions,
    divide,
    group_rank,
    group_size,
    mark_sequence_parallel,
    pad_vocab_size,
    set_tensor_parallel_attributes,
)

InitMethod = Callable[[torch.Tensor], None]


def normal_init(std: float = 0.02) -> InitMethod:
    def init(tensor: torch.Tensor) -> None:
        nn.init.normal_(tensor, mean=0.0, std=std)

    return init


def _init_partitioned_weight(
    weight: nn.Parameter,
    full_shape: tuple[int, int],
    partition_dim: int,
    init_method: InitMethod,
    group,
    valid_rows: int | None = None,
) -> None:
    master = torch.empty(full_shape, dtype=torch.float32)
    if valid_rows is None:
        init_method(master)
    else:
        # Padded vocabulary rows stay zero so every TP degree draws the same real rows.
        master.zero_()
        init_method(master[:valid_rows])
    shard = master.chunk(group_size(group), dim=partition_dim)[group_rank(group)]
    with torch.no_grad():
        weight.copy_(shard)


class ColumnParallelWeights(nn.Module):
    """A weight ``[out, in]`` (and bias) split by output features over the TP group, initialised by
    the master-weight split: what a column-parallel projection holds. :class:`ColumnParallelLinear`
    applies it to its input; attention applies its q, k and v weights together, at one region
    entry."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        tp_group=None,
        init_method: InitMethod | None = None,
        dtype=None,
        device=None,
        _valid_out_features: int | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features, self.tp_group = in_features, out_features, tp_group
        self.out_per_rank = divide(out_features, group_size(tp_group), "output features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features, dtype=dtype, device=device))
        set_tensor_parallel_attributes(self.weight, True, 0)
        _init_partitioned_weight(
            self.weight, (out_features, in_features), 0, init_method or normal_init(), tp_group, _valid_out_features
        )
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_per_rank, dtype=dtype, device=device))
            set_tensor_parallel_attributes(self.bias, True, 0)
        else:
            self.register_parameter("bias", None)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features} ({self.out_per_rank}/rank), bias={self.bias is not None}"
        )


class ColumnParallelLinear(ColumnParallelWeights):
    """``Y = X A + b`` with ``A`` split by columns (output features) over the TP group; the output
    stays split. The input gradient is all-reduced at the region's entry (:mod:`.projection`:
    started asynchronously and overlapped with the weight gradient unless ``options.overlap_comm``
    is off). Under ``options.sequence_parallel`` the input holds this rank's positions: it is
    all-gathered along the sequence and its gradient reduce-scattered."""

    def __init__(
        self, in_features: int, out_features: int, *, options: TensorParallelOptions = SINGLE_PROCESS, **weights
    ):
        super().__init__(in_features, out_features, **weights)
        self.options = options

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (y,) = column_parallel_projections(
            x,
            [Projection(self.weight, self.bias)],
            self.tp_group,
            sequence_parallel=self.options.sequence_parallel,
            overlap=self.options.overlap_comm,
        )
        return y


class RowParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by rows (input features), the input already split; one
    all-reduce in forward (a reduce-scatter along the sequence under ``options.sequence_parallel``:
    each rank keeps its positions). The bias is replicated and added once, after the reduce, so it
    is not summed TP times."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        options: TensorParallelOptions = SINGLE_PROCESS,
        tp_group=None,
        init_method: InitMethod | None = None,
        dtype=None,
        device=None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.options, self.tp_group = options, tp_group
        self.in_per_rank = divide(in_features, group_size(tp_group), "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, dtype=dtype, device=device))
        set_tensor_parallel_attributes(self.weight, True, 1)
        _init_partitioned_weight(self.weight, (out_features, in_features), 1, init_method or normal_init(), tp_group)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
            set_tensor_parallel_attributes(self.bias, False, None)
            if options.sequence_parallel:
                mark_sequence_parallel(self.bias, tp_group)  # added on this rank's positions only
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.options.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        else:
            y = reduce_from_tp_region(partial, self.tp_group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features} ({self.in_per_rank}/rank), out={self.out_features}, bias={self.bias is not None}"


class VocabParallelHead(ColumnParallelLinear):
    """Projection to the vocabulary, split over TP by vocabulary rows; logits are never gathered.

    The vocabulary is padded to a multiple of ``128 * tp``; padded rows are zero and the
    vocab-parallel loss masks their logits, so they never win an argmax nor carry probability.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        bias: bool = False,
        tp_group=None,
        options: TensorParallelOptions = SINGLE_PROCESS,
        init_method: InitMethod | None = None,
        dtype=None,
        device=None,
    ):
        self.vocab_size = vocab_size
        self.padded_vocab_size = pad_vocab_size(vocab_size, group_size(tp_group))
        super().__init__(
            hidden_size,
            self.padded_vocab_size,
            bias=bias,
            tp_group=tp_group,
            options=options,
            init_method=init_method,
            dtype=dtype,
            device=device,
            _valid_out_features=vocab_size,
        )
        # Checkpoints store the unpadded vocabulary so they load at any TP degree.
        for param in self.parameters():
            param.partition_valid_size = vocab_size

    @property
    def vocab_start(self) -> int:
        return group_rank(self.tp_group) * self.out_per_rank

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size} (padded {self.padded_vocab_size}), " + super().extra_repr()


def _whole_table_gradient(rows: torch.Tensor, width: int, table_rows: int, group) -> torch.Tensor:
    """The gradient of a table every rank of ``group`` holds whole, from ``rows``, the gradient of
    this rank's slice of it (the rows behind its ``width`` vocabulary columns): the ranks' slices
    all-gathered, so every rank holds the same whole gradient and the replicas cannot drift apart."""
    if group_size(group) == 1:
        return rows
    padded = rows.new_zeros(width, rows.shape[1])
    padded[: rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in range(group_size(group))]
    dist.all_gather(parts, padded, group=group)
    return torch.cat(parts)[:table_rows]


class _TiedVocabLogits(torch.autograd.Function):
    """``x @ table[start:stop]^T`` in the first columns of ``width``: this rank's slice of the logits
    (columns past ``stop - start`` are vocabulary padding, zero).

    The table is saved as the parameter itself, not as a view of its rows: ZeRO-3 swaps a
    partitioned parameter's storage between forward and backward (as DeepSpeed's own linear does).
    Its gradient exists only for this rank's rows, so backward all-gathers the rows of every rank:
    a table that every rank of the group holds (and trains) gets the whole gradient, the same bits
    on each rank, and the replicas cannot drift apart.
    """

    @staticmethod
    def forward(ctx, x, table, start, stop, width, group):
        ctx.rows, ctx.width, ctx.group, ctx.x_shape = (start, stop), width, group, x.shape
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, table)
        flat = x.reshape(-1, x.shape[-1])
        # Written in place into the padded layout: padding the logits afterwards would copy the
        # largest tensor of the model once more.
        logits = flat.new_empty(flat.shape[0], width)
        torch.mm(flat, table[start:stop].t(), out=logits[:, : stop - start])
        logits[:, stop - start :].zero_()
        return logits.view(*x.shape[:-1], width)

    @staticmethod
    def backward(ctx, grad):
        x, table = ctx.saved_tensors
        (start, stop), width, group = ctx.rows, ctx.width, ctx.group
        # Strided views, no copies: the padded columns have no parameter behind them.
        grad = grad.reshape(-1, width)[:, : stop - start]
        grad_x = grad_table = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad @ table[start:stop]).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_table = _whole_table_gradient(grad.t() @ x.reshape(-1, x.shape[-1]), width, table.shape[0], group)
        return grad_x, grad_table, None, None, None, None


class TiedVocabParallelHead(nn.Module):
    """Projection to the vocabulary through an embedding table that every rank of the TP group
    holds whole (weight tying, as GPT-2 ties its LM head to its token table):
    ``logits = (exp(log_scale) * x) @ table^T``, with a learned scalar scale, starting at ``scale``.

    Same layout as :class:`VocabParallelHead`: the vocabulary is padded to a multiple of
    ``128 * tp``, each rank computes the logits of its slice only (padded columns are zero and
    masked by the vocab-parallel loss), and the logits are never gathered. The head holds no
    weight of its own: it reads its rows of the owner's table at every forward, so the table is
    stored, trained and partitioned (ZeRO-3) once, by its owner. The scale multiplies the input
    before it enters the tensor-parallel region, so its gradient is reduced with the input's. It
    is the softmax temperature that a frozen table cannot learn in its rows; learned in log space,
    an optimizer step changes it by a fraction of itself whatever its size.
    """

    def __init__(
        self,
        embedding: nn.Module,
        vocab_size: int,
        *,
        tp_group=None,
        options: TensorParallelOptions = SINGLE_PROCESS,
        scale: float = 1.0,
    ):
        super().__init__()
        # Under sequence parallelism x holds this rank's positions: the entry gathers them.
        self.options = options
        rows, self.hidden_size = embedding.weight.shape
        if rows != vocab_size:
            raise ValueError(f"the tied table has {rows} rows but the vocabulary has {vocab_size} tokens")
        self.vocab_size, self.tp_group = vocab_size, tp_group
        self.padded_vocab_size = pad_vocab_size(vocab_size, group_size(tp_group))
        self.out_per_rank = self.padded_vocab_size // group_size(tp_group)
        # A tuple, not an attribute nn.Module would register: the table is the owner's parameter,
        # and registering it here would put it in this module's state_dict and parameters() too.
        self._embedding = (embedding,)
        # Shape [1], not 0-dim: ZeRO and checkpoints flatten and partition ordinary 1-D tensors.
        self.log_scale = nn.Parameter(torch.full((1,), math.log(scale)))
        set_tensor_parallel_attributes(self.log_scale, False, None)
        if options.sequence_parallel:
            mark_sequence_parallel(self.log_scale, tp_group)  # applied on this rank's positions

    @property
    def table(self) -> torch.Tensor:
        return self._embedding[0].weight

    def borrowed_parameters(self) -> tuple[torch.Tensor, ...]:
        """The parameters this module reads but another owns: the table. A runtime that gathers a
        partitioned parameter only around its owner's forward and backward (ZeRO-3) must gather
        these for this module's too."""
        return (self.table,)

    @property
    def vocab_start(self) -> int:
        return group_rank(self.tp_group) * self.out_per_rank

    @property
    def vocab_rows(self) -> tuple[int, int]:
        """The table rows ``[start, stop)`` behind this rank's logits (fewer than ``out_per_rank``, or
        none, where the slice reaches into the padding)."""
        start = min(self.vocab_start, self.vocab_size)
        return start, min(start + self.out_per_rank, self.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        entry = gather_from_sequence_parallel_region if self.options.sequence_parallel else copy_to_tp_region
        x = entry(x * self.log_scale.exp(), self.tp_group)
        start, stop = self.vocab_rows
        return _TiedVocabLogits.apply(x, self.table, start, stop, self.out_per_rank, self.tp_group)

    def extra_repr(self) -> str:
        return (
            f"tied, in={self.hidden_size}, vocab={self.vocab_size} (padded {self.padded_vocab_size}, "
            f"{self.out_per_rank}/rank)"
        )


class _RowsOfReplicatedTable(torch.autograd.Function):
    """``table[start:stop]``, the rows behind this rank's vocabulary columns, of a table every rank of
    ``group`` holds whole. The table is saved as the parameter itself (ZeRO-3 swaps its storage
    between forward and backward); a table that trains gets its whole gradient on every rank:
    backward all-gathers each rank's rows, as :class:`_TiedVocabLogits` does."""

    @staticmethod
    def forward(ctx, table, start, stop, width, group):
        ctx.rows, ctx.width, ctx.group, ctx.table_rows = (start, stop), width, group, table.shape[0]
        return table[start:stop].clone()

    @staticmethod
    def backward(ctx, grad):
        return _whole_table_gradient(grad, ctx.width, ctx.table_rows, ctx.group), None, None, None, None


class _PaddedLogits(torch.autograd.Function):
    """``x @ weight^T`` [n, width] written into the first columns of the padded vocabulary layout
    (columns past ``weight``'s rows are zero): no copy of the logits to pad them."""

    @staticmethod
    def forward(ctx, x, weight, width):
        ctx.save_for_backward(x, weight)
        logits = x.new_empty(x.shape[0], width)
        torch.mm(x, weight.t(), out=logits[:, : weight.shape[0]])
        logits[:, weight.shape[0] :].zero_()
        return logits

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad[:, : weight.shape[0]]
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.t() @ x if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight, None


class NearestVocabParallelHead(TiedVocabParallelHead):
    """A tied head that decodes in a learned space of ``rank`` dimensions: each token's row of the
    table, normalised, is projected to ``rank`` features and normalised again (mean 0, root-mean-
    square 1: its *code*), and the hidden state's reading ``read(x)`` scores each token by its inner
    product with the code, times a learned scale: ``logits_v = exp(log_scale) * read(x) . code_v``.

    Every code has the same length, so the highest score is the nearest code: a reading on a token's
    code scores that token highest, at any rank, for every row of the table, whether the token occurs
    in training or not. A hidden state that carries only ``rank`` dimensions of information (a decoder
    reading narrow latents, which end in the same normalisation) then only has to be mapped onto the
    code, a map of ``rank`` features, which holds for every token alike. The tied head instead scores
    the table's rows as they are, where the longest rows win a state of few dimensions (a random
    ``rank``-dimensional reading of a random table picks the right row for 25% of the vocabulary at
    rank 16, 89% at 32): the decoder must rebuild the whole row, which it learns per token, for the
    tokens it sees.

    ``read`` and ``code`` (``[rank, hidden]``, weights of standard deviation ``1 / sqrt(hidden)``)
    and the scale (starting at ``scale``) are replicated. The codes of this rank's vocabulary slice
    are computed from the table at every forward, so ``code``'s gradient here covers this rank's
    tokens only: it enters through :func:`.mappings.copy_to_tp_region` (one all-reduce of its
    gradient). ``read`` and the scale run before the tensor-parallel region, as the tied head's scale
    does, so the region's entry carries ``rank`` features per position instead of ``hidden``; under
    sequence parallelism they see this rank's positions and their gradients are summed over the
    group (:func:`.utils.mark_sequence_parallel`).
    """

    def __init__(
        self,
        embedding: nn.Module,
        vocab_size: int,
        rank: int,
        *,
        tp_group=None,
        options: TensorParallelOptions = SINGLE_PROCESS,
        scale: float = 1.0,
    ):
        super().__init__(embedding, vocab_size, tp_group=tp_group, options=options, scale=scale)
        self.rank = rank
        self.read = nn.Parameter(torch.empty(rank, self.hidden_size))
        self.code = nn.Parameter(torch.empty(rank, self.hidden_size))
        for weight in (self.read, self.code):
            normal_init(1.0 / math.sqrt(self.hidden_size))(weight.data)
            set_tensor_parallel_attributes(weight, False, None)
        if options.sequence_parallel:
            mark_sequence_parallel(self.read, tp_group)

    def codes(self, code: torch.Tensor | None = None) -> torch.Tensor:
        """The codes [vocabulary rows of this rank, rank] of this rank's slice of the vocabulary."""
        start, stop = self.vocab_rows
        rows = self.table[start:stop]
        if self.table.requires_grad:  # its gradient must reach every rank whole
            rows = _RowsOfReplicatedTable.apply(self.table, start, stop, self.out_per_rank, self.tp_group)
        rows = F.linear(F.layer_norm(rows, rows.shape[-1:]), self.code if code is None else code)
        return F.layer_norm(rows, rows.shape[-1:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        entry = gather_from_sequence_parallel_region if self.options.sequence_parallel else copy_to_tp_region
        read = entry(F.linear(x, self.read) * self.log_scale.exp(), self.tp_group)
        codes = self.codes(copy_to_tp_region(self.code, self.tp_group))
        logits = _PaddedLogits.apply(read.reshape(-1, self.rank), codes, self.out_per_rank)
        return logits.view(*read.shape[:-1], self.out_per_rank)

    def extra_repr(self) -> str:
        return f"nearest, rank={self.rank}, " + super().extra_repr()


def scaled_init(std: float, num_layers: int) -> InitMethod:
    """GPT-2's init for projections that write into the residual stream."""
    return normal_init(std / math.sqrt(2.0 * max(num_layers, 1)))
