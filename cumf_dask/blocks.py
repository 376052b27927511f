"""The CSR block: R restricted to a range of rows and columns, the unit the backends compute on,
and the decoded bands a block is assembled from.

It sits below both the store (which reads blocks) and the backends (which compute on them),
so neither imports the other. :func:`block_on_host` makes the CSR of decoded bands with
NumPy, one band per thread: each band's ratings are checked, cut to the exact range and put
in CSR order straight into their slice of the block's arrays. Bands hold consecutive rows,
so a stable sort by row inside each band is all the ordering there is (inside a tile the
ratings are already sorted by row: it merges a few sorted runs, and keeps each row's
columns in order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from .errors import PlanError, StoreError
from .threads import run

MAX_COLS = 2**31  # a block's local column indices are int32: it has fewer columns than this


def check_columns(n_cols: int) -> None:
    """Refuse a block of MAX_COLS columns or more, whose int32 column indices would wrap
    (the planner splits the columns into parts narrower than this)."""
    if n_cols >= MAX_COLS:
        raise PlanError(
            f"a block of {n_cols:,} columns is more than its int32 column indices hold "
            f"(2^31); plan more parts (plan.p)"
        )


@dataclass(frozen=True)
class Block:
    """R restricted to rows [row0, row0+n_rows) and columns [col0, col0+n_cols), as CSR.

    In the "col" orientation the roles swap: rows are items and columns are users.
    ``indices`` are local (column - col0), int32; ``indptr`` is int64. Arrays are NumPy or
    CuPy, whichever the backend moved them to. ``source``: the block this one is a copy of
    for one use (a host block staged on the device), with which what a backend finds from
    it once (a block's row sets) is kept.
    """

    indptr: Any
    indices: Any
    values: Any
    row0: int
    col0: int
    n_rows: int
    n_cols: int
    source: Block | None = field(default=None, compare=False, repr=False)

    @property
    def nnz(self) -> int:
        return int(self.values.shape[0])


def coo_to_block(
    row: np.ndarray,
    col: np.ndarray,
    val: np.ndarray,
    row0: int,
    col0: int,
    n_rows: int,
    n_cols: int,
) -> Block:
    """CSR from local COO (row in [0, n_rows)); entries of a row keep their column order."""
    check_columns(n_cols)
    order = np.argsort(row, kind="stable")
    counts = np.bincount(row, minlength=n_rows) if row.size else np.zeros(n_rows, np.int64)
    indptr = np.zeros(n_rows + 1, np.int64)
    np.cumsum(counts, out=indptr[1:])
    return Block(
        indptr=indptr,
        indices=np.ascontiguousarray(col[order], dtype=np.int32),
        values=np.ascontiguousarray(val[order], dtype=np.float32),
        row0=int(row0),
        col0=int(col0),
        n_rows=int(n_rows),
        n_cols=int(n_cols),
    )


def take_rows(block: Block, idx: np.ndarray) -> Block:
    """A block of the given rows of `block` (any order, repeats allowed), as CSR."""
    counts = np.diff(block.indptr)[idx]
    indptr = np.zeros(idx.size + 1, np.int64)
    np.cumsum(counts, out=indptr[1:])
    gather = np.repeat(block.indptr[idx] - indptr[:-1], counts) + np.arange(indptr[-1])
    return Block(
        indptr,
        block.indices[gather],
        block.values[gather],
        0,
        block.col0,
        int(idx.size),
        block.n_cols,
    )


@dataclass
class BandSlice:
    """One band's share of a block, as decoded: local rows, global columns, ratings."""

    band: int
    first: int  # the band's first row (global)
    major: np.ndarray  # int32 rows within the band
    minor: np.ndarray  # int32/int64 global columns
    val: np.ndarray  # float32


@dataclass
class Bands:
    """The decoded bands of a block with rows [r0, r1) and columns [c0, c1)."""

    where: str  # the store and band group, for messages
    rows: tuple[int, int]
    cols: tuple[int, int]
    band_rows: int  # rows per band (t_major)
    n_major: int  # rows of the orientation
    n_minor: int  # columns of the orientation
    sizes: Sequence[int]  # entries decoded of each band: its share of the block, or more
    decoded: Callable[[int], BandSlice]  # band i, once decoded (waits for it alone)
    # raises the truer error before a damaged one: the store was replaced since it was opened
    check_source: Callable[[], None] | None = None

    @property
    def count(self) -> int:
        return len(self.sizes)

    def slice(self, i: int) -> BandSlice:
        return self.decoded(i)

    def rows_of(self, s: BandSlice) -> tuple[int, int]:
        """The block rows [a, z) of a band (global)."""
        first_stop = min(s.first + self.band_rows, self.n_major)
        return max(self.rows[0], s.first), min(self.rows[1], first_stop)

    def damaged(self, s: BandSlice) -> StoreError:
        if self.check_source is not None:
            self.check_source()
        return StoreError(
            f"{self.where}/{s.band}: damaged store: entries out of range or not finite (a "
            "missing chunk?); rebuild the store (ingest or generate with --overwrite)"
        )


def block_on_host(bands: Bands, threads: int = 1) -> Block:
    """The CSR block of decoded bands, built with NumPy on up to `threads` threads.

    Each band, once decoded, is checked, cut to the block and sorted by row straight into
    its place in the block's arrays, which is known once the bands before it are cut. So a
    load holds the block and the few bands being placed or decoded ahead
    (:data:`~cumf_dask.data.shards.HOST_BANDS`), not every band beside the block. The
    arrays are made as long as all the bands' decoded entries (pages never written are
    not resident), and cut to the ratings kept at the end.
    """
    (r0, r1), (c0, c1) = bands.rows, bands.cols
    check_columns(c1 - c0)  # so the local columns below fit the int32 indices
    room = int(sum(bands.sizes))
    indices, values = np.empty(room, np.int32), np.empty(room, np.float32)
    indptr = np.zeros(r1 - r0 + 1, np.int64)
    starts: list[Future] = [Future() for _ in range(bands.count + 1)]
    starts[0].set_result(0)

    def build(i: int) -> None:
        if starts[i].done() and starts[i].exception() is not None:
            starts[i + 1].set_exception(starts[i].exception())  # a band before failed
            return
        try:
            row, n_rows, major, minor, val = _cut(bands, bands.slice(i), bands.sizes[i])
            lo = starts[i].result()
        except BaseException as error:
            starts[i + 1].set_exception(error)
            raise
        starts[i + 1].set_result(lo + val.size)
        order = np.argsort(major, kind="stable")
        np.subtract(minor[order], c0, out=indices[lo : lo + val.size], casting="same_kind")
        np.take(val, order, out=values[lo : lo + val.size])
        ends = indptr[row + 1 : row + n_rows + 1]  # its rows' ends, from its place
        np.cumsum(np.bincount(major, minlength=n_rows), out=ends)
        ends += lo

    run([partial(build, i) for i in range(bands.count)], threads, "assemble")
    size = starts[-1].result()
    return Block(indptr, _shrink(indices, size), _shrink(values, size), r0, c0, r1 - r0, c1 - c0)


def _cut(
    bands: Bands, s: BandSlice, size: int
) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray]:
    """A decoded band of `size` entries checked and cut to the block: (its first row in the
    block, its rows there, its ratings' rows among those, their columns (global), the
    ratings)."""
    (r0, _), (c0, c1) = bands.rows, bands.cols
    major, minor, val = s.major, s.minor, s.val
    a, z = bands.rows_of(s)
    rows_here = min(bands.band_rows, bands.n_major - s.first)
    if not major.size == minor.size == val.size == size:
        raise bands.damaged(s)
    if val.size and (
        major.min() < 0 or major.max() >= rows_here or minor.min() < 0
        or minor.max() >= bands.n_minor or not np.isfinite(val).all()
    ):  # fmt: skip
        raise bands.damaged(s)
    keep = (major >= a - s.first) & (major < z - s.first) & (minor >= c0) & (minor < c1)
    if not keep.all():
        major, minor, val = major[keep], minor[keep], val[keep]
    return a - r0, max(z - a, 0), major - np.int32(a - s.first), minor, val


def _shrink(array: np.ndarray, size: int) -> np.ndarray:
    """An array made longer than needed, cut to its first `size` entries in place (realloc:
    the rest goes back; no view of it is left, the jobs that wrote it are done)."""
    if size != len(array):
        array.resize(size, refcheck=False)
    return array


def select_columns(block: Block, columns: np.ndarray) -> Block:
    """The entries of `block` in the given columns, renumbered 0..len(columns)-1 in that
    order (host arrays; `columns` holds distinct local column indices)."""
    check_columns(len(columns))
    position = np.full(block.n_cols, -1, np.int64)
    position[np.asarray(columns, np.int64)] = np.arange(len(columns))
    new = position[np.asarray(block.indices, np.int64)]
    keep = new >= 0
    kept = np.concatenate(([0], np.cumsum(keep)))
    indptr = kept[np.asarray(block.indptr)].astype(np.int64)
    return Block(indptr, new[keep].astype(np.int32), np.asarray(block.values)[keep], block.row0,
                 0, block.n_rows, len(columns))  # fmt: skip
