"""Benchmark a store read over a URL, each request delayed as an object store's would be.

    python benchmarks/bench_remote.py                         # 20 ms per request
    python benchmarks/bench_remote.py --latency 0.05 --nnz 10000000

Builds a store of random ratings (tiles of 16,384 x 2,048: a dozen bands each way) in a
``memory://`` filesystem whose reads (``cat_file``, ``info``) each sleep ``--latency``
seconds, then times whole-block loads (``RatingsStore.read_block``) in both orientations,
median of the repeats, and prints them beside the same loads with no delay (the ratio is
what the round trips cost) and the build's time with its read-backs delayed too.
"""

from __future__ import annotations

import argparse
import statistics
import time

import fsspec
import numpy as np
from device import cpu_name
from fsspec.implementations.memory import MemoryFileSystem

from cumf_dask.data.spill import build_store
from cumf_dask.data.store import RatingsStore


class SlowMemory(MemoryFileSystem):
    """An in-memory filesystem whose reads each wait `latency` seconds (writes do not)."""

    protocol = "slowmem"
    latency = 0.0
    requests = 0

    def cat_file(self, path, start=None, end=None, **kwargs):  # type: ignore[override]
        self._wait()
        return super().cat_file(path, start, end, **kwargs)

    def info(self, path, **kwargs):  # type: ignore[override]
        self._wait()
        return super().info(path, **kwargs)

    @classmethod
    def _wait(cls) -> None:
        cls.requests += 1
        time.sleep(cls.latency)


def load_seconds(store: RatingsStore, orient: str, repeats: int, threads: int) -> float:
    """Median seconds of a whole-block load in `orient`."""
    m, n = store.shape(orient)  # type: ignore[arg-type]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        store.read_block(orient, (0, m), (0, n), threads=threads)  # type: ignore[arg-type]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", type=int, default=200_000)
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--nnz", type=int, default=4_000_000)
    parser.add_argument("--latency", type=float, default=0.02, help="seconds per read request")
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    fsspec.register_implementation("slowmem", SlowMemory, clobber=True)
    rng = np.random.default_rng(0)
    rows, cols = rng.integers(0, args.m, args.nnz), rng.integers(0, args.n, args.nnz)
    vals = rng.integers(1, 6, args.nnz).astype(np.float32)
    url = "slowmem://bench/remote.zarr"
    SlowMemory.latency = args.latency
    t0 = time.perf_counter()
    store = build_store(url, rows, cols, vals, shape=(args.m, args.n), test_fraction=0.1,
                        overwrite=True, duplicates="last", tile_rows=16384,
                        tile_cols=2048)  # fmt: skip
    built, build_requests = time.perf_counter() - t0, SlowMemory.requests
    print(f"device: {cpu_name()}; {args.m:,} x {args.n:,}, {store.nnz:,} training ratings, "
          f"{store.n_row_tiles} row and {store.n_col_tiles} column bands; {args.threads} threads")
    print(f"build: {built:.2f} s with {args.latency * 1e3:g} ms per read ({build_requests:,} "
          "reads)")  # fmt: skip
    for orient in ("row", "col"):
        SlowMemory.latency, SlowMemory.requests = 0.0, 0
        plain = load_seconds(store, orient, args.repeats, args.threads)
        requests = SlowMemory.requests // args.repeats
        SlowMemory.latency = args.latency
        slow = load_seconds(store, orient, args.repeats, args.threads)
        print(f"{orient} block load: {slow:.3f} s with {args.latency * 1e3:g} ms per read, "
              f"{plain:.3f} s without ({slow / plain:.1f}x; {requests} reads, "
              f"{slow / args.latency:.0f} round trips' time)")


if __name__ == "__main__":
    main()
