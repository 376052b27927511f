"""Benchmark ingest_arrays: ratings per second from in-memory arrays into a store.

    python benchmarks/bench_ingest.py                    # 200,000 x 20,000, 5M ratings
    python benchmarks/bench_ingest.py --nnz 50000000 --m 2000000 --n 50000

Random distinct (user, item) pairs with ratings 1..5, ingested twice per repeat: with
``shape`` (ids used as indices) and without (ids mapped in order of first appearance); 10%
held out, as ``cumf-dask ingest`` does. Prints the device, the shape, the median of the
repeats, and its ratio to the time of one single-threaded NumPy argsort of as many int64
keys, timed first in the same process (each band is sorted once).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from device import cpu_name

from cumf_dask.data.ingest import ingest_arrays


def distinct_pairs(m: int, n: int, nnz: int, seed: int) -> tuple[np.ndarray, ...]:
    """About nnz distinct random (user, item) pairs, in random order, ratings 1..5."""
    rng = np.random.default_rng(seed)
    key = np.unique(rng.integers(0, m * n, int(nnz * 1.02)))[:nnz]
    key = key[rng.permutation(key.size)]
    return key // n, key % n, rng.integers(1, 6, key.size).astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", type=int, default=200_000)
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--nnz", type=int, default=5_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the store (default: /tmp)")
    args = parser.parse_args()
    users, items, ratings = distinct_pairs(args.m, args.n, args.nnz, seed=0)
    print(f"device: {cpu_name()}")
    print(f"shape: {args.m:,} x {args.n:,}, {ratings.size:,} ratings")
    start = time.perf_counter()
    np.argsort(users * args.n + items)
    sort = time.perf_counter() - start
    print(f"the peer: one argsort of {ratings.size:,} int64 keys on one thread: {sort:.2f} s")
    workdir = Path(tempfile.mkdtemp(prefix="bench-ingest-", dir=args.dir))
    try:
        for label, shape in (("ids as indices", (args.m, args.n)), ("ids mapped", None)):
            times = []
            for _ in range(args.repeats):
                url = str(workdir / "r.zarr")
                start = time.perf_counter()
                ingest_arrays(url, users, items, ratings, shape, overwrite=True)
                times.append(time.perf_counter() - start)
                shutil.rmtree(url, ignore_errors=True)
            median = statistics.median(times)
            print(f"{label}: median {median:.2f} s of {args.repeats} "
                  f"({ratings.size / median / 1e6:.2f} M ratings/s, {median / sort:.1f} x the "
                  "argsort)")  # fmt: skip
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
