"""Multi-head attention with the heads split over the tensor-parallel group.

q, k and v are column-parallel (each rank owns ``n_heads / tp`` whole heads), the output projection
is row-parallel, so one attention costs one all-reduce forward and one backward. Keys and values
may come from a context tensor, optionally with the query stream appended (the Perceiver-resampler
form). The region is entered once, on one tensor, so the backward all-reduce is single even then.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import ColumnParallelLinear, InitMethod, RowParallelLinear
from .mappings import copy_to_tp_region
from .random import DropoutRNG, ParallelDropout
from .utils import divide, group_size


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
    ):
        super().__init__()
        if hidden_size % num_heads != 0:
            raise ValueError(f"hidden size {hidden_size} is not divisible by the {num_heads} heads")
        tp = group_size(tp_group)
        self.heads_per_rank = divide(num_heads, tp, "attention heads")
        self.head_dim = hidden_size // num_heads
        self.tp_group = tp_group
        column = dict(bias=bias, input_is_copied=True, tp_group=tp_group, init_method=init_method)
        self.query = ColumnParallelLinear(hidden_size, hidden_size, **column)
        # No key bias: q.(k + b) shifts every score of a query by the same amount, which softmax
        # ignores, so its true gradient is zero and Adam would only amplify rounding noise.
        self.key = ColumnParallelLinear(hidden_size, hidden_size, **{**column, "bias": False})
        self.value = ColumnParallelLinear(hidden_size, hidden_size, **column)
        self.dense = RowParallelLinear(
            hidden_size,
            hidden_size,
            bias=bias,
            input_is_parallel=True,
            tp_group=tp_group,
            init_method=output_init_method or init_method,
        )
        # Attention-probability dropout is not offered: SDPA's internal RNG is not TP-invariant.
        self.output_dropout = ParallelDropout(dropout, rng, partition_dim=None, tp_group=tp_group)

    def _enter_region(self, x, context, attend_to_self):
        """Return (query input, key/value input) after a single copy-to-TP-region."""
        if context is None:
            x = copy_to_tp_region(x, self.tp_group)
            return x, x
        if not context.requires_grad:
            # A frozen context needs no gradient, so it need not pass through the region's entry.
            x = copy_to_tp_region(x, self.tp_group)
            return x, (torch.cat([context, x], dim=1) if attend_to_self else context)
        joint = copy_to_tp_region(torch.cat([context, x], dim=1), self.tp_group)
        n_context = context.shape[1]
        return joint[:, n_context:], (joint if attend_to_self else joint[:, :n_context])

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, n, _ = t.shape
        return t.view(b, n, self.heads_per_rank, self.head_dim).transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
        attend_to_self: bool = True,
    ) -> torch.Tensor:
        """``x`` [B, T, d] queries; ``context`` [B, S, d]; ``context_mask`` [B, S], True = attend.

        With a context and ``attend_to_self`` the keys are ``cat(context, x)``; the query stream's
        own positions are never masked.
        """
        q_in, kv_in = self._enter_region(x, context, attend_to_self)
        q, k, v = self._heads(self.query(q_in)), self._heads(self.key(kv_in)), self._heads(self.value(kv_in))
        mask = None
        if context is not None and context_mask is not None:
            mask = context_mask.bool()
            if attend_to_self:
                mask = torch.cat([mask, mask.new_ones(x.shape[0], x.shape[1])], dim=1)
            mask = mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        b, _, t, _ = out.shape
        out = out.transpose(1, 2).reshape(b, t, self.heads_per_rank * self.head_dim)
        return self.output_dropout(self.dense(out))
