"""Dropout whose mask is a pure function of (seed, step, layer, global element index).

A stateful generator cannot give a TP=N run the masks of a TP=1 run: each rank would have to skip
exactly the random numbers of the other ranks' slices. A counter-based hash can: every element
computes its own keep/drop decision from its coordinates in the *full* (unsplit, un-sharded over
DP) tensor. Consequences that the rules of DESIGN.md section 3 ask for fall out of it:

* inside a TP region each rank draws exactly its slice of the TP=1 mask;
* in replicated regions every rank of a TP group draws the same mask (same coordinates);
* DP ranks hold different samples, so their masks differ (the batch coordinate is global);
* activation recomputation and exact resume need no RNG state beyond ``(seed, step)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from .utils import group_rank, group_size

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _as_int32(value: int) -> int:
    """The int32 whose bits are the uint32 ``value``."""
    return value - (1 << 32) if value >= (1 << 31) else value


_M1, _M2 = _as_int32(0x7FEB352D), _as_int32(0x846CA68B)
_INT32_MIN = -(1 << 31)


def _mix32_int64(h: torch.Tensor) -> torch.Tensor:
    """lowbias32 on uint32 values held in int64 (products wrap; the mask keeps 32 bits)."""
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _MASK32
    h = h ^ (h >> 15)
    h = (h * 0x846CA68B) & _MASK32
    return h ^ (h >> 16)


def _mix32_(h: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """lowbias32 in place on int32 bits: products wrap, right shifts are made logical by masking.
    int32, in place and with one scratch buffer because this runs over every element dropout
    touches."""
    for shift, keep_bits, multiplier in ((16, 0xFFFF, _M1), (15, 0x1FFFF, _M2)):
        torch.bitwise_right_shift(h, shift, out=scratch)
        h ^= scratch.bitwise_and_(keep_bits)
        h *= multiplier
    torch.bitwise_right_shift(h, 16, out=scratch)
    h ^= scratch.bitwise_and_(0xFFFF)
    return h


@dataclass
class DropoutRNG:
    """The dropout key shared by every dropout site of one model.

    ``step`` is the optimizer step; ``sample_offset`` is the position of this micro-batch's first
    sample in the step's global batch (``(micro_step * dp_size + dp_rank) * micro_batch``), so DP
    ranks and accumulated micro-batches draw different masks, and a run equals one with the same
    global batch cut differently (DP=2, or two accumulated micro-batches, = one doubled batch).
    """

    seed: int = 0
    step: int = 0
    sample_offset: int = 0
    _next_layer_id: int = field(default=0, repr=False)
    _compiled_core: Callable | None = field(default=None, repr=False, compare=False)

    def mask_kernel(self, device: torch.device) -> Callable:
        """:func:`keep_mask_core`, compiled once per model on CUDA: eager, it is ~70 kernels over
        the full activation per dropout site; compiled, one. On CPU compiling costs minutes and
        runs no faster, so the CPU stays eager."""
        if device.type != "cuda":
            return keep_mask_core
        if self._compiled_core is None:
            self._compiled_core = torch.compile(keep_mask_core, fullgraph=True)
        return self._compiled_core

    def new_layer_id(self) -> int:
        # Construction order is the same at every TP degree, so ids agree across runs.
        layer_id = self._next_layer_id
        self._next_layer_id += 1
        return layer_id

    def state_dict(self) -> dict:
        return {"seed": self.seed, "step": self.step, "sample_offset": self.sample_offset}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.step, self.sample_offset = state["seed"], state["step"], state["sample_offset"]


def keep_mask(
    shape: tuple[int, ...],
    p: float,
    key: tuple[int, int, int],
    offsets: tuple[int, ...],
    full_shape: tuple[int, ...],
    device=None,
) -> torch.Tensor:
    """Boolean keep-mask for the block ``[offsets, offsets + shape)`` of a ``full_shape`` tensor.

    Rows (all leading dims) get a well-mixed 32-bit hash computed in int64 on the small row
    tensor; each element then hashes (column ^ row hash) with two int32 rounds.
    """
    return keep_mask_core(*mask_inputs(shape, key, offsets, full_shape, device), _threshold(p))


def _threshold(p: float) -> int:
    """Drop iff the uint32 hash is below p * 2**32; as the int32 the comparison is made in."""
    return round(p * 2**32) + _INT32_MIN


def mask_inputs(
    shape: tuple[int, ...], key: tuple[int, int, int], offsets: tuple[int, ...], full_shape: tuple[int, ...], device
) -> tuple[torch.Tensor, ...]:
    """The tensors :func:`keep_mask_core` hashes: the global row index of every row [..., 1], the
    global column index [H], and the key split into int64 halves and an int32 column key (0-d
    tensors, so a compiled core does not specialise on the step)."""
    seed, step, layer_id = key
    k_row = _splitmix64(_splitmix64(_splitmix64(seed) ^ step) ^ layer_id)
    k_col = _as_int32(_splitmix64(k_row) & _MASK32)
    lead = len(shape) - 1
    row_index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for dim in reversed(range(lead)):
        coord = torch.arange(offsets[dim], offsets[dim] + shape[dim], dtype=torch.int64, device=device)
        view = [1] * len(shape)
        view[dim] = shape[dim]
        row_index = row_index + coord.view(view) * stride
        stride *= full_shape[dim]
    row_index = row_index.reshape([*shape[:lead], 1])
    columns = torch.arange(offsets[-1], offsets[-1] + shape[-1], dtype=torch.int32, device=device)
    halves = torch.tensor([k_row & _MASK32, k_row >> 32], dtype=torch.int64, device=device)
    return row_index, columns, halves[0], halves[1], torch.tensor(k_col, dtype=torch.int32, device=device)


def keep_mask_core(
    row_index: torch.Tensor,
    columns: torch.Tensor,
    k_low: torch.Tensor,
    k_high: torch.Tensor,
    k_col: torch.Tensor,
    threshold: int,
) -> torch.Tensor:
    """The hash itself, tensors in and a bool tensor out: eager on CPU; compiled into one kernel
    on CUDA (same operations, same bits)."""
    row_hash = _mix32_int64((row_index & _MASK32) ^ k_low)
    row_hash = _mix32_int64(row_hash ^ (row_index >> 32) ^ k_high)
    row_hash = torch.where(row_hash >= (1 << 31), row_hash - (1 << 32), row_hash).to(torch.int32)
    h = columns ^ row_hash  # broadcast: one fresh int32 tensor of the full shape
    scratch = torch.empty_like(h)
    _mix32_(h, scratch)
    h ^= k_col
    _mix32_(h, scratch)
    # Compare as unsigned: flipping the sign bit maps uint32 order onto int32 order.
    return (h ^ _INT32_MIN) >= threshold


class ParallelDropout(nn.Module):
    """Dropout keyed on global coordinates.

    ``partition_dim`` names the dimension that is split over ``tp_group`` (the slice of this rank
    starts at ``tp_rank * local_size``); ``None`` means the activation is replicated over the group.
    Dimension 0 is the batch, offset by ``rng.sample_offset``.
    """

    def __init__(self, p: float, rng: DropoutRNG | None, *, partition_dim: int | None = None, tp_group=None):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        if p > 0 and rng is None:
            raise ValueError("dropout > 0 needs a DropoutRNG")
        self.p = p
        self.rng = rng
        self.layer_id = rng.new_layer_id() if rng is not None else -1
        self.partition_dim = partition_dim
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        shape = tuple(x.shape)
        offsets = [0] * x.dim()
        full_shape = list(shape)
        offsets[0] = self.rng.sample_offset
        full_shape[0] = self.rng.sample_offset + shape[0]
        if self.partition_dim is not None:
            dim = self.partition_dim % x.dim()
            offsets[dim] = group_rank(self.tp_group) * shape[dim]
            full_shape[dim] = group_size(self.tp_group) * shape[dim]
        # The batch dim is outermost, so its full extent never enters the index: any value works.
        key = (self.rng.seed, self.rng.step, self.layer_id)
        inputs = mask_inputs(shape, key, tuple(offsets), tuple(full_shape), x.device)
        mask = self.rng.mask_kernel(x.device)(*inputs, _threshold(self.p))
        # The scale is a Python float: the product is computed at float32 (or better) and rounded
        # once to x's dtype. (A bf16 scale of 1/0.9 would be 1.109375: 0.16% low at every site.)
        return x.masked_fill(~mask, 0.0).mul_(1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}, layer_id={self.layer_id}, partition_dim={self.partition_dim}"
