"""A keyed pseudo-random bijection of ``[0, n)`` evaluated lazily, for any batch of positions.

The sampler's epoch order and the held-out split are permutations of the corpus. Materialising
one (``torch.randperm(n)``) costs 8 bytes per sample on every rank: 80 MB for 10^7 samples, before
any copy. A Feistel network is a bijection of ``[0, 4^h)`` by construction whatever its round
function; cycle-walking (apply it again while the value is ``>= n``) restricts it to ``[0, n)``,
and since ``4^h < 4n`` a position needs fewer than 4 rounds of walking on average. So position
``p`` of the order is computed on demand in O(1) memory, vectorised over a batch with numpy.
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["KeyedPermutation", "derive_key"]

ROUNDS = 6
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def derive_key(*parts: object) -> int:
    """A 64-bit key from any printable parts (``derive_key("epoch", seed, 3)``): unrelated inputs give
    unrelated keys, unlike ``seed + epoch`` where seed 10 epoch 1 equals seed 11 epoch 0."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _splitmix64(state: int) -> tuple[int, int]:
    state = (state + _GOLDEN) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)


class KeyedPermutation:
    """``perm(positions)``: the values at ``positions`` of a fixed pseudo-random order of ``[0, n)``.

    Deterministic in ``(n, key)`` on every machine (integer arithmetic only); a different ``n``
    gives an unrelated order.
    """

    def __init__(self, n: int, key: int):
        if n < 1:
            raise ValueError(f"permutation of {n} elements")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2
        self._half = np.uint64(self.half)
        self._mask = np.uint64((1 << self.half) - 1)
        state, keys = key & _MASK64, []
        for _ in range(ROUNDS):
            state, round_key = _splitmix64(state)
            keys.append(np.uint64(round_key))
        self._keys = keys

    def _round(self, right: np.ndarray, key: np.uint64) -> np.ndarray:
        z = (right ^ key) * _MIX1
        z ^= z >> np.uint64(31)
        z *= _MIX2
        z ^= z >> np.uint64(29)
        return z & self._mask

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ self._round(right, key)
        return (left << self._half) | right

    def __call__(self, positions) -> np.ndarray:
        """int64 array of the same shape as ``positions`` (each in ``[0, n)``)."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.n):
            raise IndexError(f"position outside [0, {self.n})")
        flat = positions.reshape(-1).astype(np.uint64)
        out = self._encrypt(flat)
        limit = np.uint64(self.n)
        outside = np.flatnonzero(out >= limit)
        while outside.size:  # cycle-walking: terminates because x itself lies inside [0, n)
            out[outside] = self._encrypt(out[outside])
            outside = outside[out[outside] >= limit]
        return out.astype(np.int64).reshape(positions.shape)
