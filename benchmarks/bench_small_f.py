"""Small f on one GPU: one thread per row (row_update_kernel) against one block per row.

    python benchmarks/bench_small_f.py [--scale 0.125] [--factors 5 10 16] [--json out.json]

A SparkALS-shaped problem (660M x 2.4M, 3.5B ratings at scale 1; rows and ratings scaled
by --scale, columns kept) as synthetic CSR blocks on the GPU, log-normal degrees as in
bench_kernels.py. For each f, both sides' ``update`` are timed (CUDA events, median of
repeats) with the row-per-thread kernel and with the tiled one (SMALL_F set to 0, as before
it), and on the Theta side also ``hermitian`` (A, B stored: the data-parallel plans' Gram);
checked against the NumPy backend and a float64 solve on sampled rows. Prints a table
last: seconds per update, the speedup, and the bytes the update must read (CSR plus one
fixed-factor row per rating) per second as a share of the copy ceiling.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=0.125)
    ap.add_argument("--factors", type=int, nargs="+", default=[5, 10, 16])
    ap.add_argument("--json")
    return ap.parse_args()


if __name__ == "__main__":
    ARGS = arguments()  # --help and bad options answer before CuPy is imported

from bench_kernels import LAM, check_rows, degrees, free, synth_block, timeit

from cumf_dask.backend import cupy_backend
from cumf_dask.backend.cupy_backend import CupyBackend
from cumf_dask.compat import import_cupy

cp = import_cupy()
SPARKALS = (660_000_000, 2_400_000, 3_500_000_000)
SMALL_F = cupy_backend.SMALL_F


def run(block, fixed, row_kernel: bool, what: str = "update") -> float:
    """Median seconds of one update (or hermitian), with the row-per-thread kernels or the
    tiled ones."""
    cupy_backend.SMALL_F = SMALL_F if row_kernel else 0
    be = CupyBackend()
    counts = cp.diff(block.indptr)
    call = {
        "update": lambda: be.update(block, fixed, counts, LAM),
        "hermitian": lambda: be.hermitian(block, fixed),
    }[what]
    try:
        return timeit(call, repeats=5)["median"]
    finally:
        cupy_backend.SMALL_F = SMALL_F


def copy_rate() -> float:
    """Bytes read plus written per second by a 1 GiB device-to-device copy."""
    x = cp.empty(1 << 28, cp.float32)
    y = cp.empty_like(x)
    t = timeit(lambda x=x, y=y: cp.copyto(y, x), repeats=5)["median"]
    del x, y
    free()
    return 2 * (1 << 30) / t


def main(args: argparse.Namespace) -> None:
    rng = np.random.default_rng()
    m, n, nnz = (int(SPARKALS[0] * args.scale), SPARKALS[1], int(SPARKALS[2] * args.scale))
    props = cp.cuda.runtime.getDeviceProperties(0)
    ceiling = copy_rate()
    print(f"{props['name'].decode()}: SparkALS x {args.scale:g} = {m:,} x {n:,}, {nnz:,} "
          f"ratings; copy ceiling {ceiling / 1e12:.2f} TB/s", flush=True)  # fmt: skip
    du, di = degrees(m, nnz, 1.0, 2_000, rng), degrees(n, nnz, 2.0, nnz // 50, rng)
    rows = []
    for side, row_deg, col_deg in (("X", du, di), ("Theta", di, du)):
        block = synth_block(row_deg, col_deg.astype(np.float64), int(rng.integers(1 << 30)))
        for f in args.factors:
            fixed = cp.random.random((block.n_cols, f), dtype=cp.float32) / np.float32(np.sqrt(f))
            needed = block.nnz * (8 + 4 * f) + block.n_rows * (8 + 4 * f)
            tiled, row = run(block, fixed, False), run(block, fixed, True)
            rows.append({"side": side, "f": f, "row_s": row, "tiled_s": tiled,
                         "speedup": tiled / row, "read_share": needed / row / ceiling})  # fmt: skip
            if side == "Theta":  # A of every row fits: the data-parallel plans' Gram
                tiled, row = (run(block, fixed, k, "hermitian") for k in (False, True))
                rows[-1].update(row_herm_s=row, tiled_herm_s=tiled)
            print(rows[-1], flush=True)
            be = CupyBackend()
            X = be.update(block, fixed, cp.diff(block.indptr), LAM)
            err = check_rows(X, block, fixed, 300, rng, "float32")
            rows.append({"side": side, "f": f, "check": err})
            print(rows[-1], flush=True)
            del X, fixed
            free()
        del block
        free()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print("\n| side | f | update: row kernel s | tiled s | speedup | of copy rate | hermitian: "
          "row s | tiled s | rel. err vs NumPy, vs f64 (NumPy's) |")  # fmt: skip
    for r, c in zip(rows[::2], rows[1::2], strict=True):
        e = c["check"]
        herm = (f"{r['row_herm_s']:.4f} | {r['tiled_herm_s']:.4f}" if "row_herm_s" in r
                else " | ")  # fmt: skip
        err = f"{e['gpu_vs_numpy']:.1e}, {e['gpu_vs_f64']:.1e} ({e['numpy_vs_f64']:.1e})"
        print(f"| {r['side']} | {r['f']} | {r['row_s']:.4f} | {r['tiled_s']:.4f} "
              f"| {r['speedup']:.1f}x | {r['read_share']:.0%} | {herm} | {err} |")  # fmt: skip


if __name__ == "__main__":
    main(ARGS)
