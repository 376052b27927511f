"""The CSR block: R restricted to a range of rows and columns, the unit the backends compute on.

It sits below both the store (which reads blocks) and the backends (which compute on them),
so neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Block:
    """R restricted to rows [row0, row0+n_rows) and columns [col0, col0+n_cols), as CSR.

    In the "col" orientation the roles swap: rows are items and columns are users.
    ``indices`` are local (column - col0), int32; ``indptr`` is int64. Arrays are NumPy or
    CuPy, whichever the backend moved them to.
    """

    indptr: Any
    indices: Any
    values: Any
    row0: int
    col0: int
    n_rows: int
    n_cols: int

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


def select_columns(block: Block, columns: np.ndarray) -> Block:
    """The entries of `block` in the given columns, renumbered 0..len(columns)-1 in that
    order (host arrays; `columns` holds distinct local column indices)."""
    position = np.full(block.n_cols, -1, np.int64)
    position[np.asarray(columns, np.int64)] = np.arange(len(columns))
    new = position[np.asarray(block.indices, np.int64)]
    keep = new >= 0
    kept = np.concatenate(([0], np.cumsum(keep)))
    indptr = kept[np.asarray(block.indptr)].astype(np.int64)
    return Block(indptr, new[keep].astype(np.int32), np.asarray(block.values)[keep], block.row0,
                 0, block.n_rows, len(columns))  # fmt: skip
