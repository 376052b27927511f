"""Pure task functions run on the workers; the graph builders submit them by name.

Each takes host or device arrays and a backend *name* (backends are per-process objects,
looked up on the worker), so tasks are small to ship and read well in the dashboard.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from contextlib import suppress
from typing import Any

import numpy as np

from ..backend import get_backend
from ..backend.objective import UpdateSpec
from ..blocks import Block, select_columns
from ..checkpoint import store_chunks, store_rows
from ..data.assemble import read_bands
from ..data.shards import HOST_BANDS
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
    host: bool = False,
    after: Any = None,
) -> Block:
    """R^(ij) from the store (its training or held-out ratings), read on `threads` threads,
    made CSR where the backend computes (the GPU builds it on the device), or with `host`
    in the backend's host memory (pinned on a GPU: each use copies it over at full speed).
    `after`: the task this read waits for (bounds a streamed plan's read-ahead); unused."""
    be = get_backend(backend)
    target = HOST_BANDS if host else be.decode_target()
    bands = read_bands(store, orient, rows, cols, split, threads, target)
    return be.host_block(bands, threads) if host else be.block_from_bands(bands, threads)


def staged_copy(block: Block, backend: str, after: Any = None) -> Block:
    """A host-tier block copied to the device for one use, while the worker computes on the
    block before it (:meth:`~cumf_dask.backend.base.Backend.staged_copy`). `after`: the
    task this copy waits for (one block computing, one arriving); unused."""
    return get_backend(backend).staged_copy(block)


def prepare(f: int, backend: str, spec: UpdateSpec | None = None) -> None:
    """Compile the backend's kernels for f factors in a thread of the worker's own, while
    the blocks load; no worker thread waits for it (tasks that use the kernels wait for
    the compile lock). A failure here is ignored: the task that uses the kernels then
    compiles them itself and reports it."""
    be = get_backend(backend)

    def compile_quietly() -> None:
        with suppress(Exception):
            be.prepare(f, spec)

    threading.Thread(target=compile_quietly, name="cumf-prepare", daemon=True).start()


def load_counts(store: RatingsStore, orient: str, rows: tuple, backend: str) -> Any:
    """Total rating counts of rows [lo, hi) (for weighted lambda)."""
    return get_backend(backend).asarray(store.counts(orient, rows))


def initial_factor(
    n_rows: int,
    f: int,
    seed: int,
    lo: int,
    hi: int,
    backend: str,
    stream: int = 1,
    scale: float | None = None,
    host: bool = False,
) -> Any:
    """Rows [lo, hi) of the seeded initial factor, on the device (`host`: in host memory)."""
    return to_backend(init_factor(n_rows, f, seed, lo, hi, stream, scale), backend, host)


FactorRows = tuple[int, int, list[tuple[int, int, Any]]]  # (lo, hi, pieces (start, stop, array))


def rows_from(
    rows: FactorRows, backend: str, on_device: bool = False, after: Any = None
) -> Any:
    """Rows [lo, hi) of a factor from the pieces that cover them, in the memory the pieces
    are in (a view when one piece holds them all). The tasks that use a factor's rows call
    this themselves (see :meth:`~.halfstep.SUALSEngine.fixed_on`); a gather task of its own
    calls it for rows shared by several tasks, or (`on_device`) for a part of a factor in
    host memory copied to the device once for all the tasks of a half-step that use it.
    `after`: the task this waits for (bounds the parts on the device); unused."""
    lo, hi, pieces = rows
    be = get_backend(backend)
    parts = []
    for start, stop, arr in sorted(pieces, key=lambda t: t[0]):
        a, b = max(lo, start), min(hi, stop)
        if a < b:
            parts.append(arr[a - start : b - start])
    if on_device:
        return be.concatenate(parts, on_device=True)
    if len(parts) == 1:
        return parts[0]
    return be.concatenate(parts)


class NonFiniteFactor(ArithmeticError):
    """Raised on a worker when a solved factor piece holds NaN or inf: `count` values, the
    first in global row `row` (the fit says which iteration and factor)."""

    def __init__(self, count: int, row: int):
        super().__init__(count, row)
        self.count, self.row = count, row


def check_finite(row0s: list[int], backend: str, checked: bool, *pieces: Any) -> float:
    """Raise NonFiniteFactor if a piece (its first row in `row0s`) holds NaN or inf; else
    the time (``time.time()``) they were found finite, when their computation had ended.

    One task per worker and half-step, after that worker's pieces: the solving tasks return
    without waiting for the GPU, and this task waits for them (without blocking the worker's
    other thread on the GPU: :meth:`~cumf_dask.backend.base.Backend.finite`). `checked`:
    the pieces are in host memory and were checked on the device by the tasks that copied
    them out (:func:`_kept`), which had waited for the GPU: not scanned again on the host.
    """
    if not checked:
        _raise_if_non_finite(get_backend(backend), pieces, row0s)
    return time.time()


def _raise_if_non_finite(be: Any, pieces: Sequence[Any], row0s: Sequence[int]) -> None:
    good = be.finite(pieces)
    if good.all():
        return
    first = int(np.argmin(good))
    bad = ~be.xp.isfinite(pieces[first])
    raise NonFiniteFactor(int(bad.sum()), row0s[first] + int(be.xp.argmax(bad.any(axis=1))))


def _kept(be: Any, X: Any, host: bool, row0: int) -> Any:
    """Solved rows as the half-step keeps them: on the device, or (`host`) checked for NaN
    and inf here, on the device, then copied to host memory (``plan.factors: host``).
    `row0`: their first row in the factor (named by a NonFiniteFactor)."""
    if not host:
        return X
    _raise_if_non_finite(be, [X], [row0])
    return be.host_copy(X)


def update(
    block: Block,
    fixed: FactorRows,
    counts: Any,
    spec: UpdateSpec,
    backend: str,
    gram0: Any = None,
    x0: Any = None,
    host: bool = False,
    row0: int = 0,
) -> Any:
    """p == 1: hermitian and solve of one batch against the whole fixed factor (its rows as
    :func:`rows_from` takes them).

    gram0: the fixed factor's Gram (implicit); x0: the batch's previous rows (CG); host,
    row0: the solved rows (from row `row0` of the factor) go to host memory (:func:`_kept`).
    """
    be = get_backend(backend)
    try:
        with out_of_memory_as(_on(block), _SMALLER):
            fixed = be.prepare_fixed(rows_from(fixed, backend))
            X = be.update(block, fixed, counts, spec, gram0=gram0, x0=x0)
    finally:
        be.retire(block)  # also after a failure: kernels may be queued on it
    return _kept(be, X, host, row0)


def hermitian_sums(
    block: Block,
    fixed: FactorRows,
    backend: str,
    spec: UpdateSpec | None = None,
    into: tuple[Any, Any] | None = None,
    after: Any = None,
) -> tuple[Any, Any]:
    """p > 1: the partial (packed A, B) of one block against its part of the fixed factor
    (rows as :func:`rows_from` takes them), without G0 or the regularization (both are
    added once, in the solve). `into`: what this task returned for the worker's
    previous part of the same rows; this block's partial is added to it in place (each
    worker sends one sum of its parts to the reduction), and it is returned. `after`: the
    tasks this waits for (bounds the batches a worker's sums are held for); unused."""
    be = get_backend(backend)
    try:
        with out_of_memory_as(_on(block), _SMALLER):
            fixed = be.prepare_fixed(rows_from(fixed, backend))
            return be.packed_hermitian(block, fixed, spec, into)
    finally:
        be.retire(block)  # also after a failure: kernels may be queued on it


def rows_of(pair: tuple[Any, Any], lo: int, hi: int) -> tuple[Any, Any]:
    """Rows [lo, hi) of a partial (packed A, B): one reduce-scatter slice."""
    return pair[0][lo:hi], pair[1][lo:hi]


def finished(_: Any) -> None:
    """Nothing: a small result that exists once its input does (a streamed read waits for
    it instead of for the input, so the input is not held longer)."""


def gram(piece: Any, backend: str) -> Any:
    """The Gram piece^T piece (f, f) of one piece of a factor."""
    return get_backend(backend).gram(piece)


def sum_grams(*grams: Any) -> Any:
    """The factor's Gram from its pieces' (one task: W small f x f matrices)."""
    total = grams[0].copy()
    for g in grams[1:]:
        total += g
    return total


def sum_partials(*partials: tuple[Any, Any]) -> tuple[Any, Any]:
    """Elementwise sum of packed partial (A, B) pairs (a reduction step)."""
    A = partials[0][0].copy()
    B = partials[0][1].copy()
    for a, b in partials[1:]:
        A += a
        B += b
    return A, B


def reduce_solve(
    counts: Any,
    spec: UpdateSpec,
    backend: str,
    gram0: Any,
    x0: Any,
    host: bool,
    row0: int,
    *partials: tuple[Any, Any],
) -> Any:
    """Final reduction of one slice, then the solve from the packed sums as they are (G0
    and the regularization added here); `host`, `row0`: as for :func:`update`."""
    be = get_backend(backend)
    # one input (reduction "one", or one holder): solve reads it as it is, no copy
    A, B = partials[0] if len(partials) == 1 else sum_partials(*partials)
    X = be.solve(A, B, counts, spec, gram0=gram0, x0=x0, packed=True)
    return _kept(be, X, host, row0)


def block_squared_error(
    block: Block, x_rows: Any, fixed: FactorRows, backend: str
) -> tuple[float, int]:
    """Sum of squared residuals over a block's ratings, and their count (`fixed`: the rows of
    the other factor, as :func:`rows_from` takes them)."""
    fixed = rows_from(fixed, backend)
    return get_backend(backend).block_squared_error(block, x_rows, fixed), block.nnz


def block_implicit_loss(
    block: Block, x_rows: Any, fixed: FactorRows, spec: UpdateSpec, backend: str
) -> tuple[float, float]:
    """The stored entries' part of the implicit objective over a block, and their total
    confidence: (sum c (p - s)^2 - s^2, sum c), s = x_u . y_v (see ``Backend.implicit_terms``);
    `fixed` as for :func:`block_squared_error`."""
    be = get_backend(backend)
    if block.nnz == 0:
        return 0.0, 0.0
    block = be.block_to_device(block)  # a host-tier block (or factor) comes as host arrays
    rows = be.row_of(block)
    x_rows, fixed = be.asarray(x_rows), be.asarray(rows_from(fixed, backend))
    return be.implicit_terms(x_rows, fixed, rows, block.indices, block.values, spec)


def factor_terms(piece: Any, counts: Any, spec: UpdateSpec, backend: str) -> tuple[Any, float]:
    """(Gram, sum_u reg_u |x_u|^2 / lam) of one piece of a factor (counts: its rows' n_u)."""
    be = get_backend(backend)
    piece = be.asarray(piece)  # a factor in host memory is copied over
    norms = (piece * piece).sum(axis=1)
    weights = counts.astype(norms.dtype) if spec.weighted else 1
    return np.asarray(be.to_host(be.gram(piece)), np.float64), float((norms * weights).sum())


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


def rank_batch(
    theta: Any,
    x_rows: np.ndarray,
    k: int,
    seen: Block | tuple[RatingsStore, np.ndarray] | None,
    items: np.ndarray | None,
    backend: str,
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k rows of `theta` by x . theta for each row of `x_rows`, skipping `seen` (a block
    over the same rows and all columns, or (store, rows): those rows' training ratings, read
    here), among the candidate rows `items` when given (ids of the full theta come back).
    Places left when fewer than k candidates remain: id -1, score -inf."""
    be = get_backend(backend)
    if isinstance(seen, tuple):
        store, rows = seen
        seen = store.rows_block(rows)
    T = be.asarray(theta)
    if items is not None:
        T = T[be.asarray(items)]
        if seen is not None:
            seen = select_columns(seen, items)
    if seen is not None:
        seen = be.block_to_device(seen)
    idx, score = be.topk(be.asarray(x_rows), T, k, seen)
    idx, score = be.to_host(idx).astype(np.int64), be.to_host(score)
    if items is not None:
        idx = np.asarray(items, np.int64)[idx]
    idx[~np.isfinite(score)] = -1
    return idx, score


def fold_in_batch(
    theta: Any, gram0: Any, block: Block, spec: UpdateSpec, backend: str
) -> np.ndarray:
    """Factors of the rows of `block` (interactions of users not in the fit) against the
    fitted `theta`, solved exactly (Cholesky), without changing the model."""
    be = get_backend(backend)
    counts = np.diff(np.asarray(block.indptr))
    X = be.update(be.block_to_device(block), be.asarray(theta), be.asarray(counts), spec,
                  gram0=be.asarray(gram0))  # fmt: skip
    return be.to_host(X)


def filler(nbytes: int, backend: str) -> Any:
    """An array of `nbytes` in the backend's memory (for timing transfers)."""
    return get_backend(backend).xp.ones(max(1, nbytes // 4), dtype=np.float32)


def nbytes(arr: Any) -> int:
    return int(arr.nbytes)


def release_memory(backend: str) -> None:
    """Give the worker's cached memory back (:meth:`Backend.release_memory`)."""
    get_backend(backend).release_memory()


def to_host(arr: Any, backend: str) -> np.ndarray:
    return get_backend(backend).to_host(arr)


def own_host_copy(arr: Any, backend: str) -> np.ndarray:
    """`arr` in host memory as an array of its own: a piece already in host memory (NumPy,
    or a GPU fit's factor kept on the host) is copied, since ``to_host`` hands it back as it
    is and the process that receives it may be the worker's own (workers as threads)."""
    host = get_backend(backend).to_host(arr)
    return host.copy() if host is arr else host


def store_piece(
    piece: Any, lo: int, where: str, name: str, chunks: list[tuple[int, int, int]],
    backend: str, threads: int,
) -> dict[int, int]:  # fmt: skip
    """Write the chunks (index, first row, end row of the factor) that lie within `piece`
    (the factor's rows lo..) into array `name` at `where`, each copied to host memory as it
    is written, `threads` at a time; {chunk index: CRC-32}. The copies wait for the work
    queued when the task starts (the piece's, and perhaps the next iteration's), not behind
    each chunk for the iterations queued meanwhile."""
    be = get_backend(backend)
    ready = be.queued()
    return store_chunks(where, name, lambda a, b: be.to_host(piece[a - lo : b - lo], ready),
                        chunks, threads)  # fmt: skip


def store_parts(where: str, name: str, index: int, first: int, *parts: np.ndarray) -> dict:
    """Write chunk `index` (rows first..) of array `name` at `where` from the rows that
    several pieces hold (:func:`rows_on_host`, in order); {index: CRC-32}."""
    return {index: store_rows(where, name, first, np.concatenate(parts))}


def rows_on_host(piece: Any, a: int, b: int, backend: str) -> np.ndarray:
    """Rows a..b of a piece, in host memory."""
    return get_backend(backend).to_host(piece[a:b])


def to_backend(array: np.ndarray, backend: str, host: bool = False) -> Any:
    """A host array in the backend's memory (`host`: kept in host memory, pinned on a GPU)."""
    be = get_backend(backend)
    return be.host_copy(array) if host else be.asarray(array)

