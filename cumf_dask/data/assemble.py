"""Assembling a block R^(ij) from a store's bands: read in parallel, checked, cut, made CSR.

A block of rows [r0, r1) and columns [c0, c1) overlaps bands r0 // t_major ... and in each
the tiles c0 // t_minor ...; a band's share of those tiles is one contiguous range of its
arrays (``ptr``). All of them are decoded at once on the thread pool (:mod:`.shards`). Then,
one band per thread, each band's ratings are checked, cut to the exact range, and put in CSR
order straight into their slice of the block's arrays. Bands hold consecutive rows, so a
stable sort by row inside each band is all the ordering there is; inside a tile the ratings
are already sorted by row, so it merges a few sorted runs (measured as fast as a counting
placement) and keeps each row's tiles, and so its columns, in order.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ..blocks import Block
from ..errors import StoreError
from . import shards

if TYPE_CHECKING:
    from .store import Orientation, RatingsStore, Split


def read_block(
    store: RatingsStore,
    orient: Orientation,
    rows: tuple[int, int],
    cols: tuple[int, int],
    split: Split = "train",
    threads: int = 1,
) -> Block:
    """The block of R (R^T for "col") with rows [r0, r1) and columns [c0, c1), as CSR."""
    from .store import band_group

    (r0, r1), (c0, c1) = rows, cols
    t_major, t_minor = store.tile_size(orient)
    n_major, n_minor = store.shape(orient)
    group = band_group(orient, split)
    bands = list(range(r0 // t_major, min(-(-r1 // t_major), math.ceil(n_major / t_major))))
    t0, t1 = c0 // t_minor, max(c0 // t_minor, -(-c1 // t_minor))
    ptrs = store.read([(f"{group}/{b}/ptr", 0, None) for b in bands], threads)
    n_tiles = math.ceil(n_minor / t_minor)
    requests = []
    for b, ptr in zip(bands, ptrs, strict=True):
        if ptr.shape != (n_tiles + 1,) or ptr[0] != 0 or np.any(np.diff(ptr) < 0):
            raise StoreError(f"{store.url}: damaged store: '{group}/{b}/ptr' is not a tile pointer")
        lo, hi = int(ptr[t0]), int(ptr[t1])
        requests += [(f"{group}/{b}/{name}", lo, hi) for name in ("major", "minor", "val")]
    arrays = store.read(requests, threads)
    parts: list[Any] = [None] * len(bands)

    def cut(i: int) -> None:
        b = bands[i]
        major, minor, val = arrays[3 * i : 3 * i + 3]
        store._check_band(f"{group}/{b}", b, orient, major, minor, val)
        first = b * t_major  # the band's first row
        a, z = max(r0, first), min(r1, first + t_major, n_major)
        if a > first or z < min(first + t_major, n_major) or c0 % t_minor or (
            c1 % t_minor and c1 < n_minor
        ):
            keep = (major >= a - first) & (major < z - first) & (minor >= c0) & (minor < c1)
            if not keep.all():
                major, minor, val = major[keep], minor[keep], val[keep]
        parts[i] = (a - r0, z - a, major - np.int32(a - first), minor, val)

    shards.run([lambda i=i: cut(i) for i in range(len(bands))], threads)
    starts = np.cumsum([0] + [part[2].size for part in parts])
    indptr = np.zeros(r1 - r0 + 1, np.int64)
    indices = np.empty(int(starts[-1]), np.int32)
    values = np.empty(int(starts[-1]), np.float32)

    def place(i: int) -> None:
        row, n_rows, major, minor, val = parts[i]
        lo, hi = int(starts[i]), int(starts[i + 1])
        order = np.argsort(major, kind="stable")
        np.subtract(minor[order], c0, out=indices[lo:hi], casting="unsafe")
        np.take(val, order, out=values[lo:hi])
        ends = indptr[row + 1 : row + n_rows + 1]
        np.cumsum(np.bincount(major, minlength=n_rows), out=ends)
        ends += lo

    shards.run([lambda i=i: place(i) for i in range(len(parts))], threads)
    return Block(indptr, indices, values, r0, c0, r1 - r0, c1 - c0)
