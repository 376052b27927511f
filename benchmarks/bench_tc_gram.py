"""The Gram of row segments on the tensor cores against the FP32 units: the CuPy backend's
``hermitian`` with and without ``tensor_cores`` (kernels/tensor_gram.cuh), one GPU; prints
a table last.

    python benchmarks/bench_tc_gram.py [--json out.json]

Segments of `seglen` ratings with uniform random columns of a random fixed factor: an item
side with X fixed (480,189 rows, mostly outside L2), a user side with Theta fixed (17,770
rows, in L2), short rows, and the user side at smaller f. Each path is timed with CUDA
events (median of 7 after a warm-up) and checked against float64 (G^T G) on 8 sampled
segments: the largest error of A's lower triangle over the largest |A|. "TFLOP/s counted"
is nnz f (f + 1) / time, as in gpu_notes.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    return parser.parse_args()


if __name__ == "__main__":
    ARGS = arguments()  # --help and bad options answer before CuPy is imported

from bench_kernels import timeit

from cumf_dask.backend.cupy_backend import CupyBackend
from cumf_dask.compat import import_cupy
from cumf_dask.data.store import Block

cp = import_cupy()
CASES = [  # name, f, fixed rows, segments, ratings per segment
    ("item side, X fixed", 100, 480_189, 20_000, 4096),
    ("user side, Theta fixed", 100, 17_770, 20_000, 4096),
    ("short rows", 100, 17_770, 200_000, 256),
    ("user side, f = 64", 64, 17_770, 20_000, 4096),
    ("user side, f = 32", 32, 17_770, 40_000, 4096),
]
PATHS = {"FP32 units": False, "tensor cores": True}  # name: CupyBackend(tensor_cores=)


def run_case(name, f, n_fixed, nseg, seglen, seed) -> dict:
    rs = cp.random.RandomState(seed)
    fixed = rs.random_sample((n_fixed, f), dtype=cp.float32) / np.float32(10)
    nnz = nseg * seglen
    idx = rs.randint(0, n_fixed, nnz, dtype=cp.int64).astype(cp.int32)
    indptr = cp.arange(nseg + 1, dtype=cp.int64) * seglen
    block = Block(indptr, idx, rs.uniform(1, 5, nnz).astype(cp.float32), 0, 0, nseg, n_fixed)
    lower = np.tril(np.ones((f, f), bool))
    samples = np.linspace(0, nseg - 1, 8).astype(int)
    refs = {}
    for s in samples:
        G = cp.asnumpy(fixed[idx[s * seglen : (s + 1) * seglen]]).astype(np.float64)
        refs[s] = G.T @ G

    def error(A) -> float:
        return max(float(np.abs(cp.asnumpy(A[s]) - refs[s])[lower].max()
                         / np.abs(refs[s]).max()) for s in samples)  # fmt: skip

    out = {"case": name, "f": f, "nnz": nnz, "ratings per segment": seglen, "fixed rows": n_fixed}
    for path, tensor_cores in PATHS.items():
        be = CupyBackend(tensor_cores=tensor_cores)
        seconds = timeit(lambda be=be: be.hermitian(block, fixed), repeats=7)["median"]
        out[path] = (seconds, error(be.hermitian(block, fixed)[0]))
        cp.get_default_memory_pool().free_all_blocks()
    return out


def main(args: argparse.Namespace) -> None:
    device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    results = []
    for seed, case in enumerate(CASES):
        results.append(run_case(*case, seed))
        cp.get_default_memory_pool().free_all_blocks()
    print(f"\n{device}: ms, TFLOP/s counted, error vs float64, speed-up over the FP32 units")
    for r in results:
        base = r["FP32 units"][0]
        print(f"{r['case']} ({r['nnz']:,} ratings, {r['ratings per segment']} per segment)")
        for key in PATHS:
            seconds, err = r[key]
            tflops = r["nnz"] * r["f"] * (r["f"] + 1) / seconds / 1e12
            print(f"  {key:14s} {1e3 * seconds:8.2f} {tflops:6.1f} {err:9.1e} "
                  f"{base / seconds:5.2f}x")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "results": results}, indent=1))


if __name__ == "__main__":
    main(ARGS)
