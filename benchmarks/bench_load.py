"""Where iteration 1 goes: reading the resident blocks from the store, and compiling kernels.

    python benchmarks/bench_load.py --preset netflix --nnz 99000000 [--gpu]

Times RatingsStore.read_block of the whole matrix in both orientations (what the p = 1,
q = 1 plan loads on its first half-steps; Zarr decode + CSR), median of --repeats, and with
--gpu the first `update` on a small block with an empty CuPy kernel cache (compilation).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
from bench_iteration import get_store

from cumf_dask.blocks import coo_to_block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiplies the preset's nnz, and m and n by sqrt(scale)")
    parser.add_argument("--m", type=int, default=None)
    parser.add_argument("--n", type=int, default=None)
    parser.add_argument("--nnz", type=int, default=None)
    parser.add_argument("--factors", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu", action="store_true", help="also time kernel compilation")
    parser.add_argument("--data", default="/tmp/cumf-bench")
    args = parser.parse_args()
    if args.preset is None:
        args.m, args.n, args.nnz = args.m or 100_000, args.n or 20_000, args.nnz or 5_000_000
    store = get_store(args)
    print(f"store: {store.m:,} x {store.n:,}, {store.nnz:,} ratings")
    for orient, (rows, cols) in (("row", (store.m, store.n)), ("col", (store.n, store.m))):
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            block = store.read_block(orient, (0, rows), (0, cols))
            times.append(time.perf_counter() - t0)
        rate = block.nnz / statistics.median(times) / 1e6
        print(
            f"read_block {orient}: median {statistics.median(times):.2f} s ({rate:.0f} M ratings/s)"
        )
    if args.gpu:
        os.environ["CUPY_CACHE_DIR"] = tempfile.mkdtemp(prefix="cupy-cold-")
        from cumf_dask.backend import get_backend

        be = get_backend("cupy")
        rng = np.random.default_rng(0)
        r, c = rng.integers(0, 100, 5000), rng.integers(0, 200, 5000)
        blk = be.block_to_device(coo_to_block(r, c, np.ones(5000, np.float32), 0, 0, 100, 200))
        fixed = be.asarray(rng.random((200, args.factors), dtype=np.float32))
        counts = be.asarray(np.bincount(r, minlength=100))
        for label in ("cold (compiles)", "warm"):
            t0 = time.perf_counter()
            be.update(blk, fixed, counts, 0.05)
            be.xp.cuda.Device().synchronize()
            print(f"first update, f={args.factors}, {label}: {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
