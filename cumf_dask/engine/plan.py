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
the workers' memory when they fit next to the working set (``device``), else on GPU workers
in pinned host memory, copied to the GPU by each half-step (``host``: at most half of the
worker's host memory limit, below Dask's spill threshold; a half-step's blocks of
STAGED_BLOCK_BYTES or more are copied ahead, so the plan is made again with room for three
of them), else read from the store by each
half-step (``store``, one block ahead of the computation). The factors' pieces stay on the
workers' devices when both fit next to the working set; else (GPU workers, the paper's
Facebook case) the larger factor lives in pinned host memory: its half-step copies each
solved batch out, and the other half-step copies it in one part at a time (the part is the
"fixed part" of the memory model, so a factor that does not fit makes that half-step data
parallel): each part once, with the parts as the outer loop, where the sums of all that
half-step's batches fit next to two parts and the cost model predicts it faster, else once
per batch. Partition boundaries balance ratings, not rows, so skewed data loads workers
evenly.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Literal

import numpy as np

from ..checks import check_choice
from ..config import BlockTier, FactorTier, PlanConfig, check_size, parse_size
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
FACTOR_TIERS = ("auto", "device", "host")


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
        out = asdict(self)
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
        if self.workers > 1:
            link = "in-process" if math.isinf(self.link) else f"{self.link / 1e9:.1f} GB/s"
            how = "measured" if self.link_measured else "assumed"
            aligned = [h.label for h in (self.x, self.theta) if h.aligned]
            lines.append(
                f"cost model: link {link} ({how}); "
                + (f"update {aligned[0]} is data parallel over the batches the other "
                   "half-step solved (the fixed factor does not move)" if aligned
                   else "both half-steps replicate the fixed factor or are forced")
            )  # fmt: skip
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
    takes a third of a second) and split into any number of parts by :meth:`bounds`.

    `counts` may be just the number of rows (counts unknown): splits are then even.
    """

    def __init__(self, counts: np.ndarray | int):
        self.n = counts if isinstance(counts, int) else len(counts)
        total = 0.0 if isinstance(counts, int) else float(counts.sum())
        self._weight: np.ndarray | None = None
        if total > 0:
            # Blend with an even split of rows so rows without ratings are spread too.
            weight = np.cumsum(counts, dtype=np.float64)
            weight /= total
            weight += np.arange(1, self.n + 1, dtype=np.float64) * (1e-3 / self.n)
            self._weight = weight

    def bounds(self, parts: int) -> list[int]:
        """parts + 1 boundaries splitting the rows so each part holds about the same ratings."""
        n = self.n
        parts = max(1, min(parts, n))
        if self._weight is None:
            return [round(i * n / parts) for i in range(parts + 1)]
        targets = np.arange(1, parts) / parts * self._weight[-1]
        cuts = np.searchsorted(self._weight, targets, side="left") + 1
        bounds = [0, *(int(c) for c in cuts), n]
        for i in range(1, parts):  # strictly increasing, and room left for the parts after i
            bounds[i] = min(max(bounds[i], bounds[i - 1] + 1), n - (parts - i))
        return bounds


def balanced_bounds(counts: np.ndarray | int, parts: int) -> list[int]:
    """parts + 1 boundaries splitting rows so each part holds about the same ratings
    (:class:`RowShares`, for one split)."""
    return RowShares(counts).bounds(parts)


def _memory(
    n_rows: int, n_cols: int, nnz: int, f: int, p: int, q: int, fused: bool,
    parts_outer: bool = False, host_blocks: bool = False, workers: int = 1,
    fixed_on_host: bool = False,
) -> dict:
    """Bytes per worker by item. p > 1: each worker sums its parts' packed partial (A, B) of
    a batch, and holds the parts of the fixed factor it gathered (ceil(p / workers) of
    them) for the half-step; a fixed factor in host memory (`fixed_on_host`) comes to the
    device one part per use, or with `parts_outer` (each part copied in once) two parts
    (one in use, the next arriving), and the sums of all batches are held;
    `host_blocks` (R in host memory): a block copied ahead (:func:`staged`) is on the
    device beside the one computing and the one before, whose kernels may still run.
    `fused` (the GPU's kernels): no f x f A at all; the fused update solves on chip, the
    Gram kernels write packed sums and the solve reads them as they are."""
    rows = math.ceil(n_rows / q)
    block = math.ceil(nnz / (p * q)) * RATING_BYTES
    if p == 1 or (fixed_on_host and not parts_outer):
        held = 1
    else:
        held = 2 if parts_outer else math.ceil(p / workers)
    est = {
        "solved batch": rows * f * BYTES,
        "fixed part": math.ceil(n_cols / p) * f * BYTES * held,
        "R block": block,
        "B": rows * f * BYTES,
    }
    if host_blocks and staged(block):
        est["R blocks ahead"] = 2 * block
    if not fused:  # the NumPy backend's Gram stores every row's f x f A (p > 1: then packs it)
        est["A"] = rows * f * f * BYTES
    if p > 1:
        packed = (f * (f + 1) // 2 + f) * BYTES  # a row's partial (A, B)
        summed = n_rows if parts_outer else rows
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
    host_blocks: bool = False,
) -> HalfStepPlan:
    """Choose p and q for one half-step (paper's best practices), honouring forced values;
    `parts_outer`, `host_blocks`: see :func:`_memory`; `fixed_on_host`: the fixed factor is
    in host memory (``copied_in`` counts its bytes that cross to each device). Data
    parallel, p starts
    where the fixed factor's part takes half the budget, and more parts are tried
    (:func:`_fastest_p`, by the predicted `seconds` of (p, q); without it, fewest blocks).

    Its ``predicted`` cost is filled in by make_plan, which knows the link.
    """
    def fits(p_: int, q_: int) -> bool:
        est = _memory(n_rows, n_cols, nnz, f, p_, q_, fused, parts_outer, host_blocks, workers,
                      fixed_on_host)  # fmt: skip
        return sum(est.values()) < budget

    q_max = max(1, n_rows)
    if p is None:
        if fits(1, q_max) or (q is not None and fits(1, q)):
            p = 1
        else:
            first = max(2, math.ceil(n_cols * f * BYTES / (budget / 2)))
            p = _fastest_p(first, n_cols, q, fits, q_max, seconds or operator.mul)
            if p > n_cols:
                raise PlanError(
                    f"update {side}: no partition fits {budget / 1e9:.2f} GB per worker with "
                    f"f={f} ({n_rows:,} x {n_cols:,}, {nnz:,} ratings); use more workers, a "
                    "larger plan.memory_budget, or fewer factors"
                )
    if q is None:
        q = next((qq for qq in _counts_from(1, q_max) if fits(p, qq)), q_max)
        if p == 1:  # every worker runs as many batches (smaller ones fit too)
            q = min(q_max, math.ceil(q / workers) * workers)
    p = max(1, min(p, n_cols))
    q = max(1, min(q, n_rows))
    memory = _memory(n_rows, n_cols, nnz, f, p, q, fused, parts_outer, host_blocks, workers,
                     fixed_on_host)  # fmt: skip
    if sum(memory.values()) >= budget:
        raise PlanError(
            f"update {side}: p={p}, q={q} needs {sum(memory.values()) / 1e9:.2f} GB per worker, "
            f"more than the {budget / 1e9:.2f} GB budget; raise q, lower f, or add memory"
        )
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
        memory=memory,
        parts_outer=parts_outer,
        staged="R blocks ahead" in memory,
        copied_in=_copied_in(n_cols, f, p, q, workers, parts_outer) if fixed_on_host else 0,
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
    """
    config = config or PlanConfig()
    budget = memory
    if config.memory_budget is not None:  # checked here too: a PlanConfig made in Python
        check_size("plan.memory_budget", config.memory_budget, of="the worker's memory")
        budget = parse_size(config.memory_budget, memory) or memory
    groups = config.groups
    if config.reduction == "two-phase" and groups is None and backend == "cupy":
        groups = nvml_groups(workers)  # None: one flat group
    if f < 1:
        raise PlanError(f"factors must be at least 1, got {f}")
    if workers < 1:
        raise PlanError("the cluster has no workers; start some or check the scheduler address")
    if config.headroom is not None:
        check_size("plan.headroom", config.headroom, of="the budget", free=True)
    usable = budget - (parse_size(config.headroom, budget) or 0)
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
        room: int, host: Side | None, host_blocks: bool = False
    ) -> tuple[HalfStepPlan, HalfStepPlan]:
        """The fastest predicted (x, theta) whose working memory fits `room` per worker, with
        factor `host` (if any) in host memory: the other half-step copies each of its parts
        in once where the sums of all its batches fit, else once per batch. `host_blocks`:
        R is in host memory (blocks copied ahead take room too)."""

        def half(side: Side, p: int | None, q: int | None) -> HalfStepPlan:
            rows, cols, rc, cc, _ = sides[side]

            def plan(parts_outer: bool = False, fixed_on_host: bool = False) -> HalfStepPlan:
                def seconds(p_: int, q_: int) -> float:
                    copied = _copied_in(cols, f, p_, q_, workers, parts_outer)
                    return half_step_cost(rows, cols, nnz, f, p_, q_, workers, backend, link_bw,
                                          copied_in=copied if fixed_on_host else 0,
                                          reduction=config.reduction).seconds

                return _half_step(side, rows, cols, nnz, f, workers, room, rc, cc, p=p, q=q,
                                  fused=backend == "cupy", parts_outer=parts_outer,
                                  fixed_on_host=fixed_on_host, seconds=seconds,
                                  host_blocks=host_blocks)  # fmt: skip

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
                price(option)
            return min(options, key=lambda h: h.predicted["seconds"])

        x, theta = (half(side, *forced[side]) for side in ("x", "theta"))  # type: ignore[arg-type]
        for h in (x, theta):
            price(h)
        candidates = [(x, theta)]
        if workers > 1:
            for side in ("x", "theta"):
                alternative = _aligned(side, x, theta, forced, half, price)
                if alternative is not None:
                    candidates.append(alternative)
        return min(candidates, key=lambda c: c[0].predicted["seconds"] + c[1].predicted["seconds"])

    sizes = {"x": factor_bytes(m, f, workers), "theta": factor_bytes(n, f, workers)}
    r_bytes = block_bytes(nnz, held_out, workers)

    def tiers(host_blocks: bool) -> tuple[Side | None, HalfStepPlan, HalfStepPlan, BlockTier]:
        """(factor in host memory, x, theta, block tier); `host_blocks`: planned for R in
        host memory (which the block tier must then still be)."""
        host_factor, (x, theta) = _factor_tier(
            config.factors, sizes, usable, backend, partial(half_steps, host_blocks=host_blocks)
        )
        working = max(x.peak, theta.peak)
        on_device = sum(size for side, size in sizes.items() if side != host_factor)
        host_taken = 2 * sizes[host_factor] if host_factor else 0  # pieces, and parts gathered
        wanted = "host" if host_blocks else config.blocks
        blocks = _block_tier(wanted, r_bytes, working + on_device, usable, backend, host_memory,
                             host_taken)  # fmt: skip
        return host_factor, x, theta, blocks

    host_factor, x, theta, blocks = tiers(host_blocks=False)
    if blocks == "host":  # plan again with room for the blocks copied ahead
        host_factor, x, theta, blocks = tiers(host_blocks=True)
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
    )  # fmt: skip


def _factor_tier(
    wanted: FactorTier,
    sizes: dict[str, int],
    usable: int,
    backend: str,
    half_steps: Callable[[int, Side | None], tuple[HalfStepPlan, HalfStepPlan]],
) -> tuple[Side | None, tuple[HalfStepPlan, HalfStepPlan]]:
    """Which factor lives in host memory (None: both on the devices, see the module doc),
    and the half-steps planned in the room the factors on the devices leave. `sizes`: each
    factor's bytes per worker. On CPU workers the host is the device: always None there."""
    check_choice("plan.factors", wanted, FACTOR_TIERS)
    if backend != "cupy":
        return None, half_steps(usable, None)
    larger: Side = "x" if sizes["x"] >= sizes["theta"] else "theta"
    gb = 1e9
    if wanted != "host":
        try:
            return None, half_steps(usable - sum(sizes.values()), None)
        except PlanError:
            if wanted == "device":
                raise PlanError(
                    f"plan.factors is device but X and Theta take {sum(sizes.values()) / gb:.2f} "
                    f"GB per worker, too much to leave room for the half-steps in the "
                    f"{usable / gb:.2f} GB budget; set plan.factors to host (or auto)"
                ) from None
    smaller = sizes["theta" if larger == "x" else "x"]
    try:
        return larger, half_steps(usable - smaller, larger)
    except PlanError as exc:
        raise PlanError(
            f"{exc} (with {'X' if larger == 'x' else 'Theta'} in host memory and "
            f"{smaller / gb:.2f} GB of the budget for the other factor)"
        ) from None


def _block_tier(
    wanted: BlockTier, size: float, working: int, usable: int, backend: str,
    host_memory: int | None, host_taken: int = 0,
) -> BlockTier:
    """Where `size` bytes of blocks per worker live (see the module doc), next to `working`
    bytes on the device and `host_taken` in host memory (a factor there). On CPU workers the
    host is the device, so ``host`` there is ``device``; a GPU plan without the workers'
    host memory (`host_memory` None) never picks ``host`` by itself."""
    check_choice("plan.blocks", wanted, ("auto", "device", "host", "store"))
    if backend != "cupy" and wanted == "host":
        wanted = "device"
    host_room = (host_memory or 0) * HOST_SHARE - host_taken
    fits = {
        "device": working + size < usable,
        "host": backend == "cupy" and size < host_room,
        "store": True,
    }
    if wanted == "auto":
        return next(tier for tier in ("device", "host", "store") if fits[tier])  # type: ignore[return-value]
    if not fits[wanted]:
        room = (
            f"{usable / 1e9:.2f} GB per worker with {working / 1e9:.2f} GB of working memory"
            if wanted == "device"
            else f"half of the host memory limit ({(host_memory or 0) / 1e9:.2f} GB)"
            + (f" less {host_taken / 1e9:.2f} GB for a factor" if host_taken else "")
        )
        others = [t for t in ("device", "host", "store") if t != wanted and fits[t]]
        raise PlanError(
            f"plan.blocks is {wanted} but R needs {size / 1e9:.2f} GB per worker, more than "
            f"{room} allows; set plan.blocks to {' or '.join(others)} (or auto)"
        )
    return wanted


def _price(h: HalfStepPlan, workers: int, backend: str, link: float, reduction: str) -> None:
    """Fill in h.predicted from the cost model."""
    cost = half_step_cost(
        h.n_rows, h.n_cols, h.nnz, h.f, h.p, h.q, workers, backend, link, aligned=h.aligned,
        copied_in=h.copied_in, reduction=reduction,
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
    price(alt)
    return (alt, theta) if side == "x" else (x, alt)
