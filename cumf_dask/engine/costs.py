"""What a half-step costs: seconds of computing, bytes moved between workers, and the time
the planner predicts for both, so it can choose the plan that moves the least.

The two ways to run a half-step on W workers, for n_rows solved rows and n_cols fixed rows:

* replicate (p = 1): every worker gathers the whole fixed factor (it receives
  ``n_cols f 4 (W-1)/W`` bytes), then runs the fused update on its batches;
* data parallel (p > 1): each worker builds partial Hermitians of the solved rows from its
  part of the fixed factor and sums those of its parts; the reduce-scatter moves packed
  triangles, each worker receiving about ``n_rows (f(f+1)/2 + f) 4 (W-1)/W`` bytes in all.
  When the parts are the batches the other half-step solved (p = its q, on the same
  workers), the fixed factor does not move.

A fixed factor in pinned host memory (``plan.factors: host``) also crosses the host-to-GPU
bus: each part once per half-step, or once per batch (``HalfStepPlan.parts_outer``); so do
the rating blocks of R kept in host memory (``plan.blocks: host``), all of them each
half-step. Blocks streamed from the store cost their reading too, which is not counted (no
rate for it is known).

Besides the flops, every rating and every row costs time of its own (gathering the fixed
rows, scoring, per-row bookkeeping and small-matrix overheads): what dominates at small f
(at f = 5 on the CPU the flops are 1% of the time). The GPU's kernels read the ratings while
they compute, so a GPU half-step takes the longer of the two; NumPy does one after the other.

Rates are per backend (measured: benchmarks/RESULTS.md, GPU kernels on an H100/H200 and the
NumPy backend on a 2-core CPU); the link bandwidth is measured on the cluster when a fit
starts (``cluster.measure_link``), else assumed from the transport.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

BYTES = 4  # float32


@dataclass(frozen=True)
class Rates:
    """What the model assumes of one worker: flop/s of the Hermitian build (counted as
    nnz f (f+1)) fused with the solve (p = 1) and stand-alone (A stored, p > 1), flop/s of
    the batched Cholesky (rows f^3 / 3), seconds per rating and per row and factor besides
    the flops, whether those overlap the flops (`overlap`: the longer counts, else the sum),
    seconds of scheduling per task, and bytes/s from pinned host memory to the device."""

    gram_fused: float
    gram_stored: float
    solve: float
    rating: float
    row: float
    overlap: bool
    task: float
    bus: float = math.inf


RATES = {
    # rating, row: the row kernels at f = 10 (benchmarks/RESULTS.md, session 18: an update of
    # 437.5M ratings took 0.050 s over 2.4M rows and 0.0547 s over 82.5M rows)
    "cupy": Rates(gram_fused=29e12, gram_stored=20e12, solve=6e12, rating=1.1e-10,
                  row=5.9e-12, overlap=True, task=1e-3, bus=45e9),
    # rating, row: fitted to whole iterations of `train --store` on 2 in-process workers of
    # the 2-core box (session 38): f = 2-100, 0.7M-4.5M ratings, 1.6-36 ratings per row;
    # within 0.65-1.4x of each one's median of 4-7 runs (the flops alone: 0.002-0.65x)
    "numpy": Rates(gram_fused=8e9, gram_stored=8e9, solve=3e9, rating=2.5e-7, row=5.0e-7,
                   overlap=False, task=1e-3),
}
# bytes/s between two workers when nothing was measured, by the scheduler's protocol
ASSUMED_LINK = {"ucx": 60e9, "tcp": 1.5e9, "inproc": math.inf}
# ratings/s one worker (a CPU core) adds to a generated store, whole store including the
# transposition (2-core box: 3.3-3.9M/s on 2 workers, benchmarks/RESULTS.md)
GENERATE_RATE = 1.6e6


def generate_seconds(nnz: int, workers: int) -> float:
    """Predicted seconds to generate a planted-model store of `nnz` ratings."""
    return nnz / (GENERATE_RATE * max(1, workers))


@dataclass(frozen=True)
class HalfStepCost:
    """Predicted cost of one half-step on the busiest worker."""

    compute: float  # seconds
    moved: float  # bytes a worker receives
    transfer: float  # seconds to receive them
    tasks: float  # seconds of task overhead
    copy: float = 0.0  # seconds of copying a fixed factor or blocks in host memory to the device

    @property
    def seconds(self) -> float:
        return self.compute + self.transfer + self.tasks + self.copy


def half_step_cost(
    n_rows: int,
    n_cols: int,
    nnz: int,
    f: int,
    p: int,
    q: int,
    workers: int,
    backend: str,
    link: float,
    aligned: bool = False,
    copied_in: float = 0.0,
    reduction: str = "scatter",
    blocks_copied: float = 0.0,
) -> HalfStepCost:
    """Predicted cost of a half-step with p parts and q batches on `workers` workers.

    The busiest worker's share: ceil(q / W) of the q batches (p = 1), ceil(p / W) of the p
    parts (p > 1), so a count that is not a multiple of W costs what it leaves idle.
    `aligned`: (p > 1) the parts are where the other half-step solved them, so the fixed
    factor is not gathered. `copied_in`: bytes per worker of a fixed factor in host memory
    copied to its device. `reduction` (p > 1): "one" sums and solves every batch on one
    worker, which receives the other holders' whole sums; the others cut the sums into one
    slice per worker holding parts. `blocks_copied`: bytes of the half-step's rating blocks
    (all workers') copied from host memory to the devices.
    """
    rates = RATES.get(backend.partition("+")[0], RATES["numpy"])
    both = max if rates.overlap else operator.add
    w = max(1, workers)
    remote = (w - 1) / w
    flop_gram = nnz * f * (f + 1)
    flop_solve = n_rows * f**3 / 3
    ratings, rows = nnz * rates.rating, n_rows * f * rates.row  # seconds besides the flops
    if p == 1:
        share = math.ceil(q / w) / q
        flops = flop_gram / rates.gram_fused + flop_solve / rates.solve
        compute = both(flops, ratings + rows) * share
        moved = n_cols * f * BYTES * remote
        tasks = math.ceil(q / w)
    else:
        holders = min(p, w)  # workers holding parts: each sends its sum of a batch
        slices = 1 if reduction == "one" else holders
        share = math.ceil(p / w) / p
        compute = (
            both(flop_gram / rates.gram_stored, ratings) * share
            + both(flop_solve / rates.solve, rows) / slices
        )  # fmt: skip
        packed = n_rows * (f * (f + 1) / 2 + f) * BYTES
        moved = packed * (holders - 1) / slices
        if not aligned:
            moved += n_cols / w * f * BYTES * remote
        tasks = q * (math.ceil(p / w) + slices + 1)  # hermitians, slices of its sum, a solve
    transfer = 0.0 if moved == 0 else moved / link
    copy = (copied_in + blocks_copied * share) / rates.bus
    return HalfStepCost(compute, moved, transfer, tasks * rates.task, copy)
