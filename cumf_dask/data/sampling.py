"""Sampling primitives of the planted model: keyed permutations, the Zipf law, pair keys.

Pure functions of their arguments (no random state), so every generator task computes
exactly the same values; :mod:`.planted` builds the model's degrees and pairs from them.

* :class:`Permutation`: a keyed pseudo-random bijection of [0, size) and its inverse
  (popularity ranks <-> rows or columns).
* :func:`zipf_cdf` / :func:`zipf_cdf_inv`: the continuous Zipf mass below a rank, and back.
* :class:`KeyCoder`: (local row, column) as one sortable int64 in band order, with
  :func:`sorted_unique` and :func:`sorted_isin` on such keys.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .hashing import splitmix


class Permutation:
    """A keyed pseudo-random bijection of [0, size): multiply/xorshift rounds on the next
    power of two, cycle-walked into range; ``inverse`` undoes it."""

    def __init__(self, size: int, key: int):
        self.size = size
        bits = max(2, (size - 1).bit_length())
        self.mask = np.uint64((1 << bits) - 1)
        self.shift = np.uint64((bits + 1) // 2)  # one xorshift by >= bits/2 undoes itself
        words = [splitmix(key + i) for i in range(4)]
        self.mul = [np.uint64(words[0] | 1), np.uint64(words[1] | 1)]
        self.add = [np.uint64(words[2]), np.uint64(words[3])]
        self.inv = [np.uint64(pow(int(a), -1, 1 << 64)) for a in self.mul]

    def _forward(self, x: np.ndarray) -> np.ndarray:
        for a, b in zip(self.mul, self.add, strict=True):
            x = (x * a + b) & self.mask
            x ^= x >> self.shift
        return x

    def _backward(self, x: np.ndarray) -> np.ndarray:
        for a, b in zip(self.inv[::-1], self.add[::-1], strict=True):
            x = x ^ (x >> self.shift)
            x = ((x - b) * a) & self.mask
        return x

    def _walk(self, step: Callable[[np.ndarray], np.ndarray], x: Any) -> np.ndarray:
        x = step(np.asarray(x, dtype=np.int64).astype(np.uint64))
        todo = np.flatnonzero(x >= self.size)
        while todo.size:
            y = step(x[todo])
            x[todo] = y
            todo = todo[y >= self.size]
        return x.astype(np.int64)

    def __call__(self, x: Any) -> np.ndarray:
        return self._walk(self._forward, x)

    def inverse(self, y: Any) -> np.ndarray:
        return self._walk(self._backward, y)


def zipf_cdf(x: Any, skew: float) -> Any:
    """Phi(x) = integral of (t + 1)^-skew over [0, x]: the continuous Zipf mass below rank x."""
    if abs(1.0 - skew) < 1e-12:
        return np.log1p(x)
    return np.expm1((1.0 - skew) * np.log1p(x)) / (1.0 - skew)


def zipf_cdf_inv(y: np.ndarray, skew: float) -> np.ndarray:
    """The rank x where Phi(x) = y: the inverse of :func:`zipf_cdf`."""
    if abs(1.0 - skew) < 1e-12:
        return np.expm1(y)
    return np.expm1(np.log1p((1.0 - skew) * y) / (1.0 - skew))


def sorted_unique(x: np.ndarray) -> np.ndarray:
    """The distinct values of `x`, sorted."""
    x = np.sort(x)
    return x[np.concatenate(([True], x[1:] != x[:-1]))] if x.size else x


def sorted_isin(ref: np.ndarray, x: np.ndarray) -> np.ndarray:
    """np.isin(x, ref) for a sorted `ref`."""
    if not ref.size:
        return np.zeros(x.shape, bool)
    return ref[np.minimum(np.searchsorted(ref, x), ref.size - 1)] == x


class KeyCoder:
    """(local row, column) <-> one int64 whose order is (column tile, row, column): the
    order of a band in the store, so sorting keys both deduplicates and orders a band."""

    def __init__(self, n_rows: int, tile_cols: int):
        self.tile_cols = tile_cols
        self.col_bits = (tile_cols - 1).bit_length()
        self.row_bits = (max(n_rows, 1) - 1).bit_length()

    def encode(self, local: np.ndarray, col: np.ndarray) -> np.ndarray:
        tile, within = np.divmod(col, self.tile_cols)
        return (((tile << self.row_bits) | local) << self.col_bits) | within

    def local(self, keys: np.ndarray) -> np.ndarray:
        return (keys >> self.col_bits) & ((1 << self.row_bits) - 1)

    def decode(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        within = keys & ((1 << self.col_bits) - 1)
        return self.local(keys), (keys >> (self.col_bits + self.row_bits)) * self.tile_cols + within
