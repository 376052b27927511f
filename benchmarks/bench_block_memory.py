"""Peak host memory of loading one block of R on the CPU, per rating (the planner counts 12 B).

    python benchmarks/bench_block_memory.py                # 200,000 x 20,000, 4M ratings
    python benchmarks/bench_block_memory.py --nnz 20000000

Builds two stores of the same ratings in a temporary folder: one of many row bands (4,096
rows each) and one of a single band, and loads the whole row block, and the block of half
the columns, of each with ``engine.tasks.load_block`` (NumPy backend). The peak is what
Python's allocators hand out during the load (tracemalloc: NumPy's arrays included, counted
when allocated, touched or not), median of --repeats loads after a warm-up one.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import tracemalloc
from pathlib import Path

from cumf_dask.data.planted import PlantedModel
from cumf_dask.data.store import RatingsStore
from cumf_dask.data.synthetic import generate
from cumf_dask.engine.tasks import load_block


def peak_bytes(store: RatingsStore, cols: tuple[int, int], threads: int) -> tuple[int, int]:
    """(peak bytes, ratings) of loading rows [0, m) x `cols` of the training ratings."""
    tracemalloc.start()
    try:
        block = load_block(store, "row", "train", (0, store.m), cols, "numpy", threads)
        return tracemalloc.get_traced_memory()[1], int(block.values.size)
    finally:
        tracemalloc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=200_000)
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--nnz", type=int, default=4_000_000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = PlantedModel.create(m=args.m, n=args.n, nnz=args.nnz, seed=0)
    print(f"device: CPU (NumPy backend), {args.threads} threads per load")
    print(f"shape: {args.m:,} x {args.n:,}, {args.nnz:,} ratings (10% held out)")
    with tempfile.TemporaryDirectory(prefix="bench-block-memory-") as folder:
        for bands, tile_rows in (("many bands", 4096), ("one band", args.m)):
            url = str(Path(folder) / f"{tile_rows}.zarr")
            store = generate(url, model, tile_rows=tile_rows)
            for cols in ((0, store.n), (0, store.n // 2)):
                peak_bytes(store, cols, args.threads)  # warm-up: imports, layouts, caches
                runs = [peak_bytes(store, cols, args.threads) for _ in range(args.repeats)]
                peak, ratings = statistics.median(r[0] for r in runs), runs[0][1]
                print(f"{bands} ({tile_rows:,} rows), columns {cols}: {ratings:,} ratings, "
                      f"peak {peak / 1e6:.1f} MB = {peak / ratings:.1f} B/rating "
                      f"({peak / ratings / 12:.2f}x the planner's 12 B)")  # fmt: skip


if __name__ == "__main__":
    main()
