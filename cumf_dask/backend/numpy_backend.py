"""NumPy backend: MO-ALS on the CPU with batched BLAS, no Python loop per row.

Hermitian: rows are grouped by degree into buckets of one padded length L (geometric steps
of 1.25, so padding wastes at most a quarter); each bucket gathers its fixed-factor rows
into a ``(rows, L, f)`` array, scales them by s (implicit weights, :mod:`.objective`; not
for explicit data), and one batched ``matmul`` gives every ``G_u^T G_u`` and ``G_u^T t_u``.
Padding uses an appended zero row of the fixed factor and t = 0, so it adds nothing.

Solve: Cholesky in float64 (``numpy.linalg.cholesky``, one LAPACK call per stack of 256
systems), then forward and back substitution vectorized over the stack. It reads only the
lower triangles, so nothing is mirrored; measured 2x faster than ``numpy.linalg.solve``
on f = 50 (benchmarks/RESULTS.md). CG: :func:`~.objective.batched_cg` on the same float64
stacks (mirrored from their lower triangles), warm-started from x0. ``update`` with the CG
solver does not form A for rows of up to ``MATRIX_FREE * f`` ratings (as implicit's CPU CG):
each bucket's gathered rows G give ``A p = G0 p + G^T (s^2 * (G p)) + reg p`` in O(L f) per
row and step instead of the Gram's O(L f^2), the same iterates in exact arithmetic. Longer
rows form A (one float32 batched GEMM beats many matrix-vector products over a long G). The
GPU forms A in registers for every row, where the Gram is the fast part (mo_als.cu).

BLAS threads: inside Dask workers the engine pins BLAS to one thread (threadpoolctl); many
small products are much slower with threads on small CPUs (DESIGN pitfalls).
"""

from __future__ import annotations

import threading
from contextlib import suppress
from typing import Any

import numpy as np

from ..blocks import Block
from ..errors import ClusterClosing
from .base import Backend
from .objective import UpdateSpec, as_spec, batched_cg, gram_weights, regularization, symmetric

_BUCKET_BYTES = 64 << 20  # gathered (rows, L, f) float32 per batched product
_SOLVE_CHUNK = 256  # systems per batched Cholesky: small enough to stay in cache

#: Set while a local cluster whose workers are threads of this process is closed after an
#: error or a Ctrl-C (engine.cluster.cluster_client): the loops below stop at their next
#: chunk, where closing used to wait for every running task to finish (16 s at 10M ratings).
STOPPING = threading.Event()


def _go_on() -> None:
    if STOPPING.is_set():
        raise ClusterClosing("the local cluster is being closed")
MATRIX_FREE = 2  # CG without forming A for rows of up to this many times f ratings


def degree_buckets(degrees: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """[(L, rows)]: non-empty rows grouped by padded length L (exact up to 8, then x1.25)."""
    nonempty = np.flatnonzero(degrees > 0)
    if nonempty.size == 0:
        return []
    d = degrees[nonempty].astype(np.float64)
    level = np.where(d <= 8, d, 8 + np.ceil(np.log(d / 8) / np.log(1.25)))
    padded = np.where(d <= 8, d, np.ceil(8 * 1.25 ** (level - 8)))
    padded = np.maximum(padded, d).astype(np.int64)
    order = np.argsort(padded, kind="stable")
    padded, rows = padded[order], nonempty[order]
    cuts = np.flatnonzero(np.diff(padded)) + 1
    return [
        (int(padded[lo]), rows[lo:hi])
        for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, rows.size], strict=True)
    ]


class NumpyBackend(Backend):
    """CPU backend."""

    name = "numpy"
    xp = np

    def hermitian(
        self, block: Block, fixed: Any, spec: UpdateSpec | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        f = fixed.shape[1]
        A = np.zeros((block.n_rows, f, f), np.float32)
        B = np.zeros((block.n_rows, f), np.float32)
        if block.nnz == 0:
            return A, B
        padded_fixed = np.vstack([np.asarray(fixed, np.float32), np.zeros((1, f), np.float32)])
        zero_row = padded_fixed.shape[0] - 1
        indptr = np.asarray(block.indptr)
        indices = np.append(np.asarray(block.indices), zero_row)
        scale, value = gram_weights(np, np.asarray(block.values, np.float32), spec)
        values = np.append(np.asarray(value, np.float32), np.float32(0))
        scales = None if scale is None else np.append(scale, np.float32(0))
        pad_entry = indices.size - 1
        degrees = np.diff(indptr)
        for length, rows in degree_buckets(degrees):
            step = max(1, _BUCKET_BYTES // (length * f * 4))
            offsets = np.arange(length)
            for lo in range(0, rows.size, step):
                _go_on()
                chunk = rows[lo : lo + step]
                entry = indptr[chunk, None] + offsets[None, :]
                entry = np.where(offsets[None, :] < degrees[chunk, None], entry, pad_entry)
                G = padded_fixed[indices[entry]]  # (rows, L, f)
                if scales is not None:
                    G *= scales[entry][:, :, None]
                Gt = G.transpose(0, 2, 1)
                A[chunk] = np.matmul(Gt, G)
                B[chunk] = np.matmul(Gt, values[entry][:, :, None])[:, :, 0]
        return A, B

    def gram(self, fixed: Any) -> np.ndarray:
        fixed = np.asarray(fixed, np.float64)
        return fixed.T @ fixed

    def solve(
        self,
        A: Any,
        B: Any,
        counts: Any,
        lam: float | UpdateSpec,
        *,
        gram0: Any = None,
        x0: Any = None,
        packed: bool = False,
    ) -> np.ndarray:
        spec = as_spec(lam)
        if spec.implicit and gram0 is None:
            raise ValueError("the implicit model's solve needs gram0 (the fixed factor's Gram)")
        counts = np.asarray(counts)
        reg = regularization(np, counts, spec)
        f = B.shape[-1]
        X = np.zeros(B.shape, np.float32)
        rows = np.flatnonzero(counts > 0)
        diag = np.arange(f)
        G0 = None if gram0 is None else np.asarray(gram0, np.float64)
        for lo in range(0, rows.size, _SOLVE_CHUNK):
            _go_on()
            chunk = rows[lo : lo + _SOLVE_CHUNK]
            M = np.asarray(self.unpack(A[chunk], f) if packed else A[chunk], np.float64)
            if spec.cg:
                M = symmetric(np, M)
            if G0 is not None:
                M += G0 if spec.cg else np.tril(G0)
            M[:, diag, diag] += reg[chunk][:, None]
            b = np.asarray(B[chunk], np.float64)
            if spec.cg:
                start = np.zeros(b.shape) if x0 is None else np.asarray(x0[chunk], np.float64)
                X[chunk] = batched_cg(np, M, b, start, spec.cg_steps)
            else:
                X[chunk] = cholesky_solve(M, b)
        return X

    def update(
        self,
        block: Block,
        fixed: Any,
        counts: Any,
        lam: float | UpdateSpec,
        *,
        gram0: Any = None,
        x0: Any = None,
    ) -> np.ndarray:
        spec = as_spec(lam)
        if not spec.cg:
            return super().update(block, fixed, counts, spec, gram0=gram0, x0=x0)
        if spec.implicit and gram0 is None:
            gram0 = self.gram(fixed)
        return self._update_cg(block, fixed, np.asarray(counts), spec, gram0, x0)

    def _update_cg(
        self, block: Block, fixed: Any, counts: np.ndarray, spec: UpdateSpec, gram0: Any, x0: Any
    ) -> np.ndarray:
        """Matrix-free CG per degree bucket (module doc); rows without counts get zeros."""
        f = fixed.shape[1]
        X = np.zeros((block.n_rows, f), np.float32)
        if block.nnz == 0:
            return X
        G0 = None if gram0 is None else np.asarray(gram0, np.float64)
        reg = regularization(np, counts, spec)
        padded_fixed = np.vstack([np.asarray(fixed, np.float32), np.zeros((1, f), np.float32)])
        indptr = np.asarray(block.indptr)
        indices = np.append(np.asarray(block.indices), padded_fixed.shape[0] - 1)
        scale, value = gram_weights(np, np.asarray(block.values, np.float32), spec)
        scale = np.ones(block.nnz, np.float32) if scale is None else scale
        scale, value = np.append(scale, np.float32(0)), np.append(value, np.float32(0))
        pad_entry = indices.size - 1
        degrees = np.where(counts > 0, np.diff(indptr), 0)
        start = np.zeros((block.n_rows, f)) if x0 is None else np.asarray(x0, np.float64)
        diag = np.arange(f)
        for length, rows in degree_buckets(degrees):
            formed = length > MATRIX_FREE * f
            step = max(1, _BUCKET_BYTES // (length * f * (4 if formed else 8)))
            offsets = np.arange(length)
            for lo in range(0, rows.size, step):
                _go_on()
                chunk = rows[lo : lo + step]
                entry = indptr[chunk, None] + offsets[None, :]
                entry = np.where(offsets[None, :] < degrees[chunk, None], entry, pad_entry)
                G = padded_fixed[indices[entry]] * scale[entry][:, :, None]  # (rows, L, f)
                Gt = G.transpose(0, 2, 1)
                b = np.matmul(Gt, value[entry][:, :, None])[:, :, 0].astype(np.float64)
                r = reg[chunk]
                if formed:
                    M = np.matmul(Gt, G).astype(np.float64)
                    M[:, diag, diag] += r[:, None]
                    op: Any = M if G0 is None else M + G0
                else:
                    op = _free_product(G.astype(np.float64), r, G0)
                X[chunk] = batched_cg(np, op, b, start[chunk], spec.cg_steps)
        return X


def _free_product(G: np.ndarray, reg: np.ndarray, G0: np.ndarray | None) -> Any:
    """p -> (G0 + G^T G + reg I) p for a stack, without forming G^T G (G: scaled rows)."""
    Gt = G.transpose(0, 2, 1)

    def product(p: np.ndarray) -> np.ndarray:
        out = np.matmul(Gt, np.matmul(G, p[:, :, None]))[:, :, 0] + reg[:, None] * p
        return out if G0 is None else out + p @ G0

    return product


def cholesky_solve(M: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Solve M x = b for a stack of SPD matrices, reading only their lower triangles.

    LAPACK's Cholesky per matrix (float64: faster than float32's here, and exact enough),
    then the two triangular substitutions vectorized over the stack, one column at a time.
    A system that is not positive definite (a regularization too small for the rounding of
    its Hermitian) gets a NaN solution, as the GPU's Cholesky gives: the task's finite check
    turns it into the fit's NumericalError, which names the row and the fix.
    """
    try:
        L = np.linalg.cholesky(M)
    except np.linalg.LinAlgError:
        L = np.full_like(M, np.nan)
        for r in range(len(M)):
            with suppress(np.linalg.LinAlgError):
                L[r] = np.linalg.cholesky(M[r])
    y = b.copy()
    f = M.shape[-1]
    for j in range(f):
        if j:
            y[:, j] -= np.einsum("rk,rk->r", L[:, j, :j], y[:, :j])
        y[:, j] /= L[:, j, j]
    for j in range(f - 1, -1, -1):
        if j < f - 1:
            y[:, j] -= np.einsum("rk,rk->r", L[:, j + 1 :, j], y[:, j + 1 :])
        y[:, j] /= L[:, j, j]
    return y
