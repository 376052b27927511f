"""The backend interface: the only place the engine gets its math from.

The engine never imports numpy or cupy for math; it calls these methods. A backend owns
its array module (``xp``): NumPy on the CPU, CuPy on the GPU.

Shapes, for a block of ``r`` rows and a fixed factor of ``c`` rows and ``f`` columns:

* ``hermitian(block, fixed, spec) -> (A, B)``: ``A[u] = sum_v s_v^2 fixed[v] fixed[v]^T``
  over the ratings of row u in the block, ``(r, f, f)`` float32, valid in its **lower
  triangle** (diagonal included; the upper triangle is unspecified); ``B[u] = sum_v s_v t_v
  fixed[v]``, ``(r, f)``. Explicit: s = 1, t = r; implicit: the confidence weights of
  :mod:`.objective`. Partial results over column parts add up elementwise.
* ``gram(fixed) -> G``: ``fixed^T fixed``, ``(f, f)``; partial Grams of row pieces add up.
* ``solve(A, B, counts, spec, gram0=, x0=) -> X``: ``X[u] = (gram0 + A[u] + reg_u I)^-1 B[u]``
  with reg_u = lam * counts[u] (weighted) or lam: G0 and the regularization are added once,
  after any reduction. Rows with ``counts[u] == 0`` get a zero factor (never NaN). With the
  CG solver, ``spec.cg_steps`` steps from ``x0`` (zeros when None) replace the Cholesky.
  ``packed=True``: A as ``pack`` lays it out (the reductions' sums), read as it is.
* ``update(block, fixed, counts, spec, gram0=, x0=)``: hermitian then solve (p == 1).

``spec`` is an :class:`~.objective.UpdateSpec`, or a bare lambda for cuMF's explicit model
(weighted lambda, Cholesky); ``gram0`` is required by the implicit model's solve (the
engine computes it once per half-step) and computed from ``fixed`` by ``update`` when absent.
* ``pack``/``unpack``: the lower triangle as ``(r, f(f+1)/2)``: what moves between workers.
* ``prepare_fixed(fixed)``: the fixed factor as the kernels read it. With ``precision =
  "bfloat16"`` its values are rounded to bfloat16 (the factors are stored at half the
  bytes; products and sums stay float32); the default "float32" leaves it as it is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from ..blocks import Bands, Block, block_on_host
from ..checks import check_choice
from ..data.shards import HOST_BANDS, Target
from .objective import UpdateSpec, as_spec, confidence_of

PRECISIONS = ("float32", "bfloat16")  # storage of the fixed factor in the Gram build
MAX_F = 2032  # the GPU backend's most factors: F <= 2040, the Gram bins (float32: three of 1+
# rows) fit 48 KB of shared memory; here (no CuPy import) for the plan to check it
TILE = 8  # the GPU kernels' register tile edge
MAX_TENSOR_CORE_F = 111  # f up to this (F <= 112): the GPU's Gram on the tensor cores, where
# the factor is float32 and the ratings explicit (kernels/tensor_gram.cuh)


def padded_size(f: int) -> int:
    """F: the f factor columns plus the rating column, rounded up to whole tiles."""
    return (f + TILE) // TILE * TILE


def split_bytes(rows: int, f: int) -> int:
    """GPU bytes of the copy of `rows` fixed-factor rows the tensor-core Gram reads: each
    row's F values as two float16 halves (hi, lo)."""
    return rows * padded_size(f) * 4


class Backend(ABC):
    """Math for one device kind; subclasses override the hot paths."""

    name: str = "abstract"
    xp: Any = np

    def __init__(self, precision: str = "float32"):
        check_choice("precision", precision, PRECISIONS)
        self.precision = precision

    def prepare(self, f: int, spec: UpdateSpec | None = None) -> None:  # noqa: B027 - a hook
        """Get ready to compute with f factors and that objective and solver (the GPU
        compiles its kernels); no-op here."""

    def memory_capacity(self) -> int | None:
        """Bytes this process may allocate on its device; None where the worker's memory
        limit says it (the CPU)."""
        return None

    def prepare_fixed(self, fixed: Any) -> Any:
        """The fixed factor at this backend's storage precision (see module doc)."""
        if self.precision == "float32":
            return fixed
        return round_bfloat16(self.xp, fixed)

    def finite(self, pieces: Sequence[Any]) -> np.ndarray:
        """Whether each array holds only finite values, on the host."""
        return np.array([bool(self.xp.isfinite(p).all()) for p in pieces], bool)

    # ------------------------------------------------------------------ movement
    def asarray(self, x: Any, dtype: Any = None) -> Any:
        """Host (or device) array -> this backend's array."""
        return self.xp.asarray(x, dtype=dtype)

    def queued(self) -> Any:
        """A mark of the work queued on the device so far, for :meth:`to_host` (None here:
        NumPy's work is done once it returns)."""
        return None

    def to_host(self, x: Any, after: Any = None) -> np.ndarray:
        """This backend's array -> NumPy, once the work `after` marks (:meth:`queued`; None:
        all queued so far) is done."""
        return np.asarray(x)

    def host_copy(self, x: Any) -> np.ndarray:
        """`x` kept in host memory (``plan.factors: host``); here the host is the device."""
        return np.asarray(x)

    def release_memory(self) -> None:  # noqa: B027 - a hook
        """Give the memory kept for reuse back when a fit ends (the GPU's cached device and
        page-locked memory); no-op here."""

    def concatenate(self, parts: Sequence[Any], on_device: bool = False) -> Any:
        """Row pieces of a factor joined, in the memory they are in (`on_device`: on the
        device wherever they are; here the host is the device)."""
        return self.xp.concatenate(parts, axis=0)

    def decode_target(self) -> Target:
        """Where a block's bands are decoded for :meth:`block_from_bands` (the memory of
        the arrays it is handed): host memory here."""
        return HOST_BANDS

    def block_from_bands(self, bands: Bands, threads: int = 1) -> Block:
        """The CSR block of a store's decoded bands (:mod:`cumf_dask.data.assemble`), in
        this backend's memory."""
        return self.block_to_device(block_on_host(bands, threads))

    def host_block(self, bands: Bands, threads: int = 1) -> Block:
        """The CSR block of decoded bands in host memory (``plan.blocks: host``; on the
        NumPy backend the host is the device)."""
        return block_on_host(bands, threads)

    def block_to_device(self, block: Block) -> Block:
        return replace(
            block,
            indptr=self.asarray(block.indptr),
            indices=self.asarray(block.indices),
            values=self.asarray(block.values),
        )

    def staged_copy(self, block: Block) -> Block:
        """A host block copied to the device for one use, beside the kernels computing now
        (kernels that read it then :meth:`retire` it); here the host is the device."""
        return self.block_to_device(block)

    def retire(self, block: Block) -> None:  # noqa: B027 - a hook
        """The kernels queued so far are the last to read `block` (a :meth:`staged_copy`:
        its memory must not be reused before they end); no-op here."""

    # ------------------------------------------------------------------ ALS kernels
    @abstractmethod
    def hermitian(
        self, block: Block, fixed: Any, spec: UpdateSpec | None = None
    ) -> tuple[Any, Any]:
        """Partial (A, B) of the block's rows from the fixed factor's rows (see module doc)."""

    @abstractmethod
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
    ) -> Any:
        """X from the reduced (A, B), adding gram0 and reg_u I; zero rows where counts == 0.
        `packed`: A holds the lower triangles only (:meth:`pack`, as the reductions sum them),
        which the solve reads as they are (no f x f copy of every system). A and B are not
        changed."""

    def gram(self, fixed: Any) -> Any:
        """fixed^T fixed (f, f), accumulated in float32 (float64 on the host)."""
        return fixed.T @ fixed

    def update(
        self,
        block: Block,
        fixed: Any,
        counts: Any,
        lam: float | UpdateSpec,
        *,
        gram0: Any = None,
        x0: Any = None,
    ) -> Any:
        """hermitian then solve for a block that holds all of its rows' ratings (p == 1)."""
        spec = as_spec(lam)
        if spec.implicit and gram0 is None:
            gram0 = self.gram(fixed)
        A, B = self.hermitian(block, fixed, spec)
        return self.solve(A, B, counts, spec, gram0=gram0, x0=x0)

    # ------------------------------------------------------------------ packing
    def packed_hermitian(
        self, block: Block, fixed: Any, spec: UpdateSpec | None = None, into: Any = None
    ) -> tuple[Any, Any]:
        """The block's partial (A, B) with A's lower triangles packed (:meth:`pack`), as the
        reductions move them; `into`: such a pair (of the same rows) that they are added to
        in place, and which is returned."""
        A, B = self.hermitian(block, fixed, spec)
        packed = self.pack(A)
        del A  # before the sum: the packed copy fits in A's room
        if into is None:
            return packed, B
        sum_a, sum_b = into
        sum_a += packed
        sum_b += B
        return into

    def pack(self, A: Any) -> Any:
        """Lower triangle of each f x f matrix, row-major: (r, f(f+1)/2)."""
        f = A.shape[-1]
        rows, cols = np.tril_indices(f)
        return A[:, self.asarray(rows), self.asarray(cols)]

    def unpack(self, P: Any, f: int) -> Any:
        """Inverse of pack: a full symmetric (r, f, f)."""
        xp = self.xp
        rows, cols = np.tril_indices(f)
        A = xp.empty((P.shape[0], f, f), dtype=P.dtype)
        A[:, self.asarray(rows), self.asarray(cols)] = P
        A[:, self.asarray(cols), self.asarray(rows)] = P
        return A

    def row_of(self, block: Block) -> Any:
        """The block row of each rating (CSR expanded to COO rows), on the device."""
        xp = self.xp
        return xp.searchsorted(block.indptr, xp.arange(block.nnz), side="right") - 1

    # ------------------------------------------------------------------ using a model
    def predict(self, X: Any, Theta: Any, rows: Any, cols: Any) -> Any:
        """x_u . theta_v for each pair (rows[k], cols[k])."""
        out = self.xp.empty(rows.shape[0], dtype=self.xp.float32)
        step = 1 << 20
        for lo in range(0, rows.shape[0], step):
            hi = lo + step
            out[lo:hi] = (X[rows[lo:hi]] * Theta[cols[lo:hi]]).sum(axis=1)
        return out

    def squared_error(self, X: Any, Theta: Any, rows: Any, cols: Any, vals: Any) -> float:
        """Sum of (r_uv - x_u . theta_v)^2, as a Python float (float64 accumulation)."""
        if rows.shape[0] == 0:
            return 0.0
        diff = self.predict(X, Theta, rows, cols).astype(self.xp.float64) - vals
        return float((diff * diff).sum())

    def block_squared_error(self, block: Block, X: Any, fixed: Any) -> float:
        """Sum of (r_uv - x_u . theta_v)^2 over a block's ratings: X holds the block's rows,
        `fixed` its columns."""
        if block.nnz == 0:
            return 0.0
        return self.squared_error(X, fixed, self.row_of(block), block.indices, block.values)

    def implicit_terms(
        self, X: Any, Theta: Any, rows: Any, cols: Any, vals: Any, spec: UpdateSpec
    ) -> tuple[float, float]:
        """(sum c (p - s)^2 - s^2, sum c) over stored entries, s = x_u . theta_v: what the
        stored entries change in the implicit objective's sum over all pairs (which counts
        each pair as c = 1, p = 0), and their total confidence. Python floats."""
        xp = self.xp
        s = self.predict(X, Theta, rows, cols).astype(xp.float64)
        c = confidence_of(xp, xp.asarray(vals, xp.float64), spec)
        p = (vals > 0).astype(xp.float64)
        return float((c * (p - s) ** 2 - s * s).sum()), float(c.sum())

    def topk(self, X: Any, Theta: Any, k: int, seen: Block | None = None) -> tuple[Any, Any]:
        """Top-k columns by score X @ Theta^T for each row of X, skipping `seen` ratings.

        Returns (indices, scores), each (rows, min(k, columns)), best first. `seen` is a
        block over the same rows and all columns (its col0 must be 0). A row with fewer than
        k columns not seen gets index -1 and score -inf in the places left over.
        """
        xp = self.xp
        k = min(max(int(k), 1), Theta.shape[0])
        scores = X @ Theta.T
        if seen is not None and seen.nnz:
            scores[self.row_of(seen), seen.indices] = -xp.inf
        part = xp.argpartition(-scores, k - 1, axis=1)[:, :k]
        top = xp.take_along_axis(scores, part, axis=1)
        order = xp.argsort(-top, axis=1)
        idx, top = xp.take_along_axis(part, order, axis=1), xp.take_along_axis(top, order, axis=1)
        if seen is not None and seen.nnz:
            idx[xp.isneginf(top)] = -1
        return idx, top


def round_bfloat16(xp: Any, x: Any) -> Any:
    """float32 values rounded to the nearest bfloat16 (ties to even), still as float32; a
    NaN stays a NaN (its sign kept, made quiet): the rounding bias would carry a NaN with
    its upper mantissa bits set (CUDA's 0x7FFFFFFF) into the sign, or wrap it to 0, and a
    non-finite factor would vanish from the Gram instead of reaching the finite checks."""
    bits = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    high = xp.uint32(0xFFFF0000)
    rounded = (bits + xp.uint32(0x7FFF) + ((bits >> 16) & xp.uint32(1))) & high
    nan = (bits & xp.uint32(0x7FFFFFFF)) > xp.uint32(0x7F800000)
    rounded = xp.where(nan, (bits & high) | xp.uint32(0x00400000), rounded)
    return rounded.view(xp.float32)
