"""Sampling primitives of the planted model: keyed permutations, the Zipf law, pair keys.

Pure functions of their arguments (no random state), so every generator task computes
exactly the same values; :mod:`.planted` builds the model's degrees and pairs from them.
They compute with NumPy or CuPy: functions take the array module `xp` first (as in
:mod:`.hashing`), and methods compute where their argument arrays live.

* :class:`Permutation`: a keyed pseudo-random bijection of [0, size) and its inverse
  (popularity ranks <-> rows or columns).
* :func:`zipf_cdf` / :func:`zipf_cdf_inv`: the continuous Zipf mass below a rank, and back;
  :func:`zipf_mass`, the mass between two ranks where a difference of zipf_cdf would cancel.
* :class:`KeyCoder`: (local row, column) as one sortable int64 in band order, with
  :func:`sorted_unique` and :func:`sorted_isin` on such keys.
* :func:`repeat_rows`: the (row, position) of every entry of rows with given counts, and
  :func:`bin_counts`, the counts of values known to be in range.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .hashing import array_module, splitmix

#: a NumPy or CuPy array
Array = Any


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

    def _forward(self, x: Array) -> Array:
        for a, b in zip(self.mul, self.add, strict=True):
            x = (x * a + b) & self.mask
            x ^= x >> self.shift
        return x

    def _backward(self, x: Array) -> Array:
        for a, b in zip(self.inv[::-1], self.add[::-1], strict=True):
            x = x ^ (x >> self.shift)
            x = ((x - b) * a) & self.mask
        return x

    def _walk(self, step: Callable[[Array], Array], x: Any) -> Array:
        xp = array_module(x)
        x = step(xp.asarray(x, dtype=xp.int64).astype(xp.uint64))
        todo = xp.flatnonzero(x >= self.size)
        while todo.size:
            y = step(x[todo])
            x[todo] = y
            todo = todo[y >= self.size]
        return x.astype(xp.int64)

    def __call__(self, x: Any) -> Array:
        return self._walk(self._forward, x)

    def inverse(self, y: Any) -> Array:
        return self._walk(self._backward, y)


def zipf_cdf(xp: Any, x: Any, skew: float) -> Any:
    """Phi(x) = integral of (t + 1)^-skew over [0, x]: the continuous Zipf mass below rank x."""
    if abs(1.0 - skew) < 1e-12:
        return xp.log1p(x)
    return xp.expm1((1.0 - skew) * xp.log1p(x)) / (1.0 - skew)


def zipf_mass(xp: Any, lo: Any, x: Any, skew: float) -> Any:
    """Phi(x) - Phi(lo) divided by (lo + 1)^(1 - skew): the Zipf mass over [lo, x] relative
    to the law's level at lo, computed without cancellation (`lo` and `x` may be arrays).

    The difference of :func:`zipf_cdf` loses every digit where Phi has flattened out: for
    skew > 1 it tends to 1/(skew - 1), and at skew 10 Phi(60) and Phi(10^5) are one float.
    Here the masses (lo + 1)^(1 - skew) expm1((1 - skew) log((x + 1) / (lo + 1))) / (1 -
    skew) lose only a few ulps and stay positive for x > lo whatever the skew; the factor
    (lo + 1)^(1 - skew), which underflows at steep skews, is left out (ratios of masses from
    one `lo` cancel it).
    """
    t = xp.log1p((x - lo) / (lo + 1.0))  # log((x + 1) / (lo + 1)), exact for close x, lo
    if abs(1.0 - skew) < 1e-12:
        return t
    return xp.expm1((1.0 - skew) * t) / (1.0 - skew)


def zipf_cdf_inv(xp: Any, y: Array, skew: float) -> Array:
    """The rank x where Phi(x) = y: the inverse of :func:`zipf_cdf`."""
    if abs(1.0 - skew) < 1e-12:
        return xp.expm1(y)
    return xp.expm1(xp.log1p((1.0 - skew) * y) / (1.0 - skew))


def sorted_unique(xp: Any, x: Array) -> Array:
    """The distinct values of `x`, sorted."""
    x = xp.sort(x)
    return x[xp.concatenate((xp.ones(1, bool), x[1:] != x[:-1]))] if x.size else x


def sorted_isin(xp: Any, ref: Array, x: Array) -> Array:
    """np.isin(x, ref) for a sorted `ref`."""
    if not ref.size:
        return xp.zeros(x.shape, bool)
    return ref[xp.minimum(xp.searchsorted(ref, x), ref.size - 1)] == x


def bin_counts(xp: Any, x: Array, size: int) -> Array:
    """``bincount(x, minlength=size)`` for values known to lie in [0, size).

    CuPy's bincount checks its input first (an any and a max reduction: two device syncs,
    and CUB reductions compiled for each launch shape they meet, about 1.5 s a kernel): the
    generator's draw rounds, whose sizes differ in every band, spent 3 s of a band's 3.1 s
    compiling in its first bands on an H200. Scattered atomic adds need neither.
    """
    if xp is np:
        return np.bincount(x, minlength=size)
    out = xp.zeros(size, xp.int64)
    xp.add.at(out, x, 1)
    return out


def repeat_rows(xp: Any, counts: Array) -> tuple[Array, Array]:
    """(row, position) of the entries of rows with `counts` entries, row by row: the row is
    ``np.repeat(arange(len(counts)), counts)`` (CuPy's repeat takes no array of counts) and
    the position counts 0, 1, ... within each row."""
    ends = xp.cumsum(counts)
    total = int(ends[-1]) if ends.size else 0
    # an entry's row is the number of rows that end at or before it
    row = xp.cumsum(bin_counts(xp, ends, total + 1)[:total])
    return row, xp.arange(total) - (ends - counts)[row]


class KeyCoder:
    """(local row, column) <-> one int64 whose order is (column tile, row, column): the
    order of a band in the store, so sorting keys both deduplicates and orders a band.
    Works on NumPy and CuPy arrays alike."""

    def __init__(self, n_rows: int, tile_cols: int):
        self.tile_cols = tile_cols
        self.col_bits = (tile_cols - 1).bit_length()
        self.row_bits = (max(n_rows, 1) - 1).bit_length()

    def encode(self, local: Array, col: Array) -> Array:
        tile, within = divmod(col, self.tile_cols)
        return (((tile << self.row_bits) | local) << self.col_bits) | within

    def local(self, keys: Array) -> Array:
        return (keys >> self.col_bits) & ((1 << self.row_bits) - 1)

    def decode(self, keys: Array) -> tuple[Array, Array]:
        within = keys & ((1 << self.col_bits) - 1)
        return self.local(keys), (keys >> (self.col_bits + self.row_bits)) * self.tile_cols + within
