"""Benchmark of the CuPy backend's kernels on one GPU; prints a table last, writes JSON.

    python benchmarks/bench_kernels.py [--quick] [--json results.json]
        [--precision float32 [bfloat16]]

In one process, with CUDA events (warm-up first, median of repeats) on fresh random data:

* ceilings: device-to-device copy (bytes read + written) and FP32 SGEMM (8192^3, no TF32);
* solve: own batched Cholesky vs cuSOLVER potrf/potrsBatched (``cupyx.lapack.posv``, which
  also copies A once) vs ``cupy.linalg.solve`` (batched LU), f = 10..256, with the error
  against a float64 solve;
* hermitian (A, B stored) and fused update on synthetic blocks with the shape and skewed degrees of
  Netflix (480,189 x 17,770, 99M ratings), YahooMusic (1,000,990 x 624,961, 253M) and a
  Hugewiki slice (2M of its 50M users x 39,780 items, 62 ratings per user), f = 100, for the
  X side (users' rows, Theta fixed) and the Theta side (items' rows, X fixed). Degrees are
  log-normal, capped near the real maxima; columns are drawn in proportion to the other
  side's degrees. Each side's update is checked against the NumPy backend on sampled rows
  (the heaviest included).
* ``--precision``: the fixed factor's storage, float32 (default) and/or bfloat16, on the same
  blocks; bfloat16 adds the time of ``prepare_fixed`` (rounding and packing the factor) and is
  checked against the NumPy backend's bfloat16 emulation and the float64 solve from the
  unrounded factor.

Short rows (fewer ratings than 24, 40, 56 or 72, and than f) take the push-through identity
(``dual_update_kernel``); the column "no dual" times the same update without it.

Hermitian work is counted as f(f+1)/2 multiply-adds per rating (the lower triangle of
theta theta^T; B's f per rating not counted), i.e. nnz * f * (f + 1) flop. The Gram stage
inside the fused update (A never stored) is timed by difference: the rows the fused kernel
takes, as they are, minus the same rows with one rating each (same Cholesky).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="Netflix only, fewer solve sizes")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--profile", action="store_true", help="one call of each kernel (for ncu)")
    ap.add_argument(
        "--precision",
        nargs="+",
        default=["float32"],
        choices=["float32", "bfloat16"],
        help="storage precision(s) of the fixed factor to measure",
    )
    return ap.parse_args()


if __name__ == "__main__":
    ARGS = arguments()  # --help and bad options answer before CuPy is imported

from cumf_dask.backend.cupy_backend import CupyBackend
from cumf_dask.backend.numpy_backend import NumpyBackend
from cumf_dask.compat import import_cupy
from cumf_dask.data.store import Block

cp = import_cupy()
LAM = 0.05
SHAPES = {
    # name: (rows, cols, nnz, (sigma, cap) of row degrees, (sigma, cap) of column degrees)
    "netflix": (480_189, 17_770, 99_000_000, (1.2, 17_653), (2.0, 232_944)),
    "yahoomusic": (1_000_990, 624_961, 252_800_275, (1.3, 150_000), (2.0, 400_000)),
    "hugewiki-2M": (2_000_000, 39_780, 124_000_000, (1.0, 20_000), (2.0, 3_000_000)),
}


def timeit(fn, repeats=5, warmup=1) -> dict[str, float]:
    """Median, min and max seconds of fn() between CUDA events."""
    for _ in range(warmup):
        fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return {"median": float(np.median(times)), "min": min(times), "max": max(times)}


def free() -> None:
    cp.get_default_memory_pool().free_all_blocks()


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ---------------------------------------------------------------------------- ceilings
def ceilings() -> dict:
    x = cp.random.random(1 << 28, dtype=cp.float32)  # 1 GiB
    y = cp.empty_like(x)
    t_copy = timeit(lambda x=x, y=y: cp.copyto(y, x), repeats=10)
    n = 8192
    a = cp.random.random((n, n), dtype=cp.float32)
    b = cp.random.random((n, n), dtype=cp.float32)
    t_gemm = timeit(lambda a=a, b=b: a @ b, repeats=10)
    del x, y, a, b
    free()
    return {
        "copy_TBps": 2 * (1 << 30) / t_copy["median"] / 1e12,
        "sgemm_TFLOPs": 2 * n**3 / t_gemm["median"] / 1e12,
        "cupy_tf32": os.environ.get("CUPY_TF32", "0"),
    }


# ---------------------------------------------------------------------------- solve
def bench_solve(be: CupyBackend, fs) -> list[dict]:
    import cupyx.lapack

    be576 = CupyBackend(threads_per_sm=576)
    out = []
    for f in fs:
        n = int(min(100_000, 1.5e9 // (f * f * 4)))
        R = cp.random.standard_normal((n, f, f), dtype=cp.float32)
        A = cp.matmul(R, R.transpose(0, 2, 1)) / f  # SPD, full
        del R
        B = cp.random.standard_normal((n, f), dtype=cp.float32)
        counts = cp.ones(n, cp.int64)
        full = A + LAM * cp.eye(f, dtype=cp.float32)
        ours = timeit(lambda A=A, B=B, c=counts: be.solve(A, B, c, LAM))
        ours576 = timeit(lambda A=A, B=B, c=counts: be576.solve(A, B, c, LAM))
        cus = timeit(lambda full=full, B=B: cupyx.lapack.posv(full, B))
        lu = timeit(lambda full=full, B=B: cp.linalg.solve(full, B[..., None]))
        k = min(n, 2000)
        ref = cp.linalg.solve(full[:k].astype(cp.float64), B[:k, :, None].astype(cp.float64))
        err = rel(cp.asnumpy(be.solve(A[:k], B[:k], counts[:k], LAM)), cp.asnumpy(ref[..., 0]))
        err_cus = rel(cp.asnumpy(cupyx.lapack.posv(full[:k], B[:k])), cp.asnumpy(ref[..., 0]))
        out.append(
            {
                "f": f,
                "systems": n,
                "ours_per_s": n / ours["median"],
                "ours_threads576_per_s": n / ours576["median"],
                "cusolver_per_s": n / cus["median"],
                "cupy_solve_per_s": n / lu["median"],
                "err_ours": err,
                "err_cusolver": err_cus,
            }
        )
        print("solve", out[-1], flush=True)
        del A, B, full, ref
        free()
    return out


# ---------------------------------------------------------------------------- data
def degrees(n: int, total: int, sigma: float, cap: int, rng) -> np.ndarray:
    """n log-normal degrees summing to about `total`, each in [1, cap]."""
    d = rng.lognormal(0.0, sigma, n)
    d *= total / d.sum()
    for _ in range(50):
        d = np.minimum(d, cap)
        d *= total / d.sum()
    return np.clip(np.round(d), 1, cap).astype(np.int64)


def synth_block(row_deg: np.ndarray, col_weight: np.ndarray, seed: int) -> Block:
    """CSR with the given row degrees, columns drawn in proportion to col_weight, sorted."""
    rs = cp.random.RandomState(seed)
    n_rows, n_cols = row_deg.size, col_weight.size
    indptr = cp.asarray(np.concatenate([[0], np.cumsum(row_deg)]))
    nnz = int(indptr[-1])
    cdf = cp.asarray(np.cumsum(col_weight / col_weight.sum()))
    cols = cp.minimum(cp.searchsorted(cdf, rs.random_sample(nnz)), n_cols - 1)
    del cdf
    rows = cp.searchsorted(indptr, cp.arange(nnz, dtype=cp.int64), side="right") - 1
    key = rows * n_cols + cols
    del rows, cols
    key.sort()
    indices = (key % n_cols).astype(cp.int32)
    del key
    values = rs.uniform(1, 5, nnz).astype(cp.float32)
    free()
    return Block(indptr, indices, values, 0, 0, n_rows, n_cols)


def sub_block(block: Block, rows: np.ndarray) -> Block:
    """Host CSR of some rows of a device block (all columns)."""
    indptr = cp.asnumpy(block.indptr)
    lo, hi = indptr[rows], indptr[rows + 1]
    take = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi, strict=True)])
    sub_ptr = np.concatenate([[0], np.cumsum(hi - lo)])
    idx = cp.asarray(take)
    return Block(sub_ptr, cp.asnumpy(block.indices[idx]), cp.asnumpy(block.values[idx]),
                 0, 0, rows.size, block.n_cols)  # fmt: skip


def rows_block(block: Block, rows, first_only: bool = False) -> Block:
    """Device CSR of some rows of a device block (all columns); with first_only, each row
    keeps just its first rating."""
    lo = block.indptr[rows]
    deg = cp.ones_like(lo) if first_only else block.indptr[rows + 1] - lo
    ptr = cp.concatenate([cp.zeros(1, cp.int64), cp.cumsum(deg)])
    pos = cp.arange(int(ptr[-1]), dtype=cp.int64)
    owner = cp.searchsorted(ptr, pos, side="right") - 1
    take = lo[owner] + pos - ptr[owner]
    return Block(ptr, block.indices[take], block.values[take], 0, 0, rows.size, block.n_cols)


def fused_gram(be: CupyBackend, block: Block, fixed) -> dict[str, float]:
    """The Gram stage inside the fused update, by difference: the rows the fused kernel
    takes (up to long_row ratings) updated as they are, minus the same rows with one
    rating each (the same Cholesky and per-row work, almost no Gram). `be` keeps short rows
    on the fused kernel (``dual_sizes=()``)."""
    deg = cp.diff(block.indptr)
    rows = cp.flatnonzero((deg > 0) & (deg <= be.long_row))
    whole, single = rows_block(block, rows), rows_block(block, rows, first_only=True)
    counts = deg[rows]
    t_whole = timeit(lambda: be.update(whole, fixed, counts, LAM))["median"]
    t_single = timeit(lambda: be.update(single, fixed, counts, LAM))["median"]
    f = fixed.shape[1]
    gram_s = t_whole - t_single
    return {"rows": int(rows.size), "nnz": whole.nnz, "update_s": t_whole,
            "one_rating_s": t_single, "gram_s": gram_s,
            "gram_TFLOPs": (whole.nnz - rows.size) * f * (f + 1) / gram_s / 1e12}  # fmt: skip


def check_rows(X, block: Block, fixed, n_sample: int, rng, precision: str) -> dict[str, float]:
    """Relative differences on sampled rows (the 3 heaviest included): GPU vs the NumPy
    backend at the same precision, GPU vs a float64 solve from the float32 factor, NumPy
    backend vs the float64 solve."""
    deg = cp.asnumpy(cp.diff(block.indptr))
    rows = np.unique(np.concatenate([np.argsort(deg)[-3:], rng.choice(deg.size, n_sample)]))
    sub = sub_block(block, rows)
    fixed = cp.asnumpy(fixed)
    cpu = NumpyBackend(precision=precision)
    ref32 = cpu.update(sub, cpu.prepare_fixed(fixed), deg[rows], LAM)
    ref64 = np.zeros(ref32.shape)
    for i in range(rows.size):
        lo, hi = sub.indptr[i], sub.indptr[i + 1]
        G = fixed[sub.indices[lo:hi]].astype(np.float64)
        A = G.T @ G + LAM * (hi - lo) * np.eye(G.shape[1])
        ref64[i] = np.linalg.solve(A, G.T @ sub.values[lo:hi].astype(np.float64))
    got = cp.asnumpy(X[cp.asarray(rows)])
    return {"gpu_vs_numpy": rel(got, ref32), "gpu_vs_f64": rel(got, ref64),
            "numpy_vs_f64": rel(ref32, ref64)}  # fmt: skip


def bench_side(block: Block, fixed, precision: str, variants: bool, n_sample: int, rng) -> dict:
    """Update (and hermitian) of one side's block at one storage precision of the fixed factor."""
    f = fixed.shape[1]
    be = CupyBackend(precision=precision)
    stored = be.prepare_fixed(fixed)
    counts = cp.diff(block.indptr)
    flop = float(block.nnz) * f * (f + 1)
    r = {"precision": precision, "nnz": block.nnz, "max_degree": int(counts.max())}
    r["prepare_s"] = timeit(lambda x=fixed: be.prepare_fixed(x))["median"]
    X = be.update(block, stored, counts, LAM)
    r["err"] = check_rows(X, block, fixed, n_sample, rng, precision)
    del X
    t = timeit(lambda b=block, x=stored, c=counts: be.update(b, x, c, LAM))
    r["update_s"], r["update_spread"] = t["median"], (t["min"], t["max"])
    r["update_TFLOPs"] = flop / t["median"] / 1e12
    primal = CupyBackend(precision=precision, dual_sizes=())  # every row on the f x f system
    r["fused"] = fused_gram(primal, block, stored)
    t = timeit(lambda b=block, x=stored, c=counts: primal.update(b, x, c, LAM))
    r["update_primal_s"] = t["median"]
    if variants:
        for key, other in (
            ("update_threads576_s", CupyBackend(threads_per_sm=576)),
            ("update_long_row_2048_s", CupyBackend(long_row=2048)),
            ("update_long_row_16384_s", CupyBackend(long_row=16384)),
        ):
            r[key] = timeit(lambda o=other, b=block, x=stored, c=counts: o.update(b, x, c, LAM))[
                "median"
            ]
    # hermitian alone (and unfused hermitian + solve) on the rows whose A fits 4 GB
    k = min(block.n_rows, int(4e9 // (f * f * 4)))
    e = int(block.indptr[k])
    part = Block(block.indptr[: k + 1], block.indices[:e], block.values[:e], 0, 0, k,
                 block.n_cols)  # fmt: skip
    th = timeit(lambda p=part, x=stored: be.hermitian(p, x), repeats=3)
    r["hermitian_rows"], r["hermitian_s"] = k, th["median"]
    if variants:
        other = CupyBackend(threads_per_sm=576)
        r["hermitian_threads576_s"] = timeit(
            lambda o=other, p=part, x=stored: o.hermitian(p, x), repeats=3
        )["median"]
    r["hermitian_TFLOPs"] = float(e) * f * (f + 1) / th["median"] / 1e12
    A, B = be.hermitian(part, stored)
    ts = timeit(lambda A=A, B=B, c=counts[:k]: be.solve(A, B, c, LAM), repeats=3)
    tu = timeit(lambda p=part, x=stored, c=counts[:k]: be.update(p, x, c, LAM), repeats=3)
    r["part_solve_s"], r["part_update_s"] = ts["median"], tu["median"]
    del A, B, part, stored
    free()
    return r


def bench_shape(name: str, f: int, rng, variants: bool, precisions=("float32",)) -> dict:
    """Both sides of one shape; res[side][precision] per precision, on the same blocks."""
    m, n, nnz, (su, cu), (si, ci) = SHAPES[name]
    du, di = degrees(m, nnz, su, cu, rng), degrees(n, nnz, si, ci, rng)
    res = {"shape": name, "f": f, "m": m, "n": n}
    for side, row_deg, col_deg in (("X", du, di), ("Theta", di, du)):
        block = synth_block(row_deg, col_deg.astype(np.float64), int(rng.integers(1 << 30)))
        fixed = cp.random.random((block.n_cols, f), dtype=cp.float32) / np.float32(np.sqrt(f))
        res[side] = {}
        for p in precisions:
            res[side][p] = bench_side(block, fixed, p, variants, 300 if side == "X" else 60, rng)
            print(name, side, res[side][p], flush=True)
        del block, fixed
        free()
    res["iteration_s"] = {p: res["X"][p]["update_s"] + res["Theta"][p]["update_s"]
                          for p in precisions}  # fmt: skip
    return res


def profile() -> None:
    """One call each of update, hermitian and solve on a Netflix-shaped X-side slice (for ncu)."""
    rng = np.random.default_rng(0)
    m, n, nnz, (su, cu), (si, ci) = SHAPES["netflix"]
    rows = 60_000
    du, di = degrees(m, nnz, su, cu, rng)[:rows], degrees(n, nnz, si, ci, rng)
    block = synth_block(du, di.astype(np.float64), 1)
    fixed = cp.random.random((n, 100), dtype=cp.float32) / np.float32(10)
    counts = cp.diff(block.indptr)
    be = CupyBackend()
    be.update(block, fixed, counts, LAM)
    A, B = be.hermitian(block, fixed)
    be.solve(A, B, counts, LAM)
    cp.cuda.Device().synchronize()


# ---------------------------------------------------------------------------- main
def main(args: argparse.Namespace) -> None:
    if args.profile:
        profile()
        return
    rng = np.random.default_rng()
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    results = {"device": props["name"].decode(), "cupy": cp.__version__}
    results["ceilings"] = ceilings()
    print("ceilings", results["ceilings"], flush=True)
    be = CupyBackend()
    t0 = time.perf_counter()
    be._kernels(100)
    results["kernels_first_call_f100_s"] = time.perf_counter() - t0  # compile or CuPy cache
    fs = [32, 100, 256] if args.quick else [10, 32, 64, 100, 128, 200, 256]
    results["solve"] = bench_solve(be, fs)
    shapes = ["netflix"] if args.quick else list(SHAPES)
    results["shapes"] = []
    for name in shapes:
        results["shapes"].append(
            bench_shape(name, 100, rng, variants=name == "netflix", precisions=args.precision)
        )
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))

    c = results["ceilings"]
    print(f"\n{results['device']}  copy {c['copy_TBps']:.2f} TB/s  "
          f"SGEMM {c['sgemm_TFLOPs']:.1f} TFLOP/s (CUPY_TF32={c['cupy_tf32']})")  # fmt: skip
    print("| f | systems | own solve /s | cuSOLVER batched /s | cupy.linalg.solve /s | err own |")
    for s in results["solve"]:
        print(f"| {s['f']} | {s['systems']} | {s['ours_per_s']:.3g} | {s['cusolver_per_s']:.3g} "
              f"| {s['cupy_solve_per_s']:.3g} | {s['err_ours']:.1e} |")  # fmt: skip
    print("| shape | side | precision | nnz | update s | no dual s | prepare s | update TFLOP/s "
          "| hermitian TFLOP/s | fused Gram TFLOP/s | err vs NumPy "
          "| err vs f64 (NumPy's) |")  # fmt: skip
    for res in results["shapes"]:
        for side in ("X", "Theta"):
            for p, r in res[side].items():
                err = r["err"]
                print(f"| {res['shape']} | {side} | {p} | {r['nnz']} | {r['update_s']:.4f} "
                      f"| {r['update_primal_s']:.4f} | {r['prepare_s']:.4f} "
                      f"| {r['update_TFLOPs']:.1f} "
                      f"| {r['hermitian_TFLOPs']:.1f} | {r['fused']['gram_TFLOPs']:.1f} "
                      f"| {err['gpu_vs_numpy']:.1e} "
                      f"| {err['gpu_vs_f64']:.1e} ({err['numpy_vs_f64']:.1e}) |")  # fmt: skip
        for p, t in res["iteration_s"].items():
            print(f"| {res['shape']} | iteration (both updates) | {p} | | {t:.4f} | | | | | | | |")


if __name__ == "__main__":
    main(ARGS)
