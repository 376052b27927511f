"""Every backend computes the same hermitian, solve and update as the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_ratings, rel_err
from reference import half_step

from cumf_dask.backend.objective import UpdateSpec
from cumf_dask.blocks import coo_to_block
from cumf_dask.factors import INIT_CHUNK, init_factor


def _block(m, n, seed, **kw):
    rows, cols, vals = random_ratings(m, n, 0.05, seed, **kw)
    return rows, cols, vals, coo_to_block(rows, cols, vals, 0, 0, m, n)


@pytest.mark.parametrize("f", [1, 3, 10, 32, 100])
def test_update_matches_reference(backend, f):
    m, n = 300, 120
    rows, cols, vals, block = _block(m, n, seed=f, empty_rows=[0, 7], skew=0.7)
    fixed = init_factor(n, f, seed=f + 1)
    counts = np.bincount(rows, minlength=m)
    X = backend.to_host(
        backend.update(
            backend.block_to_device(block), backend.asarray(fixed), backend.asarray(counts), 0.05
        )
    )
    ref = half_step(rows, cols, vals.astype(np.float64), m, fixed.astype(np.float64), 0.05)
    assert np.isfinite(X).all()
    assert (X[[0, 7]] == 0).all()
    assert rel_err(X, ref) < 1e-4


def test_hermitian_partials_add_up(backend):
    """A and B over two column parts sum to those over all columns (lower triangle)."""
    m, n, f = 200, 90, 12
    rows, cols, vals, whole = _block(m, n, seed=3)
    fixed = init_factor(n, f, seed=4)
    A, B = (
        backend.to_host(a)
        for a in backend.hermitian(backend.block_to_device(whole), backend.asarray(fixed))
    )
    parts = []
    for c0, c1 in ((0, 40), (40, n)):
        keep = (cols >= c0) & (cols < c1)
        blk = coo_to_block(rows[keep], cols[keep] - c0, vals[keep], 0, c0, m, c1 - c0)
        parts.append(backend.hermitian(backend.block_to_device(blk), backend.asarray(fixed[c0:c1])))
    A2 = sum(backend.to_host(p[0]) for p in parts)
    B2 = sum(backend.to_host(p[1]) for p in parts)
    low = np.tril_indices(f)
    assert rel_err(A2[:, low[0], low[1]], A[:, low[0], low[1]]) < 1e-5
    assert rel_err(B2, B) < 1e-5


def test_solve_empty_rows_give_zero(backend):
    f = 8
    A = np.zeros((4, f, f), np.float32)
    B = np.zeros((4, f), np.float32)
    X = backend.to_host(
        backend.solve(
            backend.asarray(A), backend.asarray(B), backend.asarray(np.zeros(4, np.int64)), 0.1
        )
    )
    assert (X == 0).all()


@pytest.mark.parametrize("f", [3, 10, 100, 300])
@pytest.mark.parametrize("solver", ["cholesky", "cg"])
@pytest.mark.parametrize("implicit", [False, True])
def test_solve_reads_packed_lower_triangles(backend, f, solver, implicit):
    """The solve from packed sums (as the reductions add them up) gives exactly what it gives
    from the same systems stored whole: G0, warm starts, rows that count no ratings; above
    f = 256 on the GPU, cuSOLVER from systems unpacked a batch at a time. The packed sums
    and B are left as they were (``tasks.reduce_solve`` hands a lone input over uncopied)."""
    rng = np.random.default_rng()
    n = 40
    G = rng.standard_normal((n, f + 3, f)).astype(np.float32)
    A = np.einsum("rki,rkj->rij", G, G).astype(np.float32)
    counts = rng.integers(0, 9, n)
    counts[:2] = 0
    spec = UpdateSpec(0.1, implicit=implicit, solver=solver, cg_steps=3)
    gram0 = backend.asarray((G[0].T @ G[0]).astype(np.float32)) if implicit else None
    x0 = backend.asarray(rng.standard_normal((n, f)).astype(np.float32))
    B = backend.asarray(rng.standard_normal((n, f)).astype(np.float32))
    counts = backend.asarray(counts)

    def solve(systems, packed):
        X = backend.solve(systems, B, counts, spec, gram0=gram0, x0=x0, packed=packed)
        return backend.to_host(X)

    whole = solve(backend.asarray(A), False)
    assert np.abs(whole).max() > 0 and (whole[:2] == 0).all()
    packed = backend.pack(backend.asarray(A))
    before = backend.to_host(packed).copy(), backend.to_host(B).copy()
    np.testing.assert_array_equal(solve(packed, True), whole)
    np.testing.assert_array_equal(backend.to_host(packed), before[0])
    np.testing.assert_array_equal(backend.to_host(B), before[1])


def test_pack_roundtrip(backend):
    rng = np.random.default_rng(5)
    M = rng.standard_normal((6, 9, 9)).astype(np.float32)
    S = M + M.transpose(0, 2, 1)
    P = backend.pack(backend.asarray(S))
    assert P.shape == (6, 45)
    np.testing.assert_array_equal(backend.to_host(backend.unpack(P, 9)), S)


def test_topk_excludes_seen(backend):
    rng = np.random.default_rng(6)
    X = rng.standard_normal((5, 4)).astype(np.float32)
    T = rng.standard_normal((30, 4)).astype(np.float32)
    seen = coo_to_block(
        np.array([0, 0, 3]), np.array([1, 2, 29]), np.ones(3, np.float32), 0, 0, 5, 30
    )
    idx, score = (
        backend.to_host(a)
        for a in backend.topk(
            backend.asarray(X), backend.asarray(T), 3, backend.block_to_device(seen)
        )
    )
    full = X @ T.T
    full[0, [1, 2]] = -np.inf
    full[3, 29] = -np.inf
    np.testing.assert_array_equal(idx, np.argsort(-full, axis=1)[:, :3])
    np.testing.assert_allclose(score, np.take_along_axis(full, idx, 1), rtol=1e-5)


def test_init_factor_slices_are_slices_of_the_whole():
    """Any partition draws the same rows (chunks are seeded alone); rows past the end are an
    error, never uninitialized memory."""
    n = INIT_CHUNK + 100
    whole = init_factor(n, 3, 5)
    for start, stop in ((0, 7), (INIT_CHUNK - 4, INIT_CHUNK + 9), (n - 1, n), (10, 10)):
        np.testing.assert_array_equal(init_factor(n, 3, 5, start, stop), whole[start:stop])
    for start, stop in ((0, n + 1), (5, 4), (-1, 3)):
        with pytest.raises(ValueError, match="are not within"):
            init_factor(n, 3, 5, start, stop)


@pytest.mark.parametrize("solver", ["cholesky", "cg"])
def test_numpy_loops_stop_while_their_local_cluster_closes(solver):
    """After a Ctrl-C, closing a local cluster of threads waited for their running NumPy
    tasks (16 s at 10M ratings): while it closes, those stop at their next chunk."""
    from cumf_dask.backend import get_backend
    from cumf_dask.backend.numpy_backend import STOPPING
    from cumf_dask.errors import ClusterClosing

    backend = get_backend("numpy")
    rows, _, _, block = _block(60, 30, seed=2)
    fixed, counts = init_factor(30, 4, seed=3), np.bincount(rows, minlength=60)
    spec = UpdateSpec(0.05, solver=solver)
    STOPPING.set()
    try:
        with pytest.raises(ClusterClosing):
            backend.update(block, fixed, counts, spec)
    finally:
        STOPPING.clear()
    assert np.isfinite(backend.update(block, fixed, counts, spec)).all()


def test_round_bfloat16_keeps_every_nan():
    """A NaN with its upper mantissa bits set (CUDA's 0x7FFFFFFF) was carried into the sign
    or wrapped to 0 by the rounding bias: a non-finite factor vanished from the Gram."""
    from cumf_dask.backend import get_backend
    from cumf_dask.backend.base import round_bfloat16

    nans = np.array([0x7FC00000, 0x7FFFFFFF, 0x7FFF8000, 0xFFFFFFFF, 0x7F800001, 0xFF800001],
                    np.uint32).view(np.float32)  # fmt: skip
    out = round_bfloat16(np, nans)
    assert np.isnan(out).all()
    assert (np.signbit(out) == np.signbit(nans)).all()
    top = np.finfo(np.float32).max  # rounds up past bfloat16's largest: inf
    edges = np.array([np.inf, -np.inf, 1.0, 1.00390625, 1.01171875, top], np.float32)
    np.testing.assert_array_equal(round_bfloat16(np, edges),
                                  [np.inf, -np.inf, 1, 1, 1.015625, np.inf])  # fmt: skip
    fixed = np.full((3, 4), 0.5, np.float32)
    fixed[1] = nans[1]
    stored = get_backend("numpy+bfloat16").prepare_fixed(fixed)
    assert np.isnan(stored[1]).all() and (stored[[0, 2]] == 0.5).all()


def test_cuda_allocation_failures_are_out_of_memory():
    """cudaHostAlloc's failure (page-locked host memory) is CuPy's CUDARuntimeError of
    status 2, recognised by name and status (no CuPy import): a DeviceMemoryError, exit 4."""
    from cumf_dask.errors import DeviceMemoryError, is_out_of_memory, out_of_memory_as

    def cuda_error(name, status):
        error = type(name, (RuntimeError,), {})(f"{name}: status {status}")
        error.status = status
        return error

    assert is_out_of_memory(cuda_error("CUDARuntimeError", 2))
    assert is_out_of_memory(cuda_error("CUDADriverError", 2))
    assert not is_out_of_memory(cuda_error("CUDARuntimeError", 1))  # an invalid value
    assert not is_out_of_memory(cuda_error("SomeOtherError", 2))
    fix = "set plan.blocks: store"
    with pytest.raises(DeviceMemoryError, match=r"page-locked.*plan\.blocks"), \
            out_of_memory_as("locking page-locked host memory", fix):  # fmt: skip
        raise cuda_error("CUDARuntimeError", 2)


def test_cg_gives_nan_only_to_systems_that_are_not_finite():
    """A row whose system holds inf or NaN (alpha beyond float32: s = inf, t = NaN) got x0
    back, finite: now NaN, for the finite checks; the other rows solve as alone."""
    from cumf_dask.backend.objective import batched_cg

    rng = np.random.default_rng(4)
    G = rng.standard_normal((4, 6, 5))
    M = G.transpose(0, 2, 1) @ G + np.eye(5)
    b, x0 = rng.standard_normal((4, 5)), rng.standard_normal((4, 5))
    M[1, 2, 3] = M[1, 3, 2] = np.inf
    b[2, 0] = np.nan
    with np.errstate(all="ignore"):
        x = batched_cg(np, M, b, x0, 3)
    assert np.isnan(x[[1, 2]]).all()
    good = [0, 3]
    np.testing.assert_array_equal(x[good], batched_cg(np, M[good], b[good], x0[good], 3))
    assert np.isfinite(x[good]).all()
