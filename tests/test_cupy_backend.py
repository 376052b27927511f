"""GPU-only checks of the CuPy kernels against the NumPy backend and the float64 reference.

Fresh random inputs each time: any f from 1 to 256 (and the cuSOLVER path above), very long
rows split over blocks, rows without ratings, float64 inputs, out-of-memory errors, and the
bfloat16 factor storage against the NumPy backend's emulation of it.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from conftest import float32_cg_change, random_ratings, rel_err
from reference import half_step

from cumf_dask.blocks import Block, coo_to_block
from cumf_dask.errors import ConfigError, DeviceMemoryError

pytestmark = pytest.mark.gpu


@pytest.fixture
def gpu():
    from cumf_dask.backend import get_backend

    return get_backend("cupy")


@pytest.fixture
def cpu():
    from cumf_dask.backend import get_backend

    return get_backend("numpy")


def _problem(m, n, f, density, seed, **kw):
    rng = np.random.default_rng(seed)
    rows, cols, vals = random_ratings(m, n, density, seed, **kw)
    fixed = (rng.random((n, f)) / np.sqrt(f)).astype(np.float32)
    return rows, cols, vals, coo_to_block(rows, cols, vals, 0, 0, m, n), fixed


def _lower(A):
    low = np.tril_indices(A.shape[-1])
    return A[:, low[0], low[1]]


def _gram64(block, fixed):
    """A (lower triangles) and B of every row in float64."""
    m, f = block.n_rows, fixed.shape[1]
    A, B = np.zeros((m, f, f)), np.zeros((m, f))
    for u, lo, hi in zip(range(m), block.indptr[:-1], block.indptr[1:], strict=True):
        G = fixed[block.indices[lo:hi]].astype(np.float64)
        A[u], B[u] = G.T @ G, G.T @ block.values[lo:hi]
    return _lower(A), B


def _segment_rows(degrees, n, rng):
    """A block with rows of the given degrees (distinct random columns, ratings in [1, 5])."""
    rows = np.repeat(np.arange(len(degrees)), degrees)
    cols = np.concatenate([rng.choice(n, d, replace=False) for d in degrees])
    vals = rng.uniform(1, 5, rows.size).astype(np.float32)
    return coo_to_block(rows, cols, vals, 0, 0, len(degrees), n)


def _check_packed_sums(gpu, block, fixed, A0, B0):
    """packed_hermitian gives the packed lower triangles and B of the reference A0, B0, and
    with `into` adds them to what it holds."""
    P, B = gpu.packed_hermitian(block, gpu.asarray(fixed))
    assert rel_err(gpu.to_host(P), _lower(A0)) < 1e-5
    assert rel_err(gpu.to_host(B), B0) < 1e-5
    start = (P + 1, B - 2)
    P2, B2 = gpu.packed_hermitian(block, gpu.asarray(fixed), into=start)
    assert P2 is start[0] and B2 is start[1]
    assert rel_err(gpu.to_host(P2), 2 * _lower(A0) + 1) < 1e-5
    assert rel_err(gpu.to_host(B2), 2 * B0 - 2) < 1e-5


def test_packed_sums_must_be_c_contiguous_float32(gpu):
    """`into` that the kernels cannot add to in place (Fortran order, float64, wrong rows)
    is refused with the fix named; nothing is written to it."""
    import cupy as cp

    rng = np.random.default_rng(5)
    f = 12
    block = gpu.block_to_device(_segment_rows([30, 5, 0, 17], 40, rng))
    fixed = gpu.asarray(rng.standard_normal((40, f)).astype(np.float32))
    P, B = gpu.packed_hermitian(block, fixed)
    fortran = cp.asfortranarray(P)
    kept = fortran.copy()
    with pytest.raises(ValueError, match=r"A must be a C-contiguous.*ascontiguousarray"):
        gpu.packed_hermitian(block, fixed, into=(fortran, B))
    assert bool((fortran == kept).all())
    with pytest.raises(ValueError, match=r"B must be .*shape \(4, 12\).*float64"):
        gpu.packed_hermitian(block, fixed, into=(P, B.astype(cp.float64)))
    with pytest.raises(ValueError, match=r"A must be .*shape \(4, 78\)"):
        gpu.packed_hermitian(block, fixed, into=(P[:3], B))


@pytest.mark.parametrize("f", [1, 7, 8, 10, 16, 33, 64, 100, 128, 200, 256])
def test_kernels_match_numpy_backend(gpu, cpu, f):
    m, n, lam = 150, 400, 0.05
    seed = int(np.random.default_rng().integers(1 << 30))
    rows, cols, vals, block, fixed = _problem(m, n, f, 0.08, seed, empty_rows=[3], skew=0.8)
    counts = np.bincount(rows, minlength=m)
    A, B = (gpu.to_host(a) for a in gpu.hermitian(gpu.block_to_device(block), gpu.asarray(fixed)))
    A0, B0 = cpu.hermitian(block, fixed)
    assert rel_err(_lower(A), _lower(A0)) < 1e-5, seed
    assert rel_err(B, B0) < 1e-5, seed
    _check_packed_sums(gpu, gpu.block_to_device(block), fixed, A0, B0)
    X = gpu.to_host(gpu.solve(gpu.asarray(A0), gpu.asarray(B0), gpu.asarray(counts), lam))
    assert rel_err(X, cpu.solve(A0, B0, counts, lam)) < 1e-4, seed
    X = gpu.to_host(gpu.update(gpu.block_to_device(block), gpu.asarray(fixed),
                               gpu.asarray(counts), lam))  # fmt: skip
    ref = half_step(rows, cols, vals.astype(np.float64), m, fixed.astype(np.float64), lam)
    assert np.isfinite(X).all() and (X[3] == 0).all()
    assert rel_err(X, ref) < 1e-4, seed


@pytest.mark.parametrize("f", [10, 32])
@pytest.mark.parametrize("long_row", [1 << 20, 4096, 1000, 37])
def test_long_rows_are_split_and_summed(cpu, long_row, f):
    """An item with 100k ratings among short rows: same result split or whole (f = 10: the
    short rows a thread each, the heavy one on the tiled kernel or split)."""
    from cumf_dask.backend.cupy_backend import CupyBackend

    gpu = CupyBackend(long_row=long_row)
    rng = np.random.default_rng()
    m, n, lam = 40, 120_000, 0.1
    heavy = rng.choice(n, 100_000, replace=False)
    rows, cols, vals = random_ratings(m, n, 0.0005, int(rng.integers(1 << 30)))
    rows = np.concatenate([rows, np.full(heavy.size, 5)])
    cols = np.concatenate([cols, heavy])
    vals = np.concatenate([vals, rng.uniform(1, 5, heavy.size).astype(np.float32)])
    keep = np.unique(rows * n + cols, return_index=True)[1]
    rows, cols, vals = rows[keep], cols[keep], vals[keep]
    block = coo_to_block(rows, cols, vals, 0, 0, m, n)
    fixed = (rng.random((n, f)) / np.sqrt(f)).astype(np.float32)
    counts = np.bincount(rows, minlength=m)
    dev = gpu.block_to_device(block)
    A, B = (gpu.to_host(a) for a in gpu.hermitian(dev, gpu.asarray(fixed)))
    A0, B0 = cpu.hermitian(block, fixed)
    assert rel_err(_lower(A), _lower(A0)) < 1e-5
    assert rel_err(B, B0) < 1e-5
    _check_packed_sums(gpu, dev, fixed, A0, B0)
    X = gpu.to_host(gpu.update(dev, gpu.asarray(fixed), gpu.asarray(counts), lam))
    assert rel_err(X, cpu.update(block, fixed, counts, lam)) < 1e-4


@pytest.mark.parametrize("f", [10, 32])
def test_rows_are_found_once_per_block(cpu, f):
    """How the kernels cover a block's rows (update: fused, split; the partial Hermitians:
    the Gram launches) is found once per block and counts (that synchronizes with the
    GPU); other counts find it again, a staged copy uses its source's, and it goes with
    the block."""
    import gc

    from cumf_dask.backend.cupy_backend import CupyBackend

    gpu = CupyBackend(long_row=300)
    rng = np.random.default_rng()
    m, n, lam = 60, 4000, 0.1
    rows, cols, vals = random_ratings(m, n, 0.05, int(rng.integers(1 << 30)))
    heavy = np.setdiff1d(np.arange(n), cols[rows == 7])[:1000]  # row 7: long, split
    rows, cols = np.r_[rows, np.full(heavy.size, 7)], np.r_[cols, heavy]
    vals = np.r_[vals, rng.uniform(1, 5, heavy.size).astype(np.float32)]
    block = coo_to_block(rows, cols, vals, 0, 0, m, n)
    dev = gpu.block_to_device(block)
    counts = np.bincount(rows, minlength=m)
    fewer = counts.copy()
    fewer[[3, 7]] = 0  # rows that count no ratings are not solved (zeros)
    for c in (counts, counts, fewer):
        fixed = (rng.random((n, f)) / np.sqrt(f)).astype(np.float32)
        X = gpu.to_host(gpu.update(dev, gpu.asarray(fixed), gpu.asarray(c), lam))
        assert rel_err(X, cpu.update(block, fixed, c, lam)) < 1e-4
    held = gpu.asarray(counts)
    gpu.update(dev, gpu.asarray(fixed), held, lam)
    found = dict(gpu._found[id(dev)])
    gpu.update(dev, gpu.asarray(fixed), held, lam)
    staged = []  # the Gram launches of staged copies of `block`, kept on it
    for _ in range(2):  # the second time from the first's launches
        sums = gpu.packed_hermitian(gpu.staged_copy(block), gpu.asarray(fixed))
        gpu.packed_hermitian(dev, gpu.asarray(fixed), into=sums)
        staged.append([hit[1] for hit in gpu._found[id(block)].values()])
    assert len(staged[0]) == 1 and staged[1][0] is staged[0][0]
    A, B = cpu.hermitian(block, fixed)
    assert rel_err(gpu.to_host(sums[0]), 2 * cpu.pack(A)) < 1e-4
    assert rel_err(gpu.to_host(sums[1]), 2 * B) < 1e-4
    kept = gpu._found[id(dev)]
    assert len(kept) == len(found) + 1  # the update's rows, the Gram launches
    assert all(kept[key][1] is hit[1] for key, hit in found.items())
    del dev, block
    gc.collect()
    assert not gpu._found


@pytest.mark.parametrize("f", [24, 100, 200])
@pytest.mark.parametrize("weighted", [True, False])
def test_short_rows_by_the_push_through_identity(f, weighted):
    """Rows with fewer ratings than a dual size (each size, its edges, a row without
    ratings, rows left to the fused kernel) solve the n x n system: the same x as the
    float64 reference and as the update without it (float32 factors; bfloat16 ones keep
    the fused kernel)."""
    from cumf_dask.backend.cupy_backend import (
        DUAL_SIZES,
        STATIC_SMEM,
        CupyBackend,
        dual_smem_bytes,
        padded_size,
    )
    from cumf_dask.backend.objective import UpdateSpec

    rng = np.random.default_rng()
    degrees = [1, 2, 7, 8, 0, 22, 23, 24, 25, 39, 40, 41, 55, 56, 70, 71, 72, 73, 99, 150]
    m, n = len(degrees), 400
    block = _segment_rows(degrees, n, rng)
    fixed = (rng.random((n, f)) / np.sqrt(f)).astype(np.float32)
    counts = np.asarray(degrees)
    spec = UpdateSpec(0.05, weighted=weighted)
    ref = np.zeros((m, f))
    for u, lo, hi in zip(range(m), block.indptr[:-1], block.indptr[1:], strict=True):
        if hi > lo:
            G = fixed[block.indices[lo:hi]].astype(np.float64)
            reg = 0.05 * (hi - lo if weighted else 1)
            ref[u] = np.linalg.solve(G.T @ G + reg * np.eye(f), G.T @ block.values[lo:hi])
    dual, primal = CupyBackend(), CupyBackend(dual_sizes=())
    sizes = dual._dual(f, spec, "float")
    plan = dual._update_rows(dual.block_to_device(block), dual.asarray(block.indptr),
                             dual.asarray(counts), f, False, sizes)  # fmt: skip
    fits = [s for s in DUAL_SIZES if dual_smem_bytes(s, f) <= STATIC_SMEM]
    assert [size for size, _ in plan.dual] == [s for s in fits if s < padded_size(f)]
    for size, short in plan.dual:
        assert (counts[dual.to_host(short)] < size).all()
    assert dual._dual(f, spec, "bf16") == ()
    X, X0 = (be.to_host(be.update(be.block_to_device(block), be.asarray(fixed),
                                  be.asarray(counts), spec)) for be in (dual, primal))  # fmt: skip
    assert (X[4] == 0).all()
    assert rel_err(X, ref) < 1e-4
    assert rel_err(X, X0) < 1e-4


@pytest.mark.parametrize("f", [7, 15, 24, 31, 40, 63, 64, 95, 100, 111])
def test_tensor_core_gram_matches_float64(f):
    """The tensor-core Gram (float16 split, flushed sums) of rows of every bin shape (a few
    ratings, a partial k-step, whole and partial bins, past a flush, split over segments
    and summed with atomics) is within float32's error of float64: stored, packed and added
    to, for F of each warp layout (row blocks odd and even, odd and even units)."""
    from cumf_dask.backend.cupy_backend import CupyBackend

    rng = np.random.default_rng()
    degrees = [1, 5, 16, 17, 31, 32, 33, 200, 256, 257, 300, 0, 1000, 3000]
    block = _segment_rows(degrees, 4000, rng)
    fixed = rng.normal(0, 1, (4000, f)).astype(np.float32)
    A0, B0 = _gram64(block, fixed)
    tc, fp32 = CupyBackend(long_row=600), CupyBackend(long_row=600, tensor_cores=False)
    assert "tc_hermitian" in tc._kernels(f) and "tc_hermitian" not in fp32._kernels(f)
    errors = {}
    for name, be in (("tc", tc), ("fp32", fp32)):
        dev = be.block_to_device(block)
        A, B = (be.to_host(a) for a in be.hermitian(dev, be.asarray(fixed)))
        errors[name] = max(rel_err(_lower(A), A0), rel_err(B, B0))
        P, Bp = be.packed_hermitian(dev, be.asarray(fixed), into=(
            be.asarray(np.ones(A0.shape, np.float32)), be.asarray(np.ones(B0.shape, np.float32))))
        assert rel_err(be.to_host(P), A0 + 1) < 2e-6 and rel_err(be.to_host(Bp), B0 + 1) < 2e-6
    assert errors["tc"] < 2e-6, errors  # float32's level (the FP32 units': 3e-7 to 1e-6)


@pytest.mark.parametrize("where", ["factor", "rating"])
def test_values_outside_float16_take_the_fp32_kernels(where):
    """A factor value or a rating of 16384 or more does not fit the float16 split: the FP32
    kernels build the Gram of those segments (all of them for a factor value; that row's for
    a rating), and the result is the FP32 path's (bit for bit where no atomics sum it)."""
    from cumf_dask.backend.cupy_backend import CupyBackend

    rng = np.random.default_rng()
    f, degrees = 100, [40, 300, 5000, 7]
    block = _segment_rows(degrees, 6000, rng)
    fixed = rng.normal(0, 1, (6000, f)).astype(np.float32)
    if where == "factor":
        fixed[block.indices[50], 3] = 3e4
    else:
        block.values[50] = 2e4  # in row 1
    A0, B0 = _gram64(block, fixed)
    tc, fp32 = CupyBackend(long_row=1000), CupyBackend(long_row=1000, tensor_cores=False)
    out = {}
    for name, be in (("tc", tc), ("fp32", fp32)):
        A, B = be.hermitian(be.block_to_device(block), be.asarray(fixed))
        out[name] = _lower(be.to_host(A)), be.to_host(B)
        assert rel_err(out[name][0], A0) < 5e-6 and rel_err(out[name][1], B0) < 5e-6
    rows = [0, 1, 3] if where == "factor" else [1]  # row 2 is split: atomics, in any order
    assert np.array_equal(out["tc"][0][rows], out["fp32"][0][rows])
    assert np.array_equal(out["tc"][1][rows], out["fp32"][1][rows])


def test_to_host_copies_behind_the_queued_work(gpu):
    """to_host copies on a stream of its own (not the default one, which held up the kernels
    queued behind the copy): what the kernels queued before it wrote, whatever the size,
    layout and dtype."""
    import cupy as cp

    from cumf_dask.backend.cupy_backend import HOST_COPY_THREADS, STAGING_BYTES

    rng = cp.random.default_rng(3)
    big = rng.standard_normal((STAGING_BYTES // 4 * 2 + 777,), dtype=cp.float32)
    large = rng.standard_normal((HOST_COPY_THREADS * STAGING_BYTES // 4 + 777, 2))  # threads
    for x in (big * 2, large * 2,  # queued just before the copy
              rng.standard_normal((300, 40), dtype=cp.float32)[:, ::3],  # not contiguous
              cp.arange(10, dtype=cp.uint16), cp.zeros((0, 5), cp.float32)):  # fmt: skip
        out = gpu.to_host(x)
        assert isinstance(out, np.ndarray) and out.dtype == x.dtype and out.shape == x.shape
        assert np.array_equal(out, cp.asnumpy(x))
    host = np.ones(3, np.float32)
    assert gpu.to_host(host) is host


def test_above_256_uses_cusolver(gpu):
    m, n, f, lam = 30, 500, 300, 0.05
    rows, cols, vals, block, fixed = _problem(m, n, f, 0.5, 11, empty_rows=[0])
    counts = np.bincount(rows, minlength=m)
    X = gpu.to_host(gpu.update(gpu.block_to_device(block), gpu.asarray(fixed),
                               gpu.asarray(counts), lam))  # fmt: skip
    ref = half_step(rows, cols, vals.astype(np.float64), m, fixed.astype(np.float64), lam)
    assert (X[0] == 0).all()
    assert rel_err(X, ref) < 1e-4


def test_float64_inputs_and_reference(gpu):
    """float64 arrays are accepted (computed in float32) and agree with the float64 reference."""
    m, n, f, lam = 200, 150, 24, 0.02
    rows, cols, vals, block, fixed = _problem(m, n, f, 0.1, 12)
    fixed64 = fixed.astype(np.float64)
    counts = np.bincount(rows, minlength=m)
    X = gpu.to_host(gpu.update(gpu.block_to_device(block), gpu.asarray(fixed64),
                               gpu.asarray(counts), lam))  # fmt: skip
    ref = half_step(rows, cols, vals.astype(np.float64), m, fixed64, lam)
    assert X.dtype == np.float32
    assert rel_err(X, ref) < 1e-5


def test_rows_without_counts_or_ratings_are_zero(gpu):
    m, n, f = 50, 60, 10
    rows, _, _, block, fixed = _problem(m, n, f, 0.2, 13, empty_rows=[1, 2])
    counts = np.bincount(rows, minlength=m)
    counts[[4, 5]] = 0  # rated, but told to keep a zero factor
    X = gpu.to_host(gpu.update(gpu.block_to_device(block), gpu.asarray(fixed),
                               gpu.asarray(counts), 0.1))  # fmt: skip
    assert (X[[1, 2, 4, 5]] == 0).all()
    assert np.isfinite(X).all() and (np.abs(X[6:]).sum(axis=1) > 0).all()


def test_hermitian_zeroes_unrated_rows_in_reused_memory(gpu, cpu):
    """A, B come from uninitialized memory: rows without ratings must still read zero."""
    import cupy

    m, n, f = 64, 80, 24
    _, _, _, block, fixed = _problem(m, n, f, 0.2, 17, empty_rows=[0, 7, 63])
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    dirty = cupy.full(m * f * f + m * f + 4096, np.nan, cupy.float32)
    del dirty  # its blocks go back to the pool, NaN-filled
    A, B = (gpu.to_host(a) for a in gpu.hermitian(gpu.block_to_device(block), gpu.asarray(fixed)))
    A0, B0 = cpu.hermitian(block, fixed)
    assert (_lower(A)[[0, 7, 63]] == 0).all() and (B[[0, 7, 63]] == 0).all()
    assert rel_err(_lower(A), _lower(A0)) < 1e-5 and rel_err(B, B0) < 1e-5


@pytest.mark.parametrize(
    ("f", "long_row"),
    [(1, 4096), (7, 4096), (16, 37), (33, 4096), (100, 4096), (100, 37), (256, 4096), (300, 4096)],
)
def test_bfloat16_matches_numpy_emulation(gpu, f, long_row):
    """bf16 gathers on the GPU = the NumPy backend's rounded float32 inputs (float32 math),
    a few 1e-4 from float32 storage; float32 factors still take the float32 kernels."""
    from cumf_dask.backend import get_backend
    from cumf_dask.backend.cupy_backend import CupyBackend

    half, emu = CupyBackend(long_row=long_row, precision="bfloat16"), get_backend("numpy+bfloat16")
    m, n, lam = 150, 400, 0.05
    seed = int(np.random.default_rng().integers(1 << 30))
    rows, _, _, block, fixed = _problem(m, n, f, 0.08, seed, empty_rows=[3], skew=0.8)
    counts = np.bincount(rows, minlength=m)
    dev, dcounts = half.block_to_device(block), half.asarray(counts)
    stored = half.prepare_fixed(half.asarray(fixed))
    assert stored.dtype == np.uint16 and stored.shape == fixed.shape
    A, B = (half.to_host(a) for a in half.hermitian(dev, stored))
    A0, B0 = emu.hermitian(block, emu.prepare_fixed(fixed))
    assert rel_err(_lower(A), _lower(A0)) < 1e-5, seed
    assert rel_err(B, B0) < 1e-5, seed
    X = half.to_host(half.update(dev, stored, dcounts, lam))
    assert (X[3] == 0).all()
    assert rel_err(X, emu.update(block, emu.prepare_fixed(fixed), counts, lam)) < 1e-4, seed
    X32 = gpu.to_host(gpu.update(dev, gpu.asarray(fixed), dcounts, lam))
    assert 1e-5 < rel_err(X, X32) < 5e-3, seed
    # uint16 rows not padded to 16 bytes are re-laid out; float32 factors are not rounded.
    packed = half.xp.ascontiguousarray(stored)
    assert rel_err(half.to_host(half.update(dev, packed, dcounts, lam)), X) < 1e-5, seed
    assert rel_err(half.to_host(half.update(dev, half.asarray(fixed), dcounts, lam)), X32) < 1e-5


def test_out_of_memory_is_a_device_memory_error(gpu):
    n_rows = 20_000_000  # A would need 20M x 256 x 256 x 4 bytes = 5 TB
    block = Block(np.zeros(n_rows + 1, np.int64), np.zeros(0, np.int32),
                  np.zeros(0, np.float32), 0, 0, n_rows, 10)  # fmt: skip
    with pytest.raises(DeviceMemoryError, match="plan smaller batches"):
        gpu.hermitian(gpu.block_to_device(block), gpu.asarray(np.ones((10, 256), np.float32)))


@pytest.mark.parametrize("f", [1, 10, 33, 100, 256])
def test_block_squared_error_matches_float64(gpu, f):
    """The error kernel against a float64 sum, with empty rows and a long row."""
    rows, cols, vals, block, fixed = _problem(300, 200, f, 0.05, seed=f, empty_rows=[3, 7])
    extra = np.arange(200)  # row 5 rates every column
    block = coo_to_block(np.r_[rows[rows != 5], np.full(200, 5)], np.r_[cols[rows != 5], extra],
                         np.r_[vals[rows != 5], np.full(200, 2.5, np.float32)], 0, 0, 300, 200)
    X = np.random.default_rng(f).standard_normal((300, f)).astype(np.float32)
    r = np.repeat(np.arange(300), np.diff(block.indptr))
    want = float(((block.values - (X[r].astype(np.float64) * fixed[block.indices]).sum(1)) ** 2)
                 .sum())  # fmt: skip
    got = gpu.block_squared_error(gpu.block_to_device(block), gpu.asarray(X), gpu.asarray(fixed))
    assert abs(got - want) / want < 1e-5


@pytest.mark.parametrize("where", ["local", "memory"])
def test_blocks_built_on_the_gpu_equal_the_host_ones(gpu, tmp_path, where):
    """Bands decoded to the host or straight to the GPU, from a local store or over a URL."""
    from cumf_dask.blocks import block_on_host
    from cumf_dask.data.assemble import read_bands
    from cumf_dask.data.shards import HOST
    from cumf_dask.data.spill import build_store
    from cumf_dask.errors import StoreError

    rows, cols, vals = random_ratings(130, 70, 0.2, seed=4, empty_rows=[9], skew=0.5)
    url = str(tmp_path / "s.zarr") if where == "local" else f"memory://{tmp_path.name}/s.zarr"
    store = build_store(url, rows, cols, vals, shape=(130, 70), test_fraction=0.2,
                        tile_rows=17, tile_cols=9)  # fmt: skip
    cases = [
        ("row", "train", (0, 130), (0, 70)),  # whole, bands and tiles uncut
        ("row", "test", (5, 99), (3, 61)),  # the held-out split, cut on every side
        ("col", "train", (10, 70), (17, 120)),
        ("col", "train", (0, 9), (0, 130)),  # one band
    ]
    for orient, split, r, c in cases:
        host = block_on_host(read_bands(store, orient, r, c, split, threads=2))
        for target in (HOST, gpu.decode_target()):  # bands decoded to the host, to the GPU
            dev = gpu.block_from_bands(read_bands(store, orient, r, c, split, 2, target))
            for name in ("indptr", "indices", "values"):
                got = gpu.to_host(getattr(dev, name))
                np.testing.assert_array_equal(got, getattr(host, name))
            shape = ("row0", "col0", "n_rows", "n_cols")
            assert [getattr(dev, a) for a in shape] == [getattr(host, a) for a in shape]
    damage = [("val", np.nan), ("val", -np.inf), ("major", 17), ("minor", 70), ("minor", -1)]
    for field, value in damage:  # 17 rows a band, 70 columns: each out of range once
        bands = read_bands(store, "row", (0, 130), (0, 70), "train", threads=2)
        first = bands.slice(0)  # handed over once: the damaged copy is what band 0 gives
        getattr(first, field)[-1] = value
        damaged = replace(bands, decoded=lambda i, b=bands, s=first: s if i == 0 else b.slice(i))
        with pytest.raises(StoreError, match="damaged store"):
            gpu.block_from_bands(damaged)


def test_chunks_larger_than_the_staging_buffer_reach_the_gpu_whole(gpu, monkeypatch):
    """A decoding thread's page-locked buffer grows for a chunk larger than it (a thread
    of its own: its buffer goes with it)."""
    import threading

    from cumf_dask.backend import cupy_backend

    monkeypatch.setattr(cupy_backend, "STAGING_BYTES", 64)
    target = gpu.decode_target()
    values = np.random.default_rng(2).standard_normal(1000).astype(np.float32)
    out = target.empty(1200, np.dtype(np.float32))

    def deliver(part: slice, start: int) -> None:
        chunk = target.chunk(out, start, values[part].size, values.dtype)
        chunk[...] = values[part]
        target.put(out, start, chunk)

    thread = threading.Thread(target=lambda: [deliver(slice(0, 10), 100),
                                              deliver(slice(10, 1000), 110)])  # fmt: skip
    thread.start()
    thread.join()
    np.testing.assert_array_equal(gpu.to_host(out[100:1100]), values)


SPIN_COPY = r"""
extern "C" __global__ void spin_copy(const float* src, float* dst, long long n, long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) dst[i] = src[i];
}
"""


def test_a_load_never_overwrites_memory_that_queued_kernels_still_read(gpu):
    """A kernel queued to read `src` after ~0.5 s; `src` freed at once (as a task frees its
    temporaries once their kernels are queued); the pool hands its memory to the next
    decoded array, whose copy runs on a staging stream: it waits for that kernel."""
    import cupy as cp

    from cumf_dask.backend.cupy_backend import _staging

    spin = cp.RawKernel(SPIN_COPY, "spin_copy")
    device = cp.cuda.Device()
    n = (1 << 20) + 1234  # a size no other array here has
    target = gpu.decode_target()
    _staging(device.id, n * 4)  # this thread's page-locked buffer and stream, made first
    dst, src = cp.zeros(n, cp.float32), cp.full(n, 1.0, cp.float32)
    spin((1,), (32,), (src, dst, np.int64(0), np.int64(0)))  # compiled
    device.synchronize()
    freed = src.data.ptr
    spin((132,), (128,), (src, dst, np.int64(n), np.int64(1_000_000_000)))
    del src
    out = target.empty(n, np.dtype(np.float32))
    chunk = target.chunk(out, 0, n, np.dtype(np.float32))
    chunk[...] = 2.0
    target.put(out, 0, chunk)
    device.synchronize()
    assert out.data.ptr == freed  # the case at hand: the same memory
    assert float(dst.min()) == float(dst.max()) == 1.0
    assert float(out.min()) == 2.0


# ----------------------------------------------------------------------------- implicit, CG


def _tolerance(A, B, counts, spec, gram0=None, x0=None):
    """1e-4 against the NumPy backend (float64), except for CG: a few CG steps are sensitive
    to rounding and the GPU runs them in float32, so there the bound is 10x the most that
    float32 rounding (of the arithmetic and of A's sums) moves the same steps in NumPy. With
    one unperturbed float32 run as the measure, f = 200 was seen 16x off (8.7e-3 against
    5.3e-4); the perturbed draws put that case at 7.9e-3."""
    if not spec.cg:
        return 1e-4
    return max(1e-4, 10 * float32_cg_change(A, B, counts, spec, gram0, x0))


def _implicit(solver, **kw):
    from cumf_dask.backend.objective import UpdateSpec

    return UpdateSpec(0.05, weighted=False, implicit=True, alpha=3.0, solver=solver, **kw)


@pytest.mark.parametrize("f", [1, 7, 8, 16, 33, 64, 100, 128, 200, 256, 300])
@pytest.mark.parametrize("solver", ["cholesky", "cg"])
def test_implicit_kernels_match_numpy_backend(gpu, cpu, f, solver):
    """Scaled rows in the Gram (vec and scalar staging), G0 in the fused update, CG on the
    register tiles, CG and Cholesky from A in memory; above f = 256 cuSOLVER and the batched
    CG on CuPy arrays."""
    m, n = 150, 400
    seed = int(np.random.default_rng().integers(1 << 30))
    rows, _, _, block, fixed = _problem(m, n, f, 0.08, seed, empty_rows=[3], skew=0.8)
    block = Block(block.indptr, block.indices, np.round(block.values) - 1, 0, 0, m, n)
    counts = np.bincount(rows, minlength=m)
    x0 = (np.random.default_rng(seed).random((m, f)) / np.sqrt(f)).astype(np.float32)
    spec = _implicit(solver, cg_steps=3)
    gram0 = fixed.astype(np.float64).T @ fixed
    A, B = (gpu.to_host(a) for a in gpu.hermitian(gpu.block_to_device(block),
                                                  gpu.asarray(fixed), spec))  # fmt: skip
    A0, B0 = cpu.hermitian(block, fixed, spec)
    assert rel_err(_lower(A), _lower(A0)) < 1e-5, seed
    assert rel_err(B, B0) < 1e-5, seed
    ref = cpu.solve(A0, B0, counts, spec, gram0=gram0, x0=x0)
    tol = _tolerance(A0, B0, counts, spec, gram0, x0)
    X = gpu.to_host(gpu.solve(gpu.asarray(A0), gpu.asarray(B0), gpu.asarray(counts), spec,
                              gram0=gpu.asarray(gram0), x0=gpu.asarray(x0)))  # fmt: skip
    assert rel_err(X, ref) < tol, seed
    X = gpu.to_host(gpu.update(gpu.block_to_device(block), gpu.asarray(fixed),
                               gpu.asarray(counts), spec, gram0=gpu.asarray(gram0),
                               x0=gpu.asarray(x0)))  # fmt: skip
    assert np.isfinite(X).all() and (X[3] == 0).all()
    assert rel_err(X, cpu.update(block, fixed, counts, spec, gram0=gram0, x0=x0)) < tol, seed


@pytest.mark.parametrize("solver", ["cholesky", "cg"])
@pytest.mark.parametrize("long_row", [4096, 37])
def test_implicit_long_rows_and_explicit_cg(cpu, solver, long_row):
    """Rows split over blocks (atomics) take hermitian + solve with their x0 rows; the
    explicit model's CG runs the same kernels without scaling."""
    from cumf_dask.backend.cupy_backend import CupyBackend
    from cumf_dask.backend.objective import UpdateSpec

    gpu = CupyBackend(long_row=long_row)
    m, n, f = 120, 3000, 32
    rows, _, _, block, fixed = _problem(m, n, f, 0.05, 5, skew=1.0)
    counts = np.bincount(rows, minlength=m)
    x0 = (np.random.default_rng(1).random((m, f)) / np.sqrt(f)).astype(np.float32)
    for spec in (_implicit(solver), UpdateSpec(0.05, solver=solver, cg_steps=2)):
        X = gpu.to_host(gpu.update(gpu.block_to_device(block), gpu.asarray(fixed),
                                   gpu.asarray(counts), spec, x0=gpu.asarray(x0)))  # fmt: skip
        ref = cpu.update(block, fixed, counts, spec, x0=x0)
        A, B = cpu.hermitian(block, fixed, spec)
        gram0 = fixed.astype(np.float64).T @ fixed if spec.implicit else None
        assert rel_err(X, ref) < _tolerance(A, B, counts, spec, gram0, x0)


@pytest.mark.parametrize("f", [10, 64])
@pytest.mark.parametrize("solver", ["cholesky", "cg"])
def test_implicit_bfloat16_matches_numpy_emulation(solver, f):
    from cumf_dask.backend import get_backend
    from cumf_dask.backend.cupy_backend import CupyBackend

    half, emu = CupyBackend(precision="bfloat16"), get_backend("numpy+bfloat16")
    m, n = 150, 400
    rows, _, _, block, fixed = _problem(m, n, f, 0.08, 3, empty_rows=[3])
    counts = np.bincount(rows, minlength=m)
    spec = _implicit(solver)
    gram0 = fixed.astype(np.float64).T @ fixed
    stored = half.prepare_fixed(half.asarray(fixed))
    X = half.to_host(half.update(half.block_to_device(block), stored, half.asarray(counts), spec,
                                 gram0=half.asarray(gram0)))  # fmt: skip
    ref = emu.update(block, emu.prepare_fixed(fixed), counts, spec, gram0=gram0)
    assert rel_err(X, ref) < 1e-4


def test_finite_check_on_the_gpu(gpu):
    """The non-blocking flags read back right, and the check names the first bad row."""
    from cumf_dask.engine.tasks import NonFiniteFactor, check_finite

    rng = np.random.default_rng()
    pieces = [rng.standard_normal((n, 4)).astype(np.float32) for n in (10, 6, 8)]
    assert gpu.finite([gpu.asarray(p) for p in pieces]).tolist() == [True] * 3
    pieces[1][3, 2], pieces[2][0, :] = np.inf, np.nan
    assert gpu.finite([gpu.asarray(p) for p in pieces]).tolist() == [True, False, False]
    with pytest.raises(NonFiniteFactor) as err:
        check_finite([0, 10, 16], "cupy", False, *(gpu.asarray(p) for p in pieces))
    assert (err.value.count, err.value.row) == (1, 13)
    assert gpu.finite([]).size == 0
    big = rng.standard_normal(300_007)  # float64, more than one grid of the check
    assert gpu.finite([gpu.asarray(big)]).tolist() == [True]
    big[-1] = np.nan
    assert gpu.finite([gpu.asarray(big), gpu.asarray(pieces[0])]).tolist() == [False, True]


def test_pooled_host_memory_is_reused_by_exact_size_once_unused(gpu):
    """A factor's batches in host memory come back every half-step with the same sizes: the
    page-locked memory of one that is gone is reused (not rounded up to a power of two),
    never while a view of it is alive."""
    from cumf_dask.backend.cupy_backend import _PINNED, pinned_empty

    gpu.release_memory()
    first = pinned_empty((1000, 7), np.float32, pooled=True)
    address = first.ctypes.data
    view = first[10:20]
    del first
    second = pinned_empty((1000, 7), np.float32, pooled=True)
    assert second.ctypes.data != address  # the view still uses the first one's memory
    del view
    third = pinned_empty((1000, 7), np.float32, pooled=True)
    assert third.ctypes.data == address
    other = pinned_empty((1000, 8), np.float32, pooled=True)
    assert other.ctypes.data not in (address, second.ctypes.data)
    del second, third
    gpu.release_memory()  # a fit ends while one lives on (a model's factor piece)
    del other
    assert not _PINNED._free  # it went back to the system, not to the pool


def test_a_fits_end_lets_go_of_its_last_block_and_the_cached_memory(gpu):
    """The last block a worker retires (its kernels were still queued) and what CuPy's
    device pool keeps cached are given back when a fit ends, whatever the blocks' tier."""
    import weakref

    import cupy

    rows, cols, vals = random_ratings(3000, 500, 0.3, seed=8)
    block = gpu.block_to_device(coo_to_block(rows, cols, vals, 0, 0, 3000, 500))
    gone, size = weakref.ref(block), sum(a.nbytes for a in (block.indices, block.values))
    gpu.update(block, gpu.asarray(np.ones((500, 8), np.float32)),
               np.bincount(rows, minlength=3000), 0.05)  # fmt: skip
    busy = cupy.ones((8192, 8192), cupy.float32)
    busy @ busy  # ~20 ms of queued work: the retire finds the block's kernels not yet ended
    gpu.retire(block)
    del block
    cupy.cuda.Device().synchronize()
    assert gone() is not None  # kept by the retire: no later one looked again
    pool = cupy.get_default_memory_pool()
    held = pool.total_bytes()
    gpu.release_memory()
    assert gone() is None and not gpu._retired
    assert pool.total_bytes() <= held - size  # its memory went back to the device


def test_staged_copy_is_kept_until_the_kernels_that_read_it_end(gpu, cpu):
    """A host-tier block copied for one use (on a side stream) equals the block, its
    Hermitian the host one's, and once retired it is let go only after those kernels."""
    import weakref

    import cupy

    from cumf_dask.backend.cupy_backend import pinned_copy

    *_, block, fixed = _problem(300, 500, 10, 0.05, int(np.random.default_rng().integers(1 << 30)))
    host = Block(pinned_copy(block.indptr), pinned_copy(block.indices),
                 pinned_copy(block.values), 0, 0, block.n_rows, block.n_cols)  # fmt: skip
    staged = gpu.staged_copy(host)
    assert all(np.array_equal(gpu.to_host(getattr(staged, a)), getattr(block, a))
               for a in ("indptr", "indices", "values"))  # fmt: skip
    P, B = gpu.packed_hermitian(staged, gpu.asarray(fixed))
    A0, B0 = cpu.hermitian(block, fixed)
    assert rel_err(gpu.to_host(P), _lower(A0)) < 1e-5 and rel_err(gpu.to_host(B), B0) < 1e-5
    gpu.retire(staged)
    kept = weakref.ref(staged)
    del staged
    cupy.cuda.get_current_stream().synchronize()
    gpu.retire(block)  # drops what is retired and done
    assert kept() is None


def test_solved_rows_for_host_memory_are_checked_on_the_gpu(gpu):
    """A solved batch kept in host memory is checked before it is copied out (the half-step's
    check then does not scan it on the host) and lands in pinned memory."""
    import cupy

    from cumf_dask.engine.tasks import NonFiniteFactor, _kept

    X = np.random.default_rng().standard_normal((9, 4)).astype(np.float32)
    kept = _kept(gpu, gpu.asarray(X), True, 100)
    assert isinstance(kept, np.ndarray) and np.array_equal(kept, X)
    assert cupy.cuda.runtime.pointerGetAttributes(kept.ctypes.data).type == 1  # host, pinned
    X[4, 1] = np.nan
    with pytest.raises(NonFiniteFactor) as err:
        _kept(gpu, gpu.asarray(X), True, 100)
    assert (err.value.count, err.value.row) == (1, 104)
    joined = gpu.concatenate([kept[:5], kept[5:]])
    assert isinstance(joined, np.ndarray) and np.array_equal(joined, kept)


@pytest.mark.parametrize(("f", "spec", "precision"), [
    (100, None, "float32"),  # fused, the short-row sizes, split rows
    (10, None, "float32"),  # one thread per row
    (64, "implicit cg", "float32"),
    (48, None, "bfloat16"),
])  # fmt: skip
def test_prepare_compiles_and_rehearses_every_path(f, spec, precision):
    """prepare (run in the background by the engine, which ignores its failures) compiles
    the kernels of an update path and rehearses it on its tiny block without error."""
    from cumf_dask.backend.cupy_backend import CupyBackend
    from cumf_dask.backend.objective import UpdateSpec

    be = CupyBackend(precision=precision)
    if spec:
        spec = UpdateSpec(0.1, implicit=True, alpha=2.0, solver="cg")
    be.prepare(f, spec)
    assert be._kernels(f, "bf16" if precision == "bfloat16" else "float", spec)


# ----------------------------------------------------------------------------- review s39


def test_a_gpu_nan_stays_nan_in_bfloat16_rows(gpu):
    """CUDA's NaN is 0x7FFFFFFF: the rounding carried it into the sign (-0.0), so with
    precision bfloat16 a non-finite fixed factor vanished from the Gram; now NaN, as the
    NumPy emulation gives."""
    import cupy as cp

    from cumf_dask.backend.base import round_bfloat16
    from cumf_dask.backend.cupy_backend import bfloat16_rows

    x = cp.sqrt(cp.full((3, 8), -1.0, cp.float32))  # NaN made by a CUDA kernel
    x[1] = 0.5
    rows = bfloat16_rows(x).get()
    widened = (rows.astype(np.uint32) << 16).view(np.float32)
    assert np.isnan(widened[[0, 2]]).all() and (widened[1] == 0.5).all()
    host = round_bfloat16(np, cp.asnumpy(x))
    np.testing.assert_array_equal(widened.view(np.uint32), host.view(np.uint32))


def test_a_bfloat16_fit_compiles_no_float32_kernels(monkeypatch):
    """The solve of a bfloat16 fit (long rows, p > 1) asked for the float32 Gram, update
    and tensor-core kernels too: eight compiles that never ran, under the compile lock."""
    from cumf_dask.backend import cupy_backend

    asked, real = [], cupy_backend.kernels

    def kernels(*args, **kwargs):
        asked.append(args[3])  # the element type
        return real(*args, **kwargs)

    monkeypatch.setattr(cupy_backend, "kernels", kernels)
    cupy_backend.CupyBackend(precision="bfloat16").prepare(32)  # rehearses a long row too
    assert set(asked) == {"bf16"}


def test_page_locked_memory_running_out_is_a_device_memory_error():
    """cudaHostAlloc's failure (CUDARuntimeError, cudaErrorMemoryAllocation) was re-raised as
    it was: a traceback and exit 1 instead of DeviceMemoryError and exit 4. It is a
    HostMemoryError: the plan suggested for it keeps R and the factors off host memory."""
    import cupy as cp

    from cumf_dask.backend.cupy_backend import pinned_empty
    from cumf_dask.errors import HostMemoryError, is_out_of_memory

    with pytest.raises(cp.cuda.runtime.CUDARuntimeError) as raw:
        cp.cuda.PinnedMemory(1 << 50)  # 1 PiB: fails at once, locks nothing
    assert is_out_of_memory(raw.value)
    for pooled in (False, True):
        with pytest.raises(HostMemoryError, match=r"page-locked host memory.*plan\.blocks"):
            pinned_empty((1 << 50,), np.uint8, pooled=pooled)


def test_an_abbreviated_gpu_uuid_in_cuda_visible_devices_is_found(monkeypatch):
    """CUDA accepts a UUID's first characters (GPU-xxxxxxxx); NVML wants the whole one, and
    gpu_memories() raised NVMLError_NotFound: plan and train crashed."""
    import pynvml

    from cumf_dask import devices

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        uuid, total = pynvml.nvmlDeviceGetUUID(handle), pynvml.nvmlDeviceGetMemoryInfo(handle)
    finally:
        pynvml.nvmlShutdown()
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 1)  # not the cached count
    for entry in (uuid[:12], uuid):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", entry)
        assert devices.gpu_memories() == [int(total.total)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-zzzz")
    with pytest.raises(ConfigError, match="GPU-zzzz"):
        devices.gpu_memories()
