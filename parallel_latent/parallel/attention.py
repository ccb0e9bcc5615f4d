"""Multi-head attention with the heads split over the tensor-parallel group.

q, k and v are column-parallel (each rank owns ``n_heads / tp`` whole heads), the output projection
is row-parallel, so one attention costs one collective forward and one backward. Keys and values
may come from a context tensor, optionally with the query stream appended (the Perceiver-resampler
form). The region is entered once, on one tensor, for all three projections
(:func:`column_parallel_projections`), so the backward collective is single even then, and
overlapped with the weight gradients.

Sequence parallelism: the stream (and a context that needs a gradient) hold this rank's positions;
the region's entry all-gathers them along the sequence (one all-gather of cat(context, stream)) and
the output projection reduce-scatters back to this rank's positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .dropout import DropoutRNG, ParallelDropout
from .layers import ColumnParallelWeights, InitMethod, RowParallelLinear
from .projection import Projection, column_parallel_projections
from .utils import SINGLE_PROCESS, TensorParallelOptions, divide, group_size


class ParallelAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        dropout: float = 0.0,
        rng: DropoutRNG | None = None,
        tp_group=None,
        init_method: InitMethod | None = None,
        output_init_method: InitMethod | None = None,
        bias: bool = True,
        options: TensorParallelOptions = SINGLE_PROCESS,
    ):
        super().__init__()
        if hidden_size % num_heads != 0:
            raise ValueError(f"hidden size {hidden_size} is not divisible by the {num_heads} heads")
        self.heads_per_rank = divide(num_heads, group_size(tp_group), "attention heads")
        self.head_dim = hidden_size // num_heads
        self.tp_group, self.options = tp_group, options
        # The q, k and v weights; this module applies them itself, at one region entry.
        column = dict(bias=bias, tp_group=tp_group, init_method=init_method)
        self.query = ColumnParallelWeights(hidden_size, hidden_size, **column)
        # No key bias: q.(k + b) shifts every score of a query by the same amount, which softmax
        # ignores, so its true gradient is zero and Adam would only amplify rounding noise.
        self.key = ColumnParallelWeights(hidden_size, hidden_size, **{**column, "bias": False})
        self.value = ColumnParallelWeights(hidden_size, hidden_size, **column)
        self.dense = RowParallelLinear(
            hidden_size,
            hidden_size,
            bias=bias,
            options=options,
            tp_group=tp_group,
            init_method=output_init_method or init_method,
        )
        # Attention-probability dropout is not offered: SDPA's internal RNG is not TP-invariant.
        # Under sequence parallelism the output holds this rank's positions (dim 1).
        self.output_dropout = ParallelDropout(
            dropout, rng, partition_dim=1 if options.sequence_parallel else None, tp_group=tp_group
        )

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, n, _ = t.shape
        return t.view(b, n, self.heads_per_rank, self.head_dim).transpose(1, 2)

    def _project(self, x, context, context_mask, attend_to_self):
        """q [B, T, d/tp] of the (whole) stream, k and v of the keys, and the keys' mask."""
        sequence_parallel = self.options.sequence_parallel
        tp = group_size(self.tp_group)
        device, batch = x.device, x.shape[0]
        prefix = None
        if tp == 1:
            return self._project_alone(x, context, context_mask, attend_to_self)
        if context is None:
            region_input, q_index, kv_index = x, None, None
            key_mask = None
        elif not context.requires_grad and not sequence_parallel:
            # A frozen context needs no gradient: it is concatenated inside the region, whole on
            # every rank, and only the stream's gradient is reduced.
            prefix, region_input = context, x
            n_context, n_stream = context.shape[1], x.shape[1]
            q_index = torch.arange(n_context, n_context + n_stream, device=device)
            kv_index = None if attend_to_self else torch.arange(n_context, device=device)
            key_mask = self._key_mask(context_mask, [(context_mask, n_stream)], batch, attend_to_self)
        else:
            # One tensor enters the region: cat(context, stream) (this rank's positions of both
            # under sequence parallelism, which the all-gather lays out rank after rank).
            region_input = torch.cat([context, x], dim=1)
            n_context, n_stream = context.shape[1], x.shape[1]
            chunk, ranks = n_context + n_stream, tp if sequence_parallel else 1
            starts = torch.arange(ranks, device=device)[:, None] * chunk
            q_index = (starts + n_context + torch.arange(n_stream, device=device)).reshape(-1)
            kv_index = None if attend_to_self else (starts + torch.arange(n_context, device=device)).reshape(-1)
            pieces = None
            if context_mask is not None:
                # The context mask is whole on every rank; cut it like the context was cut.
                per_rank = context_mask.shape[1] // ranks
                pieces = [(context_mask[:, r * per_rank : (r + 1) * per_rank], n_stream) for r in range(ranks)]
            key_mask = self._key_mask(context_mask, pieces, batch, attend_to_self)
        q, k, v = column_parallel_projections(
            region_input,
            [
                Projection(self.query.weight, self.query.bias, q_index),
                Projection(self.key.weight, self.key.bias, kv_index),
                Projection(self.value.weight, self.value.bias, kv_index),
            ],
            self.tp_group,
            sequence_parallel=sequence_parallel,
            overlap=self.options.overlap_comm,
            prefix=prefix,
        )
        return q, k, v, key_mask

    def _project_alone(self, x, context, context_mask, attend_to_self):
        """:meth:`_project` in one process: no region to enter, so the queries read the stream itself
        and the keys ``cat(context, stream)`` (or the context), with no index into one region input
        (its backward would scatter into a zeroed copy of it)."""
        keys = x if context is None else (torch.cat([context, x], dim=1) if attend_to_self else context)
        q = F.linear(x, self.query.weight, self.query.bias)
        k, v = (F.linear(keys, p.weight, p.bias) for p in (self.key, self.value))
        pieces = None if context_mask is None else [(context_mask, x.shape[1])]
        return q, k, v, self._key_mask(context_mask, pieces, x.shape[0], attend_to_self)

    @staticmethod
    def _key_mask(context_mask, pieces, batch, attend_to_self):
        """[B, keys] bool in the keys' order: each piece of the context mask, followed (when the
        stream attends to itself) by that many always-visible stream positions."""
        if context_mask is None:
            return None
        parts = []
        for piece, n_stream in pieces:
            parts.append(piece.bool())
            if attend_to_self:
                parts.append(piece.new_ones(batch, n_stream, dtype=torch.bool))
        return torch.cat(parts, dim=1)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
        attend_to_self: bool = True,
    ) -> torch.Tensor:
        """``x`` [B, T, d] queries; ``context`` [B, S, d]; ``context_mask`` [B, S], True = attend
        (always the whole context's mask, also under sequence parallelism, where ``x`` and the
        context hold this rank's T/tp and S/tp positions).

        With a context and ``attend_to_self`` the keys are ``cat(context, x)``; the query stream's
        own positions are never masked.
        """
        q, k, v, key_mask = self._project(x, context, context_mask, attend_to_self)
        q, k, v = self._heads(q), self._heads(k), self._heads(v)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        b, _, t, _ = out.shape
        out = out.transpose(1, 2).reshape(b, t, self.heads_per_rank * self.head_dim)
        return self.output_dropout(self.dense(out))
