"""Probe: the Gram of row segments on the tensor cores (tc_gram.cu, float16 split) against
the CuPy backend's hermitian (FP32 units), one GPU; prints a table last.

    python benchmarks/bench_tc_gram.py [--json out.json]

Segments of `seglen` ratings with uniform random columns of a random fixed factor (f = 100):
an item side with X fixed (480,189 rows, mostly outside L2), a user side with Theta fixed
(17,770 rows, in L2), and short rows. Each kernel is timed with CUDA events (median of 7
after a warm-up) and checked against float64 (G^T G) on 8 sampled segments: the largest
error of the lower triangle over the largest |A|. "TFLOP/s counted" is nnz f (f + 1) / time,
as in gpu_notes.md. The probe computes A only; hermitian also computes B (f more
multiply-adds per rating, about 2% of the work). tc_gram.cu is not used by the library: it
measures the design of the next version of the Gram (gpu_notes.md, "v12").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_kernels import timeit

from cumf_dask.backend.cupy_backend import CupyBackend, kernel_source
from cumf_dask.compat import import_cupy
from cumf_dask.data.store import Block

cp = import_cupy()
F, f = 104, 100
SOURCE = Path(__file__).with_name("tc_gram.cu")
VARIANTS = {"tc": 0, "tc flush 8": 8}  # name: FLUSH (bins between adds to float32 sums)
CASES = [  # name, fixed rows, segments, ratings per segment
    ("item side, X fixed", 480_189, 20_000, 4096),
    ("user side, Theta fixed", 17_770, 20_000, 4096),
    ("short rows", 17_770, 200_000, 256),
]


def tc_kernel(flush: int):
    """The probe kernel with FLUSH = flush, and its dynamic shared memory in bytes."""
    code = kernel_source() + SOURCE.read_text()  # the probe uses mo_als.cu's copy helpers
    options = ("-std=c++17", f"-DFLUSH={flush}")
    kernel = cp.RawModule(code=code, options=options).get_function("gram_tc")
    smem = 3 * 2 * 32 * 208 + 64 + (55 * 128 * 4 if flush else 0)
    kernel.max_dynamic_shared_size_bytes = smem
    return kernel, smem


def split(fixed):
    """hi, lo (float16 bits, rows padded to F): fixed = hi + lo * 2^-11."""
    pad = cp.zeros((fixed.shape[0], F), cp.float32)
    pad[:, :f] = fixed
    hi = pad.astype(cp.float16)
    lo = ((pad - hi.astype(cp.float32)) * np.float32(2048)).astype(cp.float16)
    return hi.view(cp.uint16), lo.view(cp.uint16)


def run_case(name, n_fixed, nseg, seglen, seed, kernels, backend) -> dict:
    rs = cp.random.RandomState(seed)
    fixed = rs.random_sample((n_fixed, f), dtype=cp.float32) / np.float32(10)
    nnz = nseg * seglen
    idx = rs.randint(0, n_fixed, nnz, dtype=cp.int64).astype(cp.int32)
    indptr = cp.arange(nseg + 1, dtype=cp.int64) * seglen
    block = Block(indptr, idx, rs.uniform(1, 5, nnz).astype(cp.float32), 0, 0, nseg, n_fixed)
    hi, lo = split(fixed)
    lower = np.tril(np.ones((f, f), bool))
    samples = np.linspace(0, nseg - 1, 8).astype(int)
    refs = {}
    for s in samples:
        G = cp.asnumpy(fixed[idx[s * seglen : (s + 1) * seglen]]).astype(np.float64)
        refs[s] = G.T @ G

    def error(A) -> float:
        return max(float(np.abs(cp.asnumpy(A[s, :f, :f]) - refs[s])[lower].max()
                         / np.abs(refs[s]).max()) for s in samples)  # fmt: skip

    out = {"case": name, "nnz": nnz, "ratings per segment": seglen, "fixed rows": n_fixed}
    seconds = timeit(lambda: backend.hermitian(block, fixed), repeats=7)["median"]
    out["hermitian (FP32 units)"] = (seconds, error(backend.hermitian(block, fixed)[0]))
    A = cp.zeros((nseg, F, F), cp.float32)
    args = (idx, hi, lo, indptr[:-1].copy(), indptr[1:].copy(), A)
    for variant, (kernel, smem) in kernels.items():
        def launch(kernel=kernel, smem=smem):
            kernel((nseg,), (128,), args, shared_mem=smem)

        seconds = timeit(launch, repeats=7)["median"]
        out[variant] = (seconds, error(A))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    kernels = {name: tc_kernel(flush) for name, flush in VARIANTS.items()}
    backend = CupyBackend()
    results = []
    for seed, case in enumerate(CASES):
        results.append(run_case(*case, seed, kernels, backend))
        cp.get_default_memory_pool().free_all_blocks()
    print(f"\n{device}, f = {f}: ms, TFLOP/s counted, error vs float64, speed-up over hermitian")
    for r in results:
        base = r["hermitian (FP32 units)"][0]
        print(f"{r['case']} ({r['nnz']:,} ratings, {r['ratings per segment']} per segment)")
        for key in ("hermitian (FP32 units)", *VARIANTS):
            seconds, err = r[key]
            tflops = r["nnz"] * f * (f + 1) / seconds / 1e12
            print(f"  {key:24s} {1e3 * seconds:8.2f} {tflops:6.1f} {err:9.1e} "
                  f"{base / seconds:5.2f}x")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "results": results}, indent=1))


if __name__ == "__main__":
    main()
