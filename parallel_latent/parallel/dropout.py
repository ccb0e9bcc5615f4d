"""Dropout whose mask is a pure function of (seed, step, layer, global element index).

A stateful generator cannot give a TP=N run the masks of a TP=1 run: each rank would have to skip
exactly the random numbers of the other ranks' slices. A counter-based hash can: every element
computes its own keep/drop decision from its coordinates in the *full* (unsplit, un-sharded over
DP) tensor. What makes TP=N the same model as TP=1 with dropout on falls out of it:

* inside a TP region each rank draws exactly its slice of the TP=1 mask;
* in replicated regions every rank of a TP group draws the same mask (same coordinates);
* DP ranks hold different samples, so their masks differ (the batch coordinate is global);
* activation recomputation and exact resume need no RNG state beyond ``(seed, step)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .compile import CompiledWithFallback
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


# Index tensors of the last few dropout shapes, per model: a training step reuses the same few
# (shape, offsets) at every site, so building them once is enough (the sample offset is added
# in the kernel, so accumulated micro-batches share them); evaluation does not drop.
INDEX_CACHE_SIZE = 64


def _as_int64(value: int) -> int:
    """The int64 whose bits are the uint64 ``value`` (taken modulo 2**64)."""
    value &= _MASK64
    return value - (1 << 64) if value >= (1 << 63) else value


def step_key(seed: int, step: int) -> int:
    """The uint64 key of ``(seed, step)`` that every layer's key is derived from."""
    return _splitmix64(_splitmix64(seed) ^ step)


class DropoutRNG:
    """The dropout key shared by every dropout site of one model.

    ``step`` is the optimizer step; ``sample_offset`` is the position of this micro-batch's first
    sample in the step's global batch (``(micro_step * dp_size + dp_rank) * micro_batch``), so DP
    ranks and accumulated micro-batches draw different masks, and a run equals one with the same
    global batch cut differently (DP=2, or two accumulated micro-batches, = one doubled batch).
    Assign them between a backward and the next forward only: a compiled graph may read the keys
    again in its backward (recomputing a mask instead of saving it).

    Nothing of a step reaches the device as new data, and nothing a compiled graph reads changes
    as a Python value: the key of ``(seed, step)`` and the sample offset live in one int64 device
    tensor made once and updated in place (a ``fill_`` when ``step``, ``seed`` or
    ``sample_offset`` is assigned a new value), which a compiled kernel reads, deriving each layer's
    key from it on the device. The host keeps the integers too: ``state_dict``, reading ``step``
    (no device read), and the eager path, which hands them to the hash as scalar arguments (nothing
    to recompile there, no device work for the key). The index tensors (built on the device with
    ``arange``) are cached per shape and TP offsets, counted from the micro-batch's first sample.
    ``compile_devices`` name the device types where the mask and its application are compiled into
    one kernel (CUDA: eager, that is ~70 kernels over the activation per site; on CPU compiling
    costs minutes and runs no faster).
    """

    def __init__(self, seed: int = 0, step: int = 0, sample_offset: int = 0, compile_devices=("cuda",)):
        self.compile_devices = tuple(compile_devices)
        self._next_layer_id = 0
        self._kernels: dict[str, CompiledWithFallback] = {}  # by name (KERNELS), compiled on first use
        self._indices: dict = {}
        self._device_keys = torch.zeros(2, dtype=torch.int64)  # [step key, sample offset]
        self._seed, self._step, self._sample_offset = seed, step, sample_offset
        self._device_keys[0].fill_(_as_int64(step_key(seed, step)))
        self._device_keys[1].fill_(sample_offset)

    @property
    def seed(self) -> int:
        return self._seed

    @seed.setter
    def seed(self, seed: int) -> None:
        self._set_step_key(seed, self._step)

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, step: int) -> None:
        self._set_step_key(self._seed, step)

    @property
    def sample_offset(self) -> int:
        return self._sample_offset

    @sample_offset.setter
    def sample_offset(self, offset: int) -> None:
        if offset != self._sample_offset:  # set every micro-step, mostly to a new value
            self._sample_offset = offset
            self._device_keys[1].fill_(offset)

    def _set_step_key(self, seed: int, step: int) -> None:
        if (seed, step) != (self._seed, self._step):  # set every micro-step, mostly to the same value
            self._seed, self._step = seed, step
            self._device_keys[0].fill_(_as_int64(step_key(seed, step)))

    def device_keys(self, device: torch.device) -> torch.Tensor:
        """The int64 tensor [step key, sample offset] on ``device`` (moved there once, at the first
        use after the model moved)."""
        if self._device_keys.device != device:
            self._device_keys = self._device_keys.to(device)
        return self._device_keys

    def kernel(self, device: torch.device, name: str = "mask") -> Callable | None:
        """``KERNELS[name]`` (:func:`dropout_core`, or :func:`gelu_dropout_core`) where it is
        compiled: inside a compiled region (whose compilation fuses it) or on the
        ``compile_devices`` (compiled once per model, falling back to eager with one warning if
        compiling fails). None elsewhere: the eager path, where the keys stay host integers
        (scalar arguments, no device work to derive them)."""
        if torch.compiler.is_compiling():
            return KERNELS[name]
        if device.type not in self.compile_devices:
            return None
        if name not in self._kernels:
            self._kernels[name] = CompiledWithFallback(KERNELS[name], f"the dropout {name} kernel")
        return self._kernels[name]

    def indices(self, shape, offsets, full_shape, device) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():  # in a graph the aranges fuse into the kernel: no cache
            return index_tensors(shape, offsets, full_shape, device)
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

    def __repr__(self) -> str:
        return f"DropoutRNG(seed={self.seed}, step={self.step}, sample_offset={self.sample_offset})"


def layer_key(key: tuple[int, int, int]) -> tuple[int, int, int]:
    """(low and high 32 bits of the row key, the int32 column key) of ``(seed, step, layer)`` in
    plain integers: the host reference of :func:`device_layer_key`."""
    seed, step, layer_id = key
    k_row = _splitmix64(step_key(seed, step) ^ layer_id)
    return k_row & _MASK32, k_row >> 32, _as_int32(_splitmix64(k_row) & _MASK32)


def _splitmix64_int64(x: torch.Tensor) -> torch.Tensor:
    """:func:`_splitmix64` on uint64 bits held in int64: sums and products wrap modulo 2**64 as
    the uint64 ones do; right shifts are arithmetic, so masking keeps only the shifted-in bits."""
    x = x + _as_int64(0x9E3779B97F4A7C15)
    x = (x ^ ((x >> 30) & (_MASK64 >> 30))) * _as_int64(0xBF58476D1CE4E5B9)
    x = (x ^ ((x >> 27) & (_MASK64 >> 27))) * _as_int64(0x94D049BB133111EB)
    return x ^ ((x >> 31) & (_MASK64 >> 31))


def device_layer_key(step_key: torch.Tensor, layer_id: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:func:`layer_key` on the device, from the int64 step key and layer id (0-dim tensors):
    (k_low, k_high) int64 in [0, 2**32), k_col int32."""
    k_row = _splitmix64_int64(step_key ^ layer_id)
    k_col = _splitmix64_int64(k_row) & _MASK32
    k_col = torch.where(k_col >= (1 << 31), k_col - (1 << 32), k_col).to(torch.int32)
    return k_row & _MASK32, (k_row >> 32) & _MASK32, k_col


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
    tensor; each element then hashes (column ^ row hash) with two int32 rounds. The layer's key is
    derived on the device, as in training.
    """
    seed, step, layer_id = key
    step_key_tensor = torch.tensor(_as_int64(step_key(seed, step)), device=device)
    layer_keys = device_layer_key(step_key_tensor, torch.tensor(_as_int64(layer_id), device=device))
    return keep_mask_core(*index_tensors(shape, offsets, full_shape, device), *layer_keys, drop_threshold(p))


def drop_threshold(p: float) -> int:
    """Drop iff the uint32 hash is below p * 2**32; as the int32 the comparison is made in."""
    return round(p * 2**32) + _INT32_MIN


def element_hash(row_index: torch.Tensor, columns: torch.Tensor, k_low, k_high, k_col) -> torch.Tensor:
    """The hash itself: index tensors and the layer's keys (integers, or 0-dim tensors of
    :func:`device_layer_key`) in, every element's uint32 hash out (as int32 bits)."""
    row_hash = _mix32_int64((row_index & _MASK32) ^ k_low)
    row_hash = _mix32_int64(row_hash ^ (row_index >> 32) ^ k_high)
    row_hash = torch.where(row_hash >= (1 << 31), row_hash - (1 << 32), row_hash).to(torch.int32)
    h = columns ^ row_hash  # broadcast: one fresh int32 tensor of the full shape
    scratch = torch.empty_like(h)
    _mix32_(h, scratch)
    h ^= k_col
    return _mix32_(h, scratch)


def keep_mask_core(
    row_index: torch.Tensor, columns: torch.Tensor, k_low, k_high, k_col, threshold: int
) -> torch.Tensor:
    """The keep-mask from :func:`element_hash`: a bool tensor."""
    # Compare as unsigned: flipping the sign bit maps uint32 order onto int32 order.
    return (element_hash(row_index, columns, k_low, k_high, k_col) ^ _INT32_MIN) >= threshold


def dropout_core(
    x: torch.Tensor,
    row_index: torch.Tensor,
    columns: torch.Tensor,
    keys: torch.Tensor,
    layer_id: torch.Tensor,
    batch_stride: int,
    threshold: int,
    scale: float,
) -> torch.Tensor:
    """``x`` with the dropped elements zeroed and the kept ones times ``scale``: the mask and its
    application, one kernel when compiled. ``row_index`` counts rows from this micro-batch's first
    sample; ``keys`` is :class:`DropoutRNG`'s [step key, sample offset] tensor, so the offset
    (times ``batch_stride``, the rows of one sample) and the layer's key are added in the kernel.
    The scale is a Python float, so the product is computed at float32 (or better) and rounded
    once to x's dtype (a bf16 scale of 1/0.9 would be 1.109375: 0.16% low at every site)."""
    row_index = row_index + keys[1] * batch_stride
    keep = keep_mask_core(row_index, columns, *device_layer_key(keys[0], layer_id), threshold)
    return apply_mask(x, keep, scale)


def gelu_dropout_core(x, row_index, columns, keys, layer_id, batch_stride: int, threshold: int, scale: float):
    """:func:`dropout_core` of the exact GELU of ``x``: the activation, the mask and its application
    in one kernel when compiled (eagerly, the same operations as ``F.gelu`` then dropout), and in
    backward one kernel for the three, from the activation's input."""
    return dropout_core(F.gelu(x), row_index, columns, keys, layer_id, batch_stride, threshold, scale)


KERNELS = {"mask": dropout_core, "gelu": gelu_dropout_core}


def apply_mask(x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.where(keep, x * scale, 0.0)


class _KeyedSite(nn.Module):
    """A site whose random numbers are keyed on global coordinates (see the module).

    ``partition_dim`` names the dimension that is split over ``tp_group`` (the slice of this rank
    starts at ``tp_rank * local_size``); ``None`` means the activation is replicated over the group.
    Dimension 0 is the batch, offset by ``rng.sample_offset``."""

    def __init__(self, rng: DropoutRNG | None, partition_dim: int | None, tp_group) -> None:
        super().__init__()
        self.rng = rng
        self.layer_id = rng.new_layer_id() if rng is not None else -1
        self.partition_dim = partition_dim
        self.tp_group = tp_group
        if partition_dim is not None:  # where this rank's slice starts, in units of its size
            self.slice_index, self.slices = group_rank(tp_group), group_size(tp_group)

    def _coordinates(self, x: torch.Tensor) -> tuple:
        """The index tensors of this site's random numbers for ``x``, counted from the micro-batch's
        first sample, and the rows of one sample in the full tensor (what the sample offset is scaled
        by). Only shapes and this rank's place in its group enter: the same every step, so a
        compiled region neither breaks nor recompiles here."""
        shape = tuple(x.shape)
        offsets = [0] * x.dim()
        full_shape = list(shape)
        if self.partition_dim is not None:
            dim = self.partition_dim % x.dim()
            offsets[dim] = self.slice_index * shape[dim]
            full_shape[dim] = self.slices * shape[dim]
        # The batch dim is outermost, so its full extent never enters the index: any value works.
        row_index, columns = self.rng.indices(shape, tuple(offsets), tuple(full_shape), x.device)
        return row_index, columns, math.prod(full_shape[1:-1])


class ParallelDropout(_KeyedSite):
    """Dropout keyed on global coordinates (:class:`_KeyedSite`)."""

    def __init__(self, p: float, rng: DropoutRNG | None, *, partition_dim: int | None = None, tp_group=None):
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        if p > 0 and rng is None:
            raise ValueError("dropout > 0 needs a DropoutRNG")
        super().__init__(rng, partition_dim, tp_group)
        self.p = p
        # The id as a device tensor for the kernel (every block then shares one compiled graph); a
        # buffer so that it moves with the model, not persistent: checkpoints stay as they are.
        self.register_buffer("layer_index", torch.tensor(self.layer_id, dtype=torch.int64), persistent=False)
        self.threshold, self.scale = drop_threshold(p), 1.0 / (1.0 - p)

    def forward(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        """Dropout of ``x``, or with ``gelu`` of the exact GELU of ``x`` (one kernel with the mask
        where the mask is compiled)."""
        if not self.training or self.p == 0.0:
            return F.gelu(x) if gelu else x
        row_index, columns, batch_stride = self._coordinates(x)
        kernel, rng = self.rng.kernel(x.device, "gelu" if gelu else "mask"), self.rng
        if kernel is None:  # eager: the same hash, from the host's integers
            if rng.sample_offset:  # (one small add on the rows, where a micro-batch is not the first)
                row_index = row_index + rng.sample_offset * batch_stride
            keep = keep_mask_core(row_index, columns, *layer_key((rng.seed, rng.step, self.layer_id)), self.threshold)
            return apply_mask(F.gelu(x) if gelu else x, keep, self.scale)
        keys = rng.device_keys(x.device)
        return kernel(x, row_index, columns, keys, self.layer_index, batch_stride, self.threshold, self.scale)

    def extra_repr(self) -> str:
        return f"p={self.p}, layer_id={self.layer_id}, partition_dim={self.partition_dim}"


class ParallelGaussianNoise(_KeyedSite):
    """``x + std * n`` in training, ``n`` standard normal keyed on global coordinates
    (:class:`_KeyedSite`): Box-Muller from two hashes of each element's coordinates, so a TP=N run
    adds the very noise of a TP=1 run, and DP ranks and accumulated micro-batches their own. Its
    gradient is the identity. Eager (a few small kernels): it runs where the activation is small."""

    def __init__(self, std: float, rng: DropoutRNG, *, partition_dim: int | None = None, tp_group=None):
        if std < 0:
            raise ValueError(f"noise standard deviation must be >= 0, got {std}")
        super().__init__(rng, partition_dim, tp_group)
        self.std = std
        self.second_layer_id = rng.new_layer_id()  # the second uniform's key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.std == 0.0:
            return x
        row_index, columns, batch_stride = self._coordinates(x)
        rng = self.rng
        if rng.sample_offset:
            row_index = row_index + rng.sample_offset * batch_stride
        first, second = (
            _unit_interval(element_hash(row_index, columns, *layer_key((rng.seed, rng.step, layer_id))))
            for layer_id in (self.layer_id, self.second_layer_id)
        )
        normal = torch.sqrt(-2.0 * torch.log(first)) * torch.cos((2.0 * math.pi) * second)
        return x + (self.std * normal).to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"std={self.std}, layer_ids=({self.layer_id}, {self.second_layer_id}), partition_dim={self.partition_dim}"
        )


def _unit_interval(h: torch.Tensor) -> torch.Tensor:
    """uint32 hashes (held in int32 bits) as float64 in the open interval (0, 1)."""
    return ((h.to(torch.int64) & _MASK32).double() + 0.5) * 2.0**-32
