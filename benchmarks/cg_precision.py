"""How far a few CG steps move under float32 arithmetic, on the GPU and in NumPy.

    python benchmarks/cg_precision.py                # NumPy columns only without a GPU
    python benchmarks/cg_precision.py --f 16,33,64 --seeds 12

Implicit-feedback systems as tests/test_cupy_backend.py builds them (150 rows, 400 fixed
rows, counts 0..4, alpha 3, lambda 0.05, 3 CG steps from a random x0). For each f, the worst
relative error over the seeds of: NumPy's CG in float32 against its float64 CG (what float32
arithmetic alone moves), the GPU CG (solve from A in memory, and the fused update) against
the NumPy backend (float64), and the GPU Cholesky against NumPy for scale. The GPU tests
bound the GPU CG by 4x the first column.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import float32_cg_change, random_ratings, rel_err

from cumf_dask.backend import get_backend
from cumf_dask.backend.objective import UpdateSpec
from cumf_dask.blocks import Block, coo_to_block

M, N, STEPS = 150, 400, 3


def problem(f: int, seed: int) -> tuple[Block, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(block of counts, fixed factor, counts per row, x0, fixed^T fixed)."""
    rng = np.random.default_rng(seed)
    rows, cols, vals = random_ratings(M, N, 0.08, seed, empty_rows=[3], skew=0.8)
    fixed = (rng.random((N, f)) / np.sqrt(f)).astype(np.float32)
    block = coo_to_block(rows, cols, vals, 0, 0, M, N)
    block = Block(block.indptr, block.indices, np.round(block.values) - 1, 0, 0, M, N)
    x0 = (np.random.default_rng(seed).random((M, f)) / np.sqrt(f)).astype(np.float32)
    return block, fixed, np.bincount(rows, minlength=M), x0, fixed.astype(np.float64).T @ fixed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--f", default="16,33,64", help="comma-separated factor counts")
    parser.add_argument("--seeds", type=int, default=12)
    args = parser.parse_args()
    cpu = get_backend("numpy")
    try:
        gpu = get_backend("cupy")
    except Exception:  # no CuPy or no GPU: the NumPy column only
        gpu = None
    cg = UpdateSpec(0.05, weighted=False, implicit=True, alpha=3.0, solver="cg", cg_steps=STEPS)
    chol = UpdateSpec(0.05, weighted=False, implicit=True, alpha=3.0)
    print(f"{M} rows x {N}, {STEPS} CG steps, worst of {args.seeds} seeds; GPU: {gpu is not None}")
    print("| f | NumPy CG float32 vs float64 | GPU CG solve / update vs NumPy "
          "| GPU Cholesky vs NumPy |")  # fmt: skip
    print("| ---: | ---: | ---: | ---: |")
    for f in (int(v) for v in args.f.split(",")):
        worst = np.zeros(4)
        for seed in range(args.seeds):
            block, fixed, counts, x0, gram0 = problem(f, seed)
            A, B = cpu.hermitian(block, fixed, cg)
            errors = [float32_cg_change(A, B, counts, cg, gram0, x0), 0.0, 0.0, 0.0]
            if gpu is not None:
                ga, gb, gc, g0, gx = (gpu.asarray(a) for a in (A, B, counts, gram0, x0))
                for k, spec in ((1, cg), (3, chol)):
                    ref = cpu.solve(A, B, counts, spec, gram0=gram0, x0=x0)
                    got = gpu.solve(ga, gb, gc, spec, gram0=g0, x0=gx)
                    errors[k] = rel_err(gpu.to_host(got), ref)
                fused = gpu.update(gpu.block_to_device(block), gpu.asarray(fixed), gc, cg,
                                   gram0=g0, x0=gx)  # fmt: skip
                ref = cpu.update(block, fixed, counts, cg, gram0=gram0, x0=x0)
                errors[2] = rel_err(gpu.to_host(fused), ref)
            worst = np.maximum(worst, errors)
        gpu_cols = f"{worst[1]:.1e} / {worst[2]:.1e} | {worst[3]:.1e}" if gpu else "- | -"
        print(f"| {f} | {worst[0]:.1e} | {gpu_cols} |", flush=True)


if __name__ == "__main__":
    main()
