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

from dataclasses import dataclass, field

import torch
from torch import nn

from .utils import CompiledWithFallback, group_rank, group_size

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


# Index tensors of the last few dropout shapes, per model: a training step reuses the same few
# (shape, offsets) at every site, so building them once is enough; evaluation does not drop.
INDEX_CACHE_SIZE = 64


@dataclass
class DropoutRNG:
    """The dropout key shared by every dropout site of one model.

    ``step`` is the optimizer step; ``sample_offset`` is the position of this micro-batch's first
    sample in the step's global batch (``(micro_step * dp_size + dp_rank) * micro_batch``), so DP
    ranks and accumulated micro-batches draw different masks, and a run equals one with the same
    global batch cut differently (DP=2, or two accumulated micro-batches, = one doubled batch).

    Nothing of a step reaches the device as data: the key enters the kernel as integer arguments,
    and the index tensors (built on the device with ``arange``) are cached per shape and offsets.
    ``compile_devices`` name the device types where the mask and its application are compiled into
    one kernel (CUDA: eager, that is ~70 kernels over the activation per site; on CPU compiling
    costs minutes and runs no faster).
    """

    seed: int = 0
    step: int = 0
    sample_offset: int = 0
    compile_devices: tuple[str, ...] = ("cuda",)
    _next_layer_id: int = field(default=0, repr=False)
    _kernel: CompiledWithFallback | None = field(default=None, repr=False, compare=False)
    _indices: dict = field(default_factory=dict, repr=False, compare=False)

    def kernel(self, device: torch.device):
        """:func:`dropout_core`, compiled where ``compile_devices`` say (once per model, falling
        back to eager with one warning if compiling fails), else eager."""
        if device.type not in self.compile_devices or torch.compiler.is_compiling():
            return dropout_core  # (inside a compiled region the region's compilation fuses it)
        if self._kernel is None:
            self._kernel = CompiledWithFallback(dropout_core, "the dropout mask kernel")
        return self._kernel

    def indices(self, shape, offsets, full_shape, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (shape, offsets, full_shape, device)
        cached = self._indices.get(key)
        if cached is None:
            if len(self._indices) >= INDEX_CACHE_SIZE:
                self._indices.pop(next(iter(self._indices)))  # the oldest
            cached = self._indices[key] = index_tensors(shape, offsets, full_shape, device)
        return cached

    def new_layer_id(self) -> int:
        # Construction order is the same at every TP degree, so ids agree across runs.
        layer_id = self._next_layer_id
        self._next_layer_id += 1
        return layer_id

    def state_dict(self) -> dict:
        return {"seed": self.seed, "step": self.step, "sample_offset": self.sample_offset}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.step, self.sample_offset = state["seed"], state["step"], state["sample_offset"]


def layer_key(key: tuple[int, int, int]) -> tuple[int, int, int]:
    """(low and high 32 bits of the row key, the int32 column key) of ``(seed, step, layer)``: plain
    integers, computed on the host, handed to the kernel as scalars."""
    seed, step, layer_id = key
    k_row = _splitmix64(_splitmix64(_splitmix64(seed) ^ step) ^ layer_id)
    return k_row & _MASK32, k_row >> 32, _as_int32(_splitmix64(k_row) & _MASK32)


def index_tensors(shape, offsets, full_shape, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The global row index of every row [..., 1] (int64) and the global column index [H] (int32)
    of the block ``[offsets, offsets + shape)`` of a ``full_shape`` tensor."""
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
    return row_index, columns


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
    return keep_mask_core(*index_tensors(shape, offsets, full_shape, device), *layer_key(key), _threshold(p))


def _threshold(p: float) -> int:
    """Drop iff the uint32 hash is below p * 2**32; as the int32 the comparison is made in."""
    return round(p * 2**32) + _INT32_MIN


def keep_mask_core(
    row_index: torch.Tensor, columns: torch.Tensor, k_low: int, k_high: int, k_col: int, threshold: int
) -> torch.Tensor:
    """The hash itself: index tensors and integer keys in, a bool tensor out."""
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


def dropout_core(
    x: torch.Tensor,
    row_index: torch.Tensor,
    columns: torch.Tensor,
    k_low: int,
    k_high: int,
    k_col: int,
    threshold: int,
    scale: float,
) -> torch.Tensor:
    """``x`` with the dropped elements zeroed and the kept ones times ``scale``: the mask and its
    application, one kernel when compiled. The scale is a Python float, so the product is computed
    at float32 (or better) and rounded once to x's dtype (a bf16 scale of 1/0.9 would be 1.109375:
    0.16% low at every site)."""
    keep = keep_mask_core(row_index, columns, k_low, k_high, k_col, threshold)
    return torch.where(keep, x * scale, 0.0)


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
        if partition_dim is not None:  # where this rank's slice starts, in units of its size
            self.slice_index, self.slices = group_rank(tp_group), group_size(tp_group)
        self.threshold, self.scale = _threshold(p), 1.0 / (1.0 - p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        return self.rng.kernel(x.device)(x, *self._coordinates(x), self.threshold, self.scale)

    @torch.compiler.disable
    def _coordinates(self, x: torch.Tensor) -> tuple:
        """The index tensors and integer key of this site's mask for ``x``. Host arithmetic on the
        step and offsets; kept out of compiled regions (which would specialise on the step), so a
        compiled block sees them as inputs."""
        shape = tuple(x.shape)
        offsets = [0] * x.dim()
        full_shape = list(shape)
        offsets[0] = self.rng.sample_offset
        full_shape[0] = self.rng.sample_offset + shape[0]
        if self.partition_dim is not None:
            dim = self.partition_dim % x.dim()
            offsets[dim] = self.slice_index * shape[dim]
            full_shape[dim] = self.slices * shape[dim]
        # The batch dim is outermost, so its full extent never enters the index: any value works.
        row_index, columns = self.rng.indices(shape, tuple(offsets), tuple(full_shape), x.device)
        return (row_index, columns, *layer_key((self.rng.seed, self.rng.step, self.layer_id)))

    def extra_repr(self) -> str:
        return f"p={self.p}, layer_id={self.layer_id}, partition_dim={self.partition_dim}"
