"""Where a host-tier task's time goes: one task of each half-step with R (and the solved
factor) in pinned host memory, against the bus it has to cross.

    python3 benchmarks/bench_host_tier.py [--preset facebook-0.01] [--factors 16]

On one GPU, fresh random blocks with the shape of one task of the plan that
``bench_billion.py --preset facebook --scale 0.01 --plan memory_budget=6GB,factors=host``
makes (update Theta: 810,414 items x a part of 7.9M users, 14M ratings; update X: 16.9M users
x 4.8M items, 180M ratings). Each task's wall seconds (median of --repeats, the GPU idle
before and drained after) beside its phases, each timed alone on data already in place:

* copy: the block's CSR from pinned host memory to the GPU (the bus: its rate is the ceiling
  printed first, a 1 GiB pinned copy);
* packed sums: update Theta's partial Hermitians of the block added in place to the
  batch's sums (``tasks.hermitian_sums``), in parentheses the same by an f x f A that is
  packed and then added (not counted in the phases);
* update, check + copy out: update X's solve of the batch, and ``_kept`` (finite check, then
  the rows copied to pinned host memory).

The ratio "task / (copy + compute phases)" above 1 is time the task spends on neither (host
work, waits on the GPU between launches); "task / copy" is how far it is from the bus.
Tasks here copy their block themselves, as the engine's do for blocks under 256 MB; bigger
ones (update X's) are copied by a task of their own while the block before computes
(``tasks.staged_copy``), which only a whole fit shows (``bench_billion.py --profile``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {
    # name: {side: (rows, cols, nnz)}, one task of each half-step
    "facebook-0.01": {
        "theta": (810_414, 7_903_979, 14_000_000),
        "x": (16_915_447, 4_800_000, 180_000_000),
    },
}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="facebook-0.01", choices=sorted(SHAPES))
    parser.add_argument("--factors", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    return parser.parse_args()


if __name__ == "__main__":
    ARGS = arguments()  # --help and bad options answer before CuPy is imported

from cumf_dask.backend.cupy_backend import CupyBackend, pinned_copy
from cumf_dask.backend.objective import as_spec
from cumf_dask.blocks import Block
from cumf_dask.compat import import_cupy
from cumf_dask.engine import tasks

cp = import_cupy()


def wall(fn, repeats: int) -> float:
    """Median seconds of fn() from an idle GPU until the GPU has finished it."""
    fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def host_block(n_rows: int, n_cols: int, nnz: int, seed: int) -> Block:
    """A CSR block in pinned host memory: log-normal row degrees (sigma 1), uniform columns,
    sorted within each row, ratings in [1, 5)."""
    rng = np.random.default_rng(seed)
    deg = rng.lognormal(0.0, 1.0, n_rows)
    deg = np.maximum(np.round(deg * nnz / deg.sum()), 0).astype(np.int64)
    indptr = np.concatenate([[0], np.cumsum(deg)])
    total = int(indptr[-1])
    rs = cp.random.RandomState(seed)
    rows = cp.repeat(cp.arange(n_rows, dtype=cp.int64), cp.asarray(deg))
    key = rows * n_cols + rs.randint(0, n_cols, total, dtype=cp.int64)
    del rows
    key.sort()
    indices = cp.asnumpy((key % n_cols).astype(cp.int32))
    del key
    values = cp.asnumpy(rs.uniform(1, 5, total).astype(cp.float32))
    cp.get_default_memory_pool().free_all_blocks()
    return Block(pinned_copy(indptr), pinned_copy(indices), pinned_copy(values),
                 0, 0, n_rows, n_cols)  # fmt: skip


def nbytes(block: Block) -> int:
    return block.indptr.nbytes + block.indices.nbytes + block.values.nbytes


def bus_rate() -> float:
    """Bytes per second of a 1 GiB copy from pinned host memory to the GPU."""
    src = pinned_copy(np.ones(1 << 28, np.float32))
    dst = cp.empty(src.shape, cp.float32)
    return src.nbytes / wall(lambda: dst.set(src), 5)


def whole(fixed: cp.ndarray) -> tuple[int, int, list]:
    """All rows of a fixed factor as the tasks take them (``tasks.rows_from``)."""
    return 0, len(fixed), [(0, len(fixed), fixed)]


def bench_theta(be: CupyBackend, block: Block, f: int, repeats: int) -> dict[str, float]:
    fixed = cp.random.random((block.n_cols, f), dtype=cp.float32)
    on_device = be.block_to_device(block)
    sums = tasks.hermitian_sums(on_device, whole(fixed), "cupy")

    A, B = be.hermitian(on_device, fixed)
    P = be.pack(A)
    diff = float(cp.linalg.norm(sums[0] - P) / cp.linalg.norm(P))
    print(f"packed sums vs f x f A packed: relative difference {diff:.2e}")
    assert diff < 1e-6 and bool(cp.array_equal(sums[1], B)), "packed sums differ"
    del A, B, P

    def unpacked() -> None:  # what the task did before the kernels wrote packed sums
        A, B = be.hermitian(on_device, fixed)
        sums[0][...] += be.pack(A)
        sums[1][...] += B

    return {
        "task": wall(lambda: tasks.hermitian_sums(block, whole(fixed), "cupy", into=sums), repeats),
        "copy": wall(lambda: be.block_to_device(block), repeats),
        "packed sums": wall(lambda: be.packed_hermitian(on_device, fixed, into=sums), repeats),
        "(hermitian + pack + sum)": wall(unpacked, repeats),
    }


def bench_x(be: CupyBackend, block: Block, f: int, repeats: int) -> dict[str, float]:
    fixed = cp.random.random((block.n_cols, f), dtype=cp.float32)
    spec = as_spec(0.05)
    counts = cp.diff(cp.asarray(block.indptr))
    on_device = be.block_to_device(block)
    X = be.update(on_device, fixed, counts, spec)
    rows = whole(fixed)
    return {
        "task": wall(lambda: tasks.update(block, rows, counts, spec, "cupy", host=True), repeats),
        "copy": wall(lambda: be.block_to_device(block), repeats),
        "update": wall(lambda: be.update(on_device, fixed, counts, spec), repeats),
        "check + copy out": wall(lambda: tasks._kept(be, X, True, 0), repeats),
    }


def main(args: argparse.Namespace) -> None:
    be = CupyBackend()
    rate = bus_rate()
    print(f"device {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; "
          f"pinned host -> GPU {rate / 1e9:.1f} GB/s (1 GiB); f = {args.factors}")  # fmt: skip
    print(f"{'task':<14}{'shape':>28}{'MB':>8}{'task s':>9}{'phases s':>10}"
          f"{'task/phases':>12}{'task/copy':>10}  phases")  # fmt: skip
    for side, bench in (("theta", bench_theta), ("x", bench_x)):
        n_rows, n_cols, nnz = SHAPES[args.preset][side]
        block = host_block(n_rows, n_cols, nnz, seed=7)
        times = bench(be, block, args.factors, args.repeats)
        phases = {k: v for k, v in times.items() if k != "task"}
        total = sum(v for k, v in phases.items() if not k.startswith("("))
        shape = f"{n_rows:,} x {n_cols:,}"
        print(f"{'update ' + side:<14}{shape:>28}{nbytes(block) / 1e6:>8.0f}"
              f"{times['task']:>9.4f}{total:>10.4f}{times['task'] / total:>12.2f}"
              f"{times['task'] / phases['copy']:>10.2f}  "
              + ", ".join(f"{k} {v:.4f}" for k, v in phases.items()))  # fmt: skip
        del block
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main(ARGS)
