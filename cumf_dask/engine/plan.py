"""The planner: choose p and q for each SU-ALS half-step from sizes and memory.

The memory model is the cuMF paper's (section "How to partition?"): for update-X on one
worker, with the fixed factor Theta split into p parts and X into q batches,

    m f / q  +  n f / p  +  |R^(ij)|  +  (m / q) f^2  +  (m / q) f  +  eps  <  C      (floats)

Best practices from the paper, applied in order:

1. if p = 1 fits, use it (model parallelism only: no reduction, the common fast case);
2. otherwise start from p with n f / p ~ C / 2, and
3. take the smallest q that fits (never more: more batches only add overhead),

with three additions for Dask: q is a multiple of the number of workers when p = 1 (every
worker gets as many batches; the cost model charges the busiest worker's share, so a p that
leaves a worker idle is slower too, and a worker holds all the parts it gathered); on
several workers each half-step may instead be data parallel over the
batches the other half-step solved (p = its q, parts where they were solved), whichever the
cost model (:mod:`.costs`: compute, bytes moved at the link's bandwidth, task overhead)
predicts faster; and the rating blocks of both orientations are loaded once and kept in
the workers' memory when they fit next to the working set (``device``: the half-steps are
planned in the room R leaves, so q grows where that makes them fit), else on GPU workers
in pinned host memory, copied to the GPU by each half-step (``host``: at most half of the
worker's host memory limit, below Dask's spill threshold; a half-step's blocks of
STAGED_BLOCK_BYTES or more are copied ahead, so the plan has room for three of them), else
read from the store by each half-step (``store``, one block ahead of the computation, so
two on a worker). The factors' pieces stay on the
workers' devices when both fit next to the working set; else (GPU workers, the paper's
Facebook case) the larger factor lives in pinned host memory: its half-step copies each
solved batch out, and the other half-step copies it in one part at a time (the part is the
"fixed part" of the memory model, so a factor that does not fit makes that half-step data
parallel): each part once, with the parts as the outer loop, where the sums of all that
half-step's batches fit next to two parts and the cost model predicts it faster, else once
per batch. With checkpoints the factors' pieces on the workers count twice (a save holds
the iteration it writes while the next ones run). Partition boundaries balance ratings, not
rows, so skewed data loads workers evenly; the memory model sizes each (p, q) by its largest
batch, part and block (on skewed data the batches of light rows have many more rows than
m / q).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Literal

import numpy as np

from ..backend.base import MAX_F, MAX_TENSOR_CORE_F, split_bytes
from ..blocks import MAX_COLS
from ..config import (
    BlockTier,
    FactorTier,
    PlanConfig,
    check_plan_config,
    parse_size,
    plain,
    size_text,
)
from ..devices import nvml_groups
from ..errors import ConfigError, PlanError
from .costs import ASSUMED_LINK, half_step_cost

BYTES = 4  # float32
RATING_BYTES = 12  # int32 index + float32 value + amortized indptr/row
HOST_SHARE = 0.5  # of a GPU worker's host memory limit that host-tier blocks may take
# A host-tier block this big is copied to the device ahead of its use, while the block before
# it computes (smaller ones: the scheduler's round trip such a copy adds costs more than it)
STAGED_BLOCK_BYTES = 256 << 20


Side = Literal["x", "theta"]
BLOCK_TIERS = {
    "device": "resident on the workers",
    "host": "in pinned host memory, copied to the GPUs each half-step",
    "store": "streamed from the store",
}


@dataclass
class HalfStepPlan:
    """One half-step: solve `n_rows` rows of one factor from `n_cols` rows of the other.

    `side` names the solved factor ("x": update X, Theta fixed; "theta": the reverse); the
    store orientation it reads (`orient`) and its printed name (`label`) follow from it.
    """

    side: Side
    n_rows: int
    n_cols: int
    nnz: int
    f: int
    p: int
    q: int
    row_bounds: list[int]  # q + 1 batch boundaries of the solved factor
    col_bounds: list[int]  # p + 1 part boundaries of the fixed factor
    memory: dict[str, int] = field(default_factory=dict)  # bytes per worker, by item
    aligned: bool = False  # p > 1 over the batches the other half-step solved, where it did
    parts_outer: bool = False  # the fixed factor is in host memory, each part copied in once
    staged: bool = False  # blocks in host memory, each copied to the device ahead of its use
    copied_in: int = 0  # bytes per worker of a fixed factor in host memory copied to the device
    predicted: dict[str, float] = field(default_factory=dict)  # seconds and bytes, .costs
    why: str = ""  # why p is what it is (the plan table says it)

    @property
    def orient(self) -> Literal["row", "col"]:
        """The store orientation whose rows are this half-step's solved rows."""
        return "row" if self.side == "x" else "col"

    @property
    def label(self) -> str:
        return "X" if self.side == "x" else "Theta"

    @property
    def peak(self) -> int:
        return sum(self.memory.values())


@dataclass
class Plan:
    """Both half-steps, the workers they run on, and where the rating blocks live."""

    x: HalfStepPlan
    theta: HalfStepPlan
    workers: int
    budget: int  # bytes per worker the plan may use (before headroom)
    blocks: BlockTier  # device, host or store (never auto: the planner has chosen)
    reduction: str
    groups: list[list[int]] | None
    backend: str
    # bytes/s between workers the costs assume; inf: the workers share one process, so
    # nothing is copied between them (to_dict, JSON: null)
    link: float = math.inf
    link_measured: bool = False  # measured on the cluster, else assumed from the transport
    held_out: int = 0  # held-out ratings whose blocks are kept too (the test RMSE's)
    host_factor: Side | None = None  # the factor kept in pinned host memory (None: none)
    tensor_cores: bool = False  # the GPU's tensor-core Gram counted (make_plan's tensor_cores)
    checkpoint: bool = False  # a saved iteration's factors counted too (make_plan's checkpoint)

    def block_bytes(self) -> int:
        """Bytes of rating blocks per worker (:func:`block_bytes`)."""
        return block_bytes(self.x.nnz, self.held_out, self.workers)

    def factor_bytes(self) -> int:
        """Bytes of the factors' pieces per worker on the devices (not the host factor's)."""
        return sum(factor_bytes(h.n_rows, h.f, self.workers) for h in (self.x, self.theta)
                   if h.side != self.host_factor)  # fmt: skip

    def on_host(self, side: str) -> bool:
        """Whether the factor solved by half-step `side` lives in host memory."""
        return side == self.host_factor

    def half(self, side: str) -> HalfStepPlan:
        return self.x if side == "x" else self.theta

    def other(self, side: str) -> HalfStepPlan:
        """The half-step that holds the factor solved by half-step `side` fixed."""
        return self.theta if side == "x" else self.x

    @property
    def resident(self) -> bool:
        """The blocks are loaded once (device or host), not read every half-step."""
        return self.blocks != "store"

    @property
    def blocks_in_worker_memory(self) -> bool:
        """The blocks take the memory the budget is for."""
        return self.blocks == "device"

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON takes it (plan.json, ``--json plan``): an unbounded link (workers
        in one process) is None, as strict JSON has no Infinity."""
        out = plain(asdict(self))
        out["link"] = None if math.isinf(self.link) else self.link
        return out

    def table(self) -> str:
        """A readable summary: p, q and the memory estimate per worker for each half-step."""
        gb = 1e9
        lines = [
            f"workers: {self.workers} ({self.backend}), budget {self.budget / gb:.2f} GB per "
            f"worker, R {BLOCK_TIERS[self.blocks]}"
            + (" (big blocks copied ahead)" if self.x.staged or self.theta.staged else "") + ", "
            f"reduction: {self.reduction if max(self.x.p, self.theta.p) > 1 else 'none (p = 1)'}"
            + (f", {self.half(self.host_factor).label} in pinned host memory"
               + (" (copied in once per half-step)" if self.other(self.host_factor).parts_outer
                  else " (copied in once per batch)")
               if self.host_factor else ""),
            f"{'half-step':<14}{'p':>4}{'q':>6}{'rows/batch':>12}{'fixed/part':>12}"
            f"{'R/block':>12}{'A,B/batch':>12}{'peak GB':>9}{'moved MB':>10}{'predicted s':>12}",
        ]
        for h in (self.x, self.theta):
            rows = max(np.diff(h.row_bounds))
            cols = max(np.diff(h.col_bounds))
            lines.append(
                f"update {h.label:<7}{h.p:>4}{h.q:>6}{rows:>12,}{cols:>12,}"
                f"{h.memory.get('R block', 0) / gb:>11.3f}G"
                f"{(h.memory.get('A', 0) + h.memory.get('B', 0)) / gb:>11.3f}G"
                f"{h.peak / gb:>9.3f}{h.predicted.get('moved', 0) / 1e6:>10.1f}"
                f"{h.predicted.get('seconds', 0):>12.4f}"
            )
        lines += [f"update {h.label}: p={h.p}, {h.why}" for h in (self.x, self.theta) if h.why]
        if self.workers > 1:
            link = "in-process" if math.isinf(self.link) else f"{self.link / 1e9:.1f} GB/s"
            how = "measured" if self.link_measured else "assumed"
            lines.append(f"cost model: link {link} ({how})")
        return "\n".join(lines)


def factor_bytes(n_rows: int, f: int, workers: int) -> int:
    """Bytes per worker of the pieces of a factor of `n_rows` rows."""
    return math.ceil(n_rows / workers) * f * BYTES


def block_bytes(nnz: int, held_out: int, workers: int) -> int:
    """Bytes of rating blocks per worker: both orientations of the training ratings and the
    held-out ones."""
    return int((2 * nnz + held_out) * RATING_BYTES / workers)


class RowShares:
    """The rows' cumulative share of the ratings, computed once (a cumulative sum over 50M rows
    takes a third of a second) and split into any number of parts by :meth:`bounds`;
    :meth:`largest` sizes the largest part of a split, which the memory model needs.

    `counts` may be just the number of rows (counts unknown): splits are then even.
    """

    def __init__(self, counts: np.ndarray | int):
        self.n = counts if isinstance(counts, int) else len(counts)
        total = 0.0 if isinstance(counts, int) else float(counts.sum())
        self._weight: np.ndarray | None = None
        self._most = 0.0  # the fullest row's share of the ratings
        self._largest: dict[tuple[int, int], tuple[int, float, int]] = {}  # asked often
        if total > 0:
            # Blend with an even split of rows so rows without ratings are spread too.
            weight = np.cumsum(counts, dtype=np.float64)
            weight /= total
            weight += np.arange(1, self.n + 1, dtype=np.float64) * (self._EVEN / self.n)
            self._weight = weight
            self._most = float(counts.max()) / total

    _EVEN = 1e-3  # the even split's weight in the blend

    def _cuts(self, parts: int) -> np.ndarray:
        """The bounds of :meth:`bounds`, as an array (`parts` already within 1..n)."""
        n = self.n
        if self._weight is None:
            return np.round(np.arange(parts + 1) * n / parts).astype(np.int64)
        targets = np.arange(1, parts) / parts * self._weight[-1]
        cuts = np.searchsorted(self._weight, targets, side="left") + 1
        # strictly increasing, and room left for the parts after each: cut i is at most
        # n - (parts - i), and at least cut i - 1 plus one (a running maximum of cut - i)
        i = np.arange(1, parts)
        cuts = np.maximum.accumulate(np.minimum(cuts, n - parts + i) - i) + i
        return np.concatenate(([0], cuts, [n]))

    def bounds(self, parts: int) -> list[int]:
        """parts + 1 boundaries splitting the rows so each part holds about the same ratings."""
        return self._cuts(max(1, min(parts, self.n))).tolist()

    def largest(self, parts: int, workers: int = 1) -> tuple[int, float, int]:
        """(rows, share, held) of a split into :meth:`bounds`: the most rows of a part, the
        largest part's share of the ratings (counts unknown: its share of the rows), and
        the most rows of the parts one of `workers` holds (part i on worker i mod workers)."""
        parts = max(1, min(parts, self.n))
        if (parts, workers) not in self._largest:
            if parts == self.n:  # a row each: no bounds over every row needed
                share = self._most if self._weight is not None else 1 / self.n
                size = (1, share, math.ceil(self.n / workers))
            else:
                cuts = self._cuts(parts)
                rows = np.diff(cuts)
                if self._weight is None:
                    share = rows.max() / self.n
                else:  # the weight less its even part, at each bound
                    weight = np.concatenate(([0.0], self._weight[cuts[1:] - 1]))
                    share = (np.diff(weight) - rows * (self._EVEN / self.n)).max()
                held = np.concatenate((rows, np.zeros(-parts % workers, rows.dtype)))
                held = held.reshape(-1, workers).sum(axis=0).max()
                size = (int(rows.max()), float(share), int(held))
            self._largest[parts, workers] = size
        return self._largest[parts, workers]


def balanced_bounds(counts: np.ndarray | int, parts: int) -> list[int]:
    """parts + 1 boundaries splitting rows so each part holds about the same ratings
    (:class:`RowShares`, for one split)."""
    return RowShares(counts).bounds(parts)


def _memory(
    rows: int, cols: int, gathered: int, block: int, n_rows: int, f: int, p: int, fused: bool,
    parts_outer: bool = False, blocks: BlockTier = "device", fixed_on_host: bool = False,
    tensor_cores: bool = False,
) -> dict:
    """Bytes per worker by item, for a batch of `rows` solved rows, a part of `cols` fixed
    rows and a block of `block` ratings (the largest of each: see :func:`_half_step`) of a
    half-step solving `n_rows` rows. p > 1: each worker sums its parts' packed partial (A, B)
    of a batch, holds those of up to two batches before it until they are reduced, and
    holds the parts of the fixed factor it gathered (`gathered` rows at most) for the
    half-step; a fixed factor in host memory (`fixed_on_host`) comes to the
    device one part per use, or with `parts_outer` (each part copied in once) two parts
    (one in use, the next arriving), and the sums of all batches are held.
    `blocks` is where R lives: ``store``, the next block is read while one computes;
    ``host``, a block copied ahead (:func:`staged`) is on the device beside the one
    computing and the one before, whose kernels may still run.
    `fused` (the GPU's kernels): no f x f A at all; the fused update solves on chip, the
    Gram kernels write packed sums and the solve reads them as they are. `tensor_cores`
    (the GPU's Gram on its tensor cores): a task also holds its fixed part split into the
    float16 halves those read."""
    block *= RATING_BYTES
    if p == 1 or (fixed_on_host and not parts_outer):
        fixed = cols
    else:
        fixed = 2 * cols if parts_outer else gathered
    est = {
        "solved batch": rows * f * BYTES,
        "fixed part": fixed * f * BYTES,
        "R block": block,
        "B": rows * f * BYTES,
    }
    if tensor_cores:
        est["fixed split"] = split_bytes(cols, f)
    if blocks == "store":
        est["R block ahead"] = block
    if blocks == "host" and staged(block):
        est["R blocks ahead"] = 2 * block
    if not fused:  # the NumPy backend's Gram stores every row's f x f A (p > 1: then packs it)
        est["A"] = rows * f * f * BYTES
    if p > 1:
        packed = (f * (f + 1) // 2 + f) * BYTES  # a row's partial (A, B)
        # the sums of the batch computing and of the two before it, which wait for their
        # reduction (a batch's sums wait for those two before it: halfstep._partial_sums)
        summed = n_rows if parts_outer else min(n_rows, 3 * rows)
        est["partials"] = summed * packed
        est["reduction"] = rows * packed  # a slice's inputs and their sum: about a batch's
    return est


def staged(block_bytes: int) -> bool:
    """Whether a block of R in host memory this big is copied to the device ahead of its use."""
    return block_bytes >= STAGED_BLOCK_BYTES


def _half_step(
    side: Side,
    n_rows: int,
    n_cols: int,
    nnz: int,
    f: int,
    workers: int,
    budget: int,
    row_shares: RowShares,
    col_shares: RowShares,
    p: int | None = None,
    q: int | None = None,
    fused: bool = False,
    parts_outer: bool = False,
    fixed_on_host: bool = False,
    seconds: Callable[[int, int], float] | None = None,
    blocks: BlockTier = "device",
    tensor_cores: bool = False,
) -> HalfStepPlan:
    """Choose p and q for one half-step (paper's best practices), honouring forced values;
    `parts_outer`, `blocks`: see :func:`_memory`; `fixed_on_host`: the fixed factor is
    in host memory (``copied_in`` counts its bytes that cross to each device). Data
    parallel (`tensor_cores`: see :func:`_memory`), p starts where the fixed factor's part
    takes half the budget, and more parts
    are tried (:func:`_fastest_p`, by the predicted `seconds` of (p, q); without it, fewest
    blocks). A (p, q) is sized by its largest batch, part and block, as the bounds split
    them (ratings balanced, so skewed data has batches of many more rows than n_rows / q;
    a block's ratings: its batch's share times its part's), and no part may have 2^31
    columns or more (a block's column indices are int32).

    Its ``predicted`` cost is filled in by make_plan, which knows the link.
    """
    fixed = "Theta" if side == "x" else "X"

    def memory(p_: int, q_: int, even: bool = False) -> dict:
        """_memory of (p_, q_); `even`: as if every split were even, the least any needs."""
        if even:
            rows, cols = math.ceil(n_rows / q_), math.ceil(n_cols / p_)
            gathered = math.ceil(n_cols / min(p_, workers))
            block = math.ceil(nnz / (p_ * q_))
        else:
            rows, row_share, _ = row_shares.largest(q_)
            cols, col_share, gathered = col_shares.largest(p_, workers)
            block = math.ceil(nnz * row_share * col_share)
        return _memory(rows, cols, gathered, block, n_rows, f, p_, fused, parts_outer, blocks,
                       fixed_on_host, tensor_cores)  # fmt: skip

    def fits(p_: int, q_: int) -> bool:
        if sum(memory(p_, q_, even=True).values()) >= budget:  # cheap, and rules out most
            return False
        return (col_shares.largest(p_, workers)[0] < MAX_COLS
                and sum(memory(p_, q_).values()) < budget)  # fmt: skip

    q_max = max(1, n_rows)
    p = None if p is None else max(1, min(p, n_cols))
    q = None if q is None else max(1, min(q, n_rows))
    forced_p, forced_q = p is not None, q is not None
    if p is None:
        if fits(1, q or q_max):
            p = 1
        else:
            first = max(2, math.ceil(n_cols * f * BYTES / (budget / 2)))
            p = _fastest_p(first, n_cols, q, fits, q_max, seconds or operator.mul)
            if p > n_cols:
                free = fits(1, q_max) or _fastest_p(first, n_cols, None, fits, q_max,
                                                    operator.mul) <= n_cols  # fmt: skip
                fix = ("raise q" if q is not None and free
                       else "use more workers, a larger plan.memory_budget, or fewer factors")
                raise PlanError(
                    f"update {side}: no partition fits {size_text(budget)} per worker with "
                    f"f={f}{f', q={q}' if q is not None else ''} ({n_rows:,} x {n_cols:,}, "
                    f"{nnz:,} ratings); {fix}"
                )
    if q is None:
        q = next((qq for qq in _counts_from(1, q_max) if fits(p, qq)), q_max)
        if p == 1:  # every worker runs as many batches (when that fits too)
            rounded = min(q_max, math.ceil(q / workers) * workers)
            q = rounded if fits(p, rounded) else q
    cols = col_shares.largest(p, workers)[0]
    if cols >= MAX_COLS:
        raise PlanError(
            f"update {side}: p={p} leaves {cols:,} columns in a part, more than a block's "
            f"int32 column indices hold (2^31); raise p to at least "
            f"{math.ceil(n_cols / (MAX_COLS - 1))}"
        )
    est = memory(p, q)
    if not fits(p, q):
        fix = "raise q, lower f, or add memory" if q < q_max and fits(p, q_max) else (
            "lower f or add memory")
        raise PlanError(
            f"update {side}: p={p}, q={q} needs {size_text(sum(est.values()))} per "
            f"worker, more than the {size_text(budget)} budget; {fix}"
        )
    if forced_p:
        why = "set by the config"
    elif p == 1:
        why = f"every worker holds all of {fixed} (it fits)"
    elif fixed_on_host:
        why = f"{fixed} is in host memory, copied to the device in parts"
    elif forced_q:
        why = f"the config's q={q} leaves batches too big for one worker unsplit"
    else:
        why = f"{fixed} does not fit one worker beside a batch, so it is split"
    return HalfStepPlan(
        side=side,
        n_rows=n_rows,
        n_cols=n_cols,
        nnz=nnz,
        f=f,
        p=p,
        q=q,
        row_bounds=row_shares.bounds(q),
        col_bounds=col_shares.bounds(p),
        memory=est,
        parts_outer=parts_outer,
        staged="R blocks ahead" in est,
        copied_in=_copied_in(n_cols, f, p, q, workers, parts_outer) if fixed_on_host else 0,
        why=why,
    )


def _copied_in(n_cols: int, f: int, p: int, q: int, workers: int, parts_outer: bool) -> int:
    """Bytes of a fixed factor in host memory copied to a worker's device per half-step: its
    parts (all of it when p = 1), once each with `parts_outer`, else once per batch it runs."""
    parts = 1 if p == 1 else math.ceil(p / workers)
    uses = 1 if parts_outer else (math.ceil(q / workers) if p == 1 else q)
    return math.ceil(n_cols / p) * f * BYTES * parts * uses


def _fastest_p(
    first: int,
    n_cols: int,
    q: int | None,
    fits: Callable[[int, int], bool],
    q_max: int,
    seconds: Callable[[int, int], float],
) -> int:
    """The p (from `first` up, with its smallest q that fits, or `q` when forced) whose plan
    `seconds` predicts fastest, among the first p that fits and up to 4 times it; n_cols + 1
    when none fits."""
    found: list[tuple[float, int]] = []
    for p in _counts_from(first, n_cols):
        if found and p > 4 * found[0][1]:
            break
        q_p = q if q is not None else next((qq for qq in _counts_from(1, q_max) if fits(p, qq)), 0)
        if q_p and fits(p, q_p):
            found.append((seconds(p, q_p), p))
    return min(found)[1] if found else n_cols + 1


def _counts_from(first: int, last: int):
    """Partition counts to try from `first` to `last`: one by one up to 8, then 25 % more."""
    k = first
    while k < last:
        yield k
        k = k + 1 if k < 8 else math.ceil(k * 1.25)
    yield last


def check_gpu_factors(f: int, backend: str) -> None:
    """ConfigError when the GPU backend cannot fit `f` factors: known before anything
    starts (else the cluster starts, the blocks load, and the first update task fails)."""
    if backend == "cupy" and f > MAX_F:
        raise ConfigError(
            f"model.factors {f}: the GPU backend supports up to {MAX_F} factors; use fewer "
            "factors, or cluster.backend: numpy"
        )


def make_plan(
    m: int,
    n: int,
    nnz: int,
    f: int,
    workers: int,
    memory: int,
    row_counts: np.ndarray | None = None,
    col_counts: np.ndarray | None = None,
    config: PlanConfig | None = None,
    backend: str = "numpy",
    *,
    link: float | None = None,
    transport: str = "tcp",
    host_memory: int | None = None,
    held_out: int = 0,
    tensor_cores: bool = True,
    checkpoint: bool = False,
) -> Plan:
    """The plan for a whole iteration: update X (Theta fixed), then update Theta (X fixed).

    `memory` is the smallest worker's memory in bytes (GPU memory on GPU workers);
    ``config.memory_budget`` may lower it (a size or a fraction of it). Without the counts (a
    store not built yet) batches and parts split rows evenly. The two-phase reduction takes
    its worker groups from ``config.groups``, else (GPU workers) from the NVML topology.
    `link` is the measured bandwidth between workers (bytes/s); without it the cost model
    assumes one for the `transport` ("tcp", "ucx", "inproc").
    `host_memory` is the smallest GPU worker's host memory limit (the ``host`` tier's room).
    `held_out`: the held-out ratings whose blocks the fit also keeps (for the test RMSE).
    `tensor_cores`: the GPU may build Grams on its tensor cores (float32 factors of an
    explicit model; they apply up to f = MAX_TENSOR_CORE_F), whose copy of the fixed
    factor's part is counted. `checkpoint`: the fit saves checkpoints, each of which holds
    its iteration's factor pieces until it is written while the next iterations run: a
    second copy of the factors on the workers is counted.
    """
    config = config or PlanConfig()
    check_plan_config(config)  # a PlanConfig made in Python is checked as a file's plan is
    budget = memory
    if config.memory_budget is not None:
        budget = parse_size(config.memory_budget, memory) or memory
    groups = config.groups
    if config.reduction == "two-phase" and groups is None and backend == "cupy":
        groups = nvml_groups(workers)  # None: one flat group
    if f < 1:
        raise PlanError(f"factors must be at least 1, got {f}")
    check_gpu_factors(f, backend)
    if workers < 1:
        raise PlanError("the cluster has no workers; start some or check the scheduler address")
    if budget <= 0:
        raise PlanError(
            f"the workers have no memory left for data ({size_text(max(budget, 0))} per worker "
            "below Dask's pause threshold, after what their processes take): give them more "
            "memory (cluster.memory_limit) or use fewer, larger workers"
        )
    usable = budget - (parse_size(config.headroom, budget) or 0)
    split = backend == "cupy" and tensor_cores and f <= MAX_TENSOR_CORE_F
    rc = RowShares(m if row_counts is None else row_counts)
    cc = RowShares(n if col_counts is None else col_counts)
    sides = {"x": (m, n, rc, cc, config.x), "theta": (n, m, cc, rc, config.theta)}

    forced = {
        side: (sc.p if sc.p is not None else config.p, sc.q if sc.q is not None else config.q)
        for side, (*_, sc) in sides.items()
    }
    link_bw = link if link is not None else ASSUMED_LINK.get(transport, ASSUMED_LINK["tcp"])
    price = partial(_price, workers=workers, backend=backend, link=link_bw,
                    reduction=config.reduction)  # fmt: skip

    def half_steps(
        room: int, host: Side | None, blocks: BlockTier, forced: dict[str, tuple[Any, Any]]
    ) -> tuple[HalfStepPlan, HalfStepPlan]:
        """The fastest predicted (x, theta) whose working memory fits `room` per worker, with
        factor `host` (if any) in host memory: the other half-step copies each of its parts
        in once where the sums of all its batches fit, else once per batch. `blocks`: where
        R lives (what its blocks take beside the computing one, and in host memory the bytes
        each half-step copies); `forced`: (p, q) by side, None where the planner chooses."""

        copied = nnz * RATING_BYTES if blocks == "host" else 0  # R's bytes each half-step

        def priced(h: HalfStepPlan) -> None:
            price(h, blocks_copied=copied)

        def half(side: Side, p: int | None, q: int | None) -> HalfStepPlan:
            rows, cols, rc, cc, _ = sides[side]

            def plan(parts_outer: bool = False, fixed_on_host: bool = False) -> HalfStepPlan:
                def seconds(p_: int, q_: int) -> float:
                    fixed_in = _copied_in(cols, f, p_, q_, workers, parts_outer)
                    return half_step_cost(rows, cols, nnz, f, p_, q_, workers, backend, link_bw,
                                          copied_in=fixed_in if fixed_on_host else 0,
                                          reduction=config.reduction,
                                          blocks_copied=copied).seconds  # fmt: skip

                h = _half_step(side, rows, cols, nnz, f, workers, room, rc, cc, p=p, q=q,
                               fused=backend == "cupy", parts_outer=parts_outer,
                               fixed_on_host=fixed_on_host, seconds=seconds,
                               blocks=blocks, tensor_cores=split)  # fmt: skip
                if forced[side][0] is not None:  # (never an aligned alternative's p)
                    h.why = f"set by {p_keys[side]}"
                return h

            if host is None or host == side:
                return plan()
            options = []
            for outer in (True, False):  # each part copied in once, or once per batch
                try:
                    options.append(plan(parts_outer=outer, fixed_on_host=True))
                except PlanError:
                    if not (outer or options):
                        raise
            for option in options:
                priced(option)
            return min(options, key=lambda h: h.predicted["seconds"])

        x, theta = (half(side, *forced[side]) for side in ("x", "theta"))  # type: ignore[arg-type]
        for h in (x, theta):
            priced(h)
        candidates = [(x, theta)]
        if workers > 1:
            for side in ("x", "theta"):
                alternative = _aligned(side, x, theta, forced, half, priced)
                if alternative is not None:
                    candidates.append(alternative)
        return min(candidates, key=lambda c: c[0].predicted["seconds"] + c[1].predicted["seconds"])

    sizes = {"x": factor_bytes(m, f, workers), "theta": factor_bytes(n, f, workers)}
    r_bytes = block_bytes(nnz, held_out, workers)
    p_keys = {side: f"plan.{side}.p" if sc.p is not None else "plan.p"
              for side, (*_, sc) in sides.items()}  # fmt: skip
    q_keys = {side: (f"plan.{side}.q" if sc.q is not None else "plan.q", forced[side][1])
              for side, (*_, sc) in sides.items() if forced[side][1] is not None}  # fmt: skip

    def tier_plan(
        tier: BlockTier, free_q: bool = False
    ) -> tuple[Side | None, tuple[HalfStepPlan, HalfStepPlan]]:
        """(factor in host memory, (x, theta)) with R's blocks in `tier`. Resident on the
        workers (``device``), R takes its room first, so the half-steps' q grows to leave
        it; `free_q`: with the planner's q where the config forced one."""
        chosen = {side: (pq[0], None) for side, pq in forced.items()} if free_q else forced
        room = usable - (r_bytes if tier == "device" else 0)
        return _factor_tier(config.factors, sizes, room, backend,
                            partial(half_steps, blocks=tier, forced=chosen),
                            2 if checkpoint else 1)  # fmt: skip

    host_factor, (x, theta), blocks = _block_tier(
        config.blocks, tier_plan, r_bytes, usable, backend, host_memory, sizes, q_keys
    )
    if groups is not None:
        flat = sorted(w for g in groups for w in g)
        if flat != list(range(workers)):
            raise ConfigError(
                f"plan.groups {groups} must name every worker 0..{workers - 1} exactly once"
            )
    return Plan(
        x=x, theta=theta, workers=workers, budget=budget, blocks=blocks,
        reduction=config.reduction, groups=groups, backend=backend, link=link_bw,
        link_measured=link is not None, held_out=held_out, host_factor=host_factor,
        tensor_cores=split, checkpoint=checkpoint,
    )  # fmt: skip


def _factor_tier(
    wanted: FactorTier,
    sizes: dict[str, int],
    usable: int,
    backend: str,
    half_steps: Callable[[int, Side | None], tuple[HalfStepPlan, HalfStepPlan]],
    copies: int = 1,
) -> tuple[Side | None, tuple[HalfStepPlan, HalfStepPlan]]:
    """Which factor lives in host memory (None: both on the devices, see the module doc),
    and the half-steps planned in the room the factors on the devices leave. `sizes`: each
    factor's bytes per worker, of which the devices hold `copies` (2: a checkpoint holds
    the saved iteration's). On CPU workers the host is the device: always None there, and
    the copies are taken from the budget as they are on the devices."""
    if backend != "cupy":
        return None, half_steps(usable - (copies - 1) * sum(sizes.values()), None)
    larger: Side = "x" if sizes["x"] >= sizes["theta"] else "theta"
    gb = 1e9
    if wanted != "host":
        try:
            return None, half_steps(usable - copies * sum(sizes.values()), None)
        except PlanError:
            if wanted == "device":
                twice = " (twice that while a checkpoint is written)" if copies > 1 else ""
                raise PlanError(
                    f"plan.factors is device but X and Theta take {sum(sizes.values()) / gb:.2f} "
                    f"GB per worker{twice}, too much to leave room for the half-steps in the "
                    f"{usable / gb:.2f} GB budget; set plan.factors to host (or auto)"
                ) from None
    smaller = sizes["theta" if larger == "x" else "x"]
    try:
        return larger, half_steps(usable - copies * smaller, larger)
    except PlanError as exc:
        raise PlanError(
            f"{exc} (with {'X' if larger == 'x' else 'Theta'} in host memory and "
            f"{smaller / gb:.2f} GB of the budget for the other factor)"
        ) from None


def _block_tier(
    wanted: BlockTier,
    plan: Callable[..., tuple[Side | None, tuple[HalfStepPlan, HalfStepPlan]]],
    size: int,
    usable: int,
    backend: str,
    host_memory: int | None,
    sizes: dict[str, int],
    q_keys: dict[str, tuple[str, int]],
) -> tuple[Side | None, tuple[HalfStepPlan, HalfStepPlan], BlockTier]:
    """Where `size` bytes of blocks per worker live (see the module doc), and the plan for
    it: the first of device, host and store (or the tier wanted) that `plan` fits. On CPU
    workers the host is the device, so ``host`` there is ``device``; a GPU plan without
    the workers' host memory (`host_memory` None) never picks ``host`` by itself. A
    refusal names the fixes that fit: another tier, or a larger forced q (`q_keys`: the
    config's setting and value by side) that leaves room for R on the workers."""
    word = wanted
    if backend != "cupy" and wanted == "host":
        wanted, word = "device", "host (on CPU workers: their memory)"
    tiers: list[BlockTier] = ["device", "host", "store"] if backend == "cupy" else [
        "device", "store"]

    def attempt(tier: BlockTier, free_q: bool = False) -> Any:
        """(host factor, halves, tier); else why not: a PlanError where the half-steps do
        not fit at all, or what R takes more room than (str)."""
        try:
            host_factor, halves = plan(tier, free_q)
        except PlanError as exc:
            if tier == "device":  # the store tier's plan says whether they fit without R
                return f"the {size_text(usable)} budget per worker leaves beside the half-steps"
            return exc
        if tier == "device" and host_factor is not None and wanted == "auto":
            try:  # R resident is not worth a factor in host memory that need not be there
                pushed_off = plan("store", free_q)[0] is None
            except PlanError:
                pushed_off = False
            if pushed_off:
                return "the room that keeps both factors on the device"
        if tier == "host":
            taken = 2 * sizes[host_factor] if host_factor else 0  # pieces, and parts gathered
            if size >= (host_memory or 0) * HOST_SHARE - taken:
                return (f"half of the host memory limit ({size_text(host_memory or 0)})"
                        + (f" less {size_text(taken)} for a factor" if taken else "")
                        + " allows")  # fmt: skip
        return host_factor, halves, tier

    for tier in tiers if wanted == "auto" else [wanted]:
        result = attempt(tier)
        if isinstance(result, tuple):
            return result
    if isinstance(result, PlanError):  # the half-steps do not fit (auto: the store's plan)
        raise result
    raised: dict[str, int] = {}  # device: the q that leaves room for R, by setting
    free = attempt("device", free_q=True) if wanted == "device" and q_keys else None
    for h in free[1] if isinstance(free, tuple) else ():
        key, q = q_keys.get(h.side, ("", h.q))
        if h.q > q:
            raised[key] = max(raised.get(key, 0), h.q)
    others = [t for t in tiers if t != wanted and isinstance(attempt(t), tuple)]
    if not (raised or others):  # the half-steps do not fit even without R beside them
        raise attempt("store")
    fixes = [f"set plan.blocks to {' or '.join(others)} (or auto)"] if others else []
    if raised:
        fixes.insert(0, "raise " + " and ".join(f"{k} to {v}" for k, v in raised.items())
                     + f" (or leave {'them' if len(raised) > 1 else 'it'} unset)")
    if wanted == "device":
        result += " at the forced q" if raised else " at any q"
    raise PlanError(
        f"plan.blocks is {word} but R needs {size_text(size)} per worker, more than "
        f"{result}; {', or '.join(fixes)}"
    )


def _price(
    h: HalfStepPlan, workers: int, backend: str, link: float, reduction: str,
    blocks_copied: float = 0.0,
) -> None:
    """Fill in h.predicted from the cost model (`blocks_copied`: :func:`.half_step_cost`)."""
    cost = half_step_cost(
        h.n_rows, h.n_cols, h.nnz, h.f, h.p, h.q, workers, backend, link, aligned=h.aligned,
        copied_in=h.copied_in, reduction=reduction, blocks_copied=blocks_copied,
    )
    h.predicted = {**asdict(cost), "seconds": cost.seconds}


def _aligned(
    side: Side,
    x: HalfStepPlan,
    theta: HalfStepPlan,
    forced: dict[str, tuple[int | None, int | None]],
    half: Any,
    price: Callable[[HalfStepPlan], None],
) -> tuple[HalfStepPlan, HalfStepPlan] | None:
    """(x, theta) with `side` data parallel over the batches the other half-step solved, or
    None when p or q of that side is forced, the other half-step is not model parallel over
    several batches, or it does not fit the memory."""
    other = theta if side == "x" else x
    if forced[side][0] is not None or other.p != 1 or other.q < 2:
        return None
    try:
        alt = half(side, other.q, forced[side][1])
    except PlanError:
        return None
    alt.aligned = alt.col_bounds == other.row_bounds
    alt.why = (f"data parallel over the batches update {other.label} solved, where "
               f"{other.label} stays" if alt.aligned
               else f"data parallel: predicted faster than every worker gathering {other.label}")
    price(alt)
    return (alt, theta) if side == "x" else (x, alt)
