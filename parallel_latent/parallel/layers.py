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
import torch.nn.functional as F
from torch import nn

from .mappings import copy_to_tp_region, gather_from_tp_region, reduce_from_tp_region, scatter_to_tp_region
from .utils import divide, group_rank, group_size, pad_vocab_size, set_tensor_parallel_attributes

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


class ColumnParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by columns (output features) over the TP group.

    The output stays split unless ``gather_output``; the input gradient is all-reduced at the
    region's entry. ``input_is_copied`` lets a caller that feeds several column-parallel layers
    from one tensor enter the region once (one backward all-reduce instead of several).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        input_is_copied: bool = False,
        tp_group=None,
        init_method: InitMethod | None = None,
        dtype=None,
        device=None,
        _valid_out_features: int | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.skip_bias_add, self.input_is_copied = gather_output, skip_bias_add, input_is_copied
        self.tp_group = tp_group
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

    def forward(self, x: torch.Tensor):
        if not self.input_is_copied:
            x = copy_to_tp_region(x, self.tp_group)
        bias = None if self.skip_bias_add else self.bias
        y = F.linear(x, self.weight, bias)
        if self.gather_output:
            y = gather_from_tp_region(y, self.tp_group)
        return (y, self.bias) if self.skip_bias_add else y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features} ({self.out_per_rank}/rank), "
            f"bias={self.bias is not None}, gather_output={self.gather_output}"
        )


class RowParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by rows (input features); one all-reduce in forward.

    The bias is replicated and added once, after the reduce, so it is not summed TP times.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        tp_group=None,
        init_method: InitMethod | None = None,
        dtype=None,
        device=None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.tp_group = tp_group
        self.in_per_rank = divide(in_features, group_size(tp_group), "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, dtype=dtype, device=device))
        set_tensor_parallel_attributes(self.weight, True, 1)
        _init_partitioned_weight(self.weight, (out_features, in_features), 1, init_method or normal_init(), tp_group)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
            set_tensor_parallel_attributes(self.bias, False, None)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor):
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp_group)
        y = reduce_from_tp_region(F.linear(x, self.weight), self.tp_group)
        if self.skip_bias_add:
            return y, self.bias
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
            gather_output=False,
            tp_group=tp_group,
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


def scaled_init(std: float, num_layers: int) -> InitMethod:
    """GPT-2's init for projections that write into the residual stream."""
    return normal_init(std / math.sqrt(2.0 * max(num_layers, 1)))
