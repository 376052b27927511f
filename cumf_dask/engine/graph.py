"""SU-ALS half-steps as Dask task graphs over the plan's blocks.

Update X (update Theta is the same with the roles swapped; the "col" orientation of R):

* p == 1 (model parallelism): the whole fixed factor is gathered once onto every worker;
  batch j runs ``update`` (hermitian + solve, no reduction) on worker j mod W next to its
  resident block R^(0j).
* p > 1 (data + model parallelism): part i of the fixed factor lives on worker i mod W with
  the blocks R^(ij); ``hermitian`` there gives partial A^(ij), B^(ij), packed to their lower
  triangles and cut into p slices; the reduction (engine.reduce) sums each slice and solves
  it. Weighted lambda is added once, in the solve, after the reduction.

Large data does not move: each task is pinned (``workers=[addr]``, no stealing to other
workers) to where its block lives. All q batches are submitted at once, so loading or
computing batch j+1 overlaps batch j on every worker.
"""

from __future__ import annotations

import itertools
import operator
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from distributed import Client, Future, as_completed

from ..data.store import RatingsStore
from ..plan import HalfPlan, Plan
from . import tasks
from .cluster import COMPUTE, has_compute_slots
from .reduce import reduce_slices

Piece = tuple[int, int, Future]
Progress = Callable[[str, int, int], None]


@dataclass
class Factor:
    """A factor held on the workers as row pieces (start, stop, future) covering [0, n_rows)."""

    n_rows: int
    f: int
    pieces: list[Piece]
    placed: dict[Any, Future] = field(default_factory=dict)  # gathered copies, by (plan, worker)
    version: str = field(default_factory=lambda: uuid.uuid4().hex[:6])  # unique in task keys


def even_bounds(n: int, parts: int) -> list[int]:
    parts = max(1, min(parts, n))
    return [round(k * n / parts) for k in range(parts + 1)]


class SUALSEngine:
    """Runs half-steps of a plan on a client; keeps resident blocks and counts between calls."""

    def __init__(
        self,
        client: Client,
        store: RatingsStore,
        plan: Plan,
        lam: float,
        backend: str,
        workers: list[str],
    ):
        self.client = client
        self.store = store
        self.plan = plan
        self.lam = float(lam)
        self.backend = backend
        self.workers = workers
        self.run = uuid.uuid4().hex[:8]
        self.compute_slots = has_compute_slots(client)
        self._cache: dict[Any, Future] = {}

    # ------------------------------------------------------------------ helpers
    def _submit(
        self, func, *args, key: str, worker: str, cache: Any = None, compute: bool = True
    ) -> Future:
        """Submit a task pinned to `worker`; `compute` tasks take a compute slot there."""
        if cache is not None and cache in self._cache:
            return self._cache[cache]
        fut = self.client.submit(
            func,
            *args,
            key=f"{key}-{self.run}",
            workers=[worker],
            allow_other_workers=False,
            pure=False,
            resources={COMPUTE: 1} if compute and self.compute_slots else None,
        )
        if cache is not None:
            self._cache[cache] = fut
        return fut

    def worker_of(self, h: HalfPlan, part: int, batch: int) -> str:
        """Where block (part, batch) lives: by batch when p == 1, by part when p > 1."""
        return self.workers[(batch if h.p == 1 else part) % len(self.workers)]

    def block(self, h: HalfPlan, part: int, batch: int, it: int, kind: str = "train") -> Future:
        """R^(ij) (or the held-out ratings of that block) on its worker; cached when resident."""
        rows = (h.row_bounds[batch], h.row_bounds[batch + 1])
        cols = (h.col_bounds[part], h.col_bounds[part + 1])
        orient = "test" if kind == "test" else h.orient
        resident = self.plan.resident
        tag = f"load-{kind}-{h.label}-batch{batch}-part{part}"
        return self._submit(
            tasks.load_block,
            self.store,
            orient,
            rows,
            cols,
            self.backend,
            key=tag if resident else f"{tag}-it{it}",
            worker=self.worker_of(h, part, batch),
            compute=False,
            cache=(kind, h.side, part, batch) if resident else None,
        )

    def counts(self, h: HalfPlan, lo: int, hi: int, worker: str) -> Future:
        return self._submit(
            tasks.load_counts,
            self.store,
            h.orient,
            (lo, hi),
            self.backend,
            key=f"counts-{h.label}-rows{lo}-{hi}-on-{self.workers.index(worker)}",
            worker=worker,
            compute=False,
            cache=("counts", h.side, lo, hi, worker),
        )

    def fixed_on(self, h: HalfPlan, fixed: Factor, part: int, worker: str, it: int) -> Future:
        """Rows of part `part` of the fixed factor gathered on `worker` (cached on the factor)."""
        lo, hi = h.col_bounds[part], h.col_bounds[part + 1]
        key = (h.side, lo, hi, worker)
        if key not in fixed.placed:
            name = "Theta" if h.side == "x" else "X"
            fixed.placed[key] = self.gather(
                fixed, lo, hi, worker, f"gather-{name}-part{part}-it{it}"
            )
        return fixed.placed[key]

    def gather(self, factor: Factor, lo: int, hi: int, worker: str, name: str) -> Future:
        """Rows [lo, hi) of a factor assembled on `worker` from its pieces."""
        return self.client.submit(
            tasks.assemble,
            lo,
            hi,
            self.backend,
            factor.pieces,
            key=f"{name}-on-{self.workers.index(worker)}-{factor.version}",
            workers=[worker],
            allow_other_workers=False,
            pure=False,
        )

    # ------------------------------------------------------------------ factors
    def initial(self, n_rows: int, f: int, seed: int, bounds: list[int]) -> Factor:
        """The seeded initial factor, one piece per bound interval, spread over workers."""
        pieces = []
        for k in range(len(bounds) - 1):
            lo, hi = bounds[k], bounds[k + 1]
            fut = self._submit(
                tasks.initial_factor,
                n_rows,
                f,
                seed,
                lo,
                hi,
                self.backend,
                key=f"init-factor-{k}",
                worker=self.workers[k % len(self.workers)],
            )
            pieces.append((lo, hi, fut))
        return Factor(n_rows, f, pieces)

    def from_host(self, array: np.ndarray, bounds: list[int]) -> Factor:
        """A factor scattered to the workers from a host array (used when resuming)."""
        pieces = []
        for k in range(len(bounds) - 1):
            lo, hi = bounds[k], bounds[k + 1]
            worker = self.workers[k % len(self.workers)]
            [fut] = self.client.scatter([array[lo:hi]], workers=[worker])
            if not self.backend.startswith("numpy"):
                fut = self.client.submit(
                    _to_backend,
                    fut,
                    self.backend,
                    workers=[worker],
                    pure=False,
                    key=f"to-device-{k}-{self.run}-{uuid.uuid4().hex[:4]}",
                )
            pieces.append((lo, hi, fut))
        return Factor(len(array), array.shape[1], pieces)

    # ------------------------------------------------------------------ the half-step
    def half_step(
        self, side: str, fixed: Factor, it: int, progress: Progress | None = None
    ) -> Factor:
        """Solve every row of one factor from the other (see module doc); waits for the result.

        `progress(stage, done, total)` is called as the batches (or slices) finish.
        """
        h = self.plan.half(side)
        build = self._model_parallel if h.p == 1 else self._data_parallel
        pieces = build(h, fixed, it)
        stage = f"update {h.label}"
        for done, fut in enumerate(as_completed([f for _, _, f in pieces]), 1):
            if fut.status == "error":
                fut.result()  # raises the task's exception here, with its message
            if progress is not None:
                progress(stage, done, len(pieces))
        return Factor(h.n_rows, h.f, pieces)

    def _model_parallel(self, h: HalfPlan, fixed: Factor, it: int) -> list[Piece]:
        pieces = []
        for j in range(h.q):
            worker = self.worker_of(h, 0, j)
            lo, hi = h.row_bounds[j], h.row_bounds[j + 1]
            fut = self._submit(
                tasks.update,
                self.block(h, 0, j, it),
                self.fixed_on(h, fixed, 0, worker, it),
                self.counts(h, lo, hi, worker),
                self.lam,
                self.backend,
                key=f"update-{h.label}-batch{j}-it{it}",
                worker=worker,
            )
            pieces.append((lo, hi, fut))
        return pieces

    def _data_parallel(self, h: HalfPlan, fixed: Factor, it: int) -> list[Piece]:
        pieces: list[Piece] = []
        one = self.plan.reduction == "one"
        for j in range(h.q):
            lo, hi = h.row_bounds[j], h.row_bounds[j + 1]
            cuts = even_bounds(hi - lo, 1 if one else h.p)
            slices = list(itertools.pairwise(cuts))
            partials: dict[int, list[Future]] = {k: [] for k in range(len(slices))}
            for i in range(h.p):
                worker = self.worker_of(h, i, j)
                herm = self._submit(
                    tasks.hermitian_slices,
                    self.block(h, i, j, it),
                    self.fixed_on(h, fixed, i, worker, it),
                    slices,
                    self.backend,
                    key=f"hermitian-{h.label}-batch{j}-part{i}-it{it}",
                    worker=worker,
                )
                for k in range(len(slices)):
                    partials[k].append(
                        self._submit(
                            operator.getitem,
                            herm,
                            k,
                            key=f"slice-{h.label}-batch{j}-part{i}-slice{k}-it{it}",
                            worker=worker,
                            compute=False,
                        )
                    )
            for k, (a, b) in enumerate(slices):
                target = self.workers[0] if one else self.workers[k % len(self.workers)]
                inputs = reduce_slices(self, h, partials[k], target, f"batch{j}-slice{k}-it{it}")
                fut = self._submit(
                    tasks.reduce_solve,
                    self.counts(h, lo + a, lo + b, target),
                    self.lam,
                    h.f,
                    self.backend,
                    *inputs,
                    key=f"reduce-solve-{h.label}-batch{j}-slice{k}-it{it}",
                    worker=target,
                )
                pieces.append((lo + a, lo + b, fut))
        return pieces

    # ------------------------------------------------------------------ evaluation
    def release(self) -> None:
        """Let go of the resident blocks, counts and factor copies held on the workers."""
        self._cache.clear()

    def rmse(self, X: Factor, Theta: Factor, it: int, kind: str = "train") -> float:
        """RMSE over the training (or held-out) ratings, computed where the X-side blocks live."""
        h = self.plan.x
        futures = []
        for j in range(h.q):
            lo, hi = h.row_bounds[j], h.row_bounds[j + 1]
            for i in range(h.p):
                worker = self.worker_of(h, i, j)
                x_rows = self.gather(X, lo, hi, worker, f"gather-X-batch{j}-{kind}")
                futures.append(
                    self._submit(
                        tasks.block_squared_error,
                        self.block(h, i, j, it, kind),
                        x_rows,
                        self.fixed_on(h, Theta, i, worker, it),
                        self.backend,
                        key=f"error-{kind}-batch{j}-part{i}-it{it}",
                        worker=worker,
                    )
                )
        results = self.client.gather(futures)
        total = sum(r[0] for r in results)
        count = sum(r[1] for r in results)
        return float(np.sqrt(total / count)) if count else float("nan")


def _to_backend(array: np.ndarray, backend: str) -> Any:
    return tasks.get_backend(backend).asarray(array)
