"""Pure task functions run on the workers; the graph builders submit them by name.

Each takes host or device arrays and a backend *name* (backends are per-process objects,
looked up on the worker), so tasks are small to ship and read well in the dashboard.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import get_backend
from ..blocks import Block
from ..data.assemble import read_bands
from ..data.store import Orientation, RatingsStore, Split
from ..errors import out_of_memory_as
from ..factors import init_factor

_SMALLER = "set plan.q higher (smaller batches) or plan.memory_budget lower, then run again"


def _on(block: Block) -> str:
    return f"on a block of {block.n_rows:,} rows and {block.nnz:,} ratings"


def load_block(
    store: RatingsStore,
    orient: Orientation,
    split: Split,
    rows: tuple[int, int],
    cols: tuple[int, int],
    backend: str,
    threads: int = 1,
) -> Block:
    """R^(ij) from the store (its training or held-out ratings), read on `threads` threads,
    made CSR where the backend computes (the GPU builds it on the device)."""
    bands = read_bands(store, orient, rows, cols, split, threads)
    return get_backend(backend).block_from_bands(bands, threads)


def prepare(f: int, backend: str) -> None:
    """Compile the backend's kernels for f factors (runs while the blocks load)."""
    get_backend(backend).prepare(f)


def load_counts(store: RatingsStore, orient: str, rows: tuple, backend: str) -> Any:
    """Total rating counts of rows [lo, hi) (for weighted lambda)."""
    return get_backend(backend).asarray(store.counts(orient, rows))


def initial_factor(n_rows: int, f: int, seed: int, lo: int, hi: int, backend: str) -> Any:
    return get_backend(backend).asarray(init_factor(n_rows, f, seed, lo, hi))


def assemble(lo: int, hi: int, backend: str, pieces: list[tuple[int, int, Any]]) -> Any:
    """Rows [lo, hi) of a factor from pieces (start, stop, array) that cover them."""
    be = get_backend(backend)
    parts = []
    for start, stop, arr in sorted(pieces, key=lambda t: t[0]):
        a, b = max(lo, start), min(hi, stop)
        if a < b:
            parts.append(arr[a - start : b - start])
    if len(parts) == 1:
        return parts[0]
    return be.xp.concatenate(parts, axis=0)


class NonFiniteFactor(ArithmeticError):
    """Raised on a worker when a solved factor piece holds NaN or inf: `count` values, the
    first in global row `row` (the fit says which iteration and factor)."""

    def __init__(self, count: int, row: int):
        super().__init__(count, row)
        self.count, self.row = count, row


def finite(piece: Any, row0: int, backend: str) -> Any:
    """`piece` (rows row0, row0 + 1, ...) if every value is finite, else NonFiniteFactor.

    Checked in the task that solved the piece: no extra task or round trip per iteration.
    """
    xp = get_backend(backend).xp
    good = xp.isfinite(piece)
    if bool(good.all()):
        return piece
    bad_rows = ~good.all(axis=1)
    raise NonFiniteFactor(int((~good).sum()), row0 + int(xp.argmax(bad_rows)))


def update(block: Block, fixed: Any, counts: Any, lam: float, backend: str) -> Any:
    """p == 1: hermitian and solve of one batch, on the worker holding the whole fixed factor."""
    be = get_backend(backend)
    with out_of_memory_as(_on(block), _SMALLER):
        return finite(be.update(block, be.prepare_fixed(fixed), counts, lam), block.row0, backend)


def hermitian_slices(
    block: Block, fixed: Any, slices: list[tuple[int, int]], backend: str
) -> list[tuple[Any, Any]]:
    """p > 1: partial (packed A, B) of one block, cut into the reduce-scatter slices."""
    be = get_backend(backend)
    with out_of_memory_as(_on(block), _SMALLER):
        A, B = be.hermitian(block, be.prepare_fixed(fixed))
        packed = be.pack(A)
    return [(packed[a:b], B[a:b]) for a, b in slices]


def sum_partials(*partials: tuple[Any, Any]) -> tuple[Any, Any]:
    """Elementwise sum of packed partial (A, B) pairs (a reduction step)."""
    A = partials[0][0].copy()
    B = partials[0][1].copy()
    for a, b in partials[1:]:
        A += a
        B += b
    return A, B


def reduce_solve(
    counts: Any, lam: float, f: int, backend: str, row0: int, *partials: tuple[Any, Any]
) -> Any:
    """Final reduction of one slice (its first row is row0), then the weighted-lambda solve."""
    be = get_backend(backend)
    A, B = sum_partials(*partials)
    return finite(be.solve(be.unpack(A, f), B, counts, lam), row0, backend)


def block_squared_error(block: Block, x_rows: Any, fixed: Any, backend: str) -> tuple[float, int]:
    """Sum of squared residuals over a block's ratings, and their count."""
    return get_backend(backend).block_squared_error(block, x_rows, fixed), block.nnz


def recommend_batch(
    x_rows: np.ndarray,
    theta: Any,
    users: np.ndarray,
    k: int,
    store: RatingsStore | None,
    backend: str,
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k items of a batch of users, skipping their training items when `store` is given."""
    be = get_backend(backend)
    seen = be.block_to_device(store.rows_block(users)) if store is not None else None
    idx, score = be.topk(be.asarray(x_rows), be.asarray(theta), k, seen)
    return be.to_host(idx), be.to_host(score)


def memory_capacity(backend: str) -> int | None:
    """What the worker's device may allocate (None on the CPU: its memory limit says it)."""
    return get_backend(backend).memory_capacity()


def filler(nbytes: int, backend: str) -> Any:
    """An array of `nbytes` in the backend's memory (for timing transfers)."""
    return get_backend(backend).xp.ones(max(1, nbytes // 4), dtype=np.float32)


def nbytes(arr: Any) -> int:
    return int(arr.nbytes)


def to_host(arr: Any, backend: str) -> np.ndarray:
    return get_backend(backend).to_host(arr)


def to_backend(array: np.ndarray, backend: str) -> Any:
    return get_backend(backend).asarray(array)

