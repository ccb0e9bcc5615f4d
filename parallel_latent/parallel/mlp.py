"""The Megatron MLP: column-parallel h->4h, GELU and dropout on the slice (one kernel where the
dropout mask is compiled), row-parallel 4h->h, dropout on the replicated output. The pre-LayerNorm
belongs to the caller.

Under sequence parallelism (``options``, resolved for the group by the caller) the input and the
output hold this rank's positions: the entry all-gathers them, the exit reduce-scatters (the same
bytes as the two all-reduces it replaces)."""

from __future__ import annotations

import torch
from torch import nn

from .dropout import DropoutRNG, ParallelDropout
from .layers import ColumnParallelLinear, InitMethod, RowParallelLinear
from .utils import SINGLE_PROCESS, TensorParallelOptions


class ParallelMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        dropout: float = 0.0,
        rng: DropoutRNG | None = None,
        tp_group=None,
        init_method: InitMethod | None = None,
        output_init_method: InitMethod | None = None,
        options: TensorParallelOptions = SINGLE_PROCESS,
    ):
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(
            hidden_size, ffn_hidden_size, options=options, tp_group=tp_group, init_method=init_method
        )
        self.hidden_dropout = ParallelDropout(dropout, rng, partition_dim=-1, tp_group=tp_group)
        self.dense_4h_to_h = RowParallelLinear(
            ffn_hidden_size,
            hidden_size,
            options=options,
            tp_group=tp_group,
            init_method=output_init_method or init_method,
        )
        self.output_dropout = ParallelDropout(
            dropout, rng, partition_dim=1 if options.sequence_parallel else None, tp_group=tp_group
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Exact (erf) GELU, not the tanh approximation Megatron's GPT-2 uses; applied by the hidden
        # dropout, in its kernel where that is compiled (one pass over the 4h activations, not two).
        hidden = self.hidden_dropout(self.dense_h_to_4h(x), gelu=True)
        return self.output_dropout(self.dense_4h_to_h(hidden))
