"""SU-ALS half-steps as Dask task graphs over the plan's blocks.

Update X (update Theta is the same with the roles swapped; the "col" orientation of R):

* p == 1 (model parallelism): the whole fixed factor is gathered once onto every worker;
  batch j runs ``update`` (hermitian + solve, no reduction) on its worker next to its
  resident block R^(0j).
* p > 1 (data + model parallelism): part i of the fixed factor lives on its worker with
  the blocks R^(ij); ``hermitian`` there gives partial A^(ij), B^(ij), packed to their lower
  triangles and cut into slices; the reduction (:mod:`.reduce`) sums each slice and solves
  it. Weighted lambda is added once, in the solve, after the reduction.

Where each task runs is :mod:`.placement`'s decision. All q batches are submitted at once,
so loading or computing batch j+1 overlaps batch j on every worker.
"""

from __future__ import annotations

import operator
import uuid
from typing import Any

import numpy as np
from distributed import Client, Future, as_completed

from ..callbacks import Progress
from ..data.store import RatingsStore
from . import tasks
from .placement import Factor, Piece, Pinned, Placement
from .plan import HalfStepPlan, Plan, balanced_bounds
from .reduce import final_inputs, slice_bounds


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
        compute_slots: bool = False,
    ):
        self.client = client
        self.store = store
        self.plan = plan
        self.lam = float(lam)
        self.backend = backend
        self.place = Placement(workers)
        self.run = uuid.uuid4().hex[:8]
        self.submit = Pinned(client, self.run, compute_slots)
        self._resident: dict[Any, Future] = {}  # blocks and counts loaded once

    # ------------------------------------------------------------------ inputs on workers
    def _cached(self, key: Any, make: Any) -> Future:
        if key not in self._resident:
            self._resident[key] = make()
        return self._resident[key]

    def block(self, h: HalfStepPlan, part: int, batch: int, it: int, split: str = "train"):
        """R^(ij) (or the held-out ratings of that block) on its worker; loaded once when
        the plan keeps R resident, else every half-step."""
        rows = (h.row_bounds[batch], h.row_bounds[batch + 1])
        cols = (h.col_bounds[part], h.col_bounds[part + 1])
        tag = f"load-{split}-{h.label}-batch{batch}-part{part}"

        def load() -> Future:
            return self.submit(
                tasks.load_block, self.store, h.orient, split, rows, cols, self.backend,
                key=tag if self.plan.resident else f"{tag}-it{it}",
                worker=self.place.block(h, part, batch), compute=False,
            )  # fmt: skip

        return self._cached((split, h.side, part, batch), load) if self.plan.resident else load()

    def counts(self, h: HalfStepPlan, lo: int, hi: int, worker: str) -> Future:
        """Total rating counts of rows [lo, hi) on `worker` (for weighted lambda)."""
        tag = f"counts-{h.label}-rows{lo}-{hi}-on-{self.place.index(worker)}"
        return self._cached(
            ("counts", h.side, lo, hi, worker),
            lambda: self.submit(
                tasks.load_counts, self.store, h.orient, (lo, hi), self.backend,
                key=tag, worker=worker, compute=False,
            ),
        )

    def fixed_on(self, h: HalfStepPlan, fixed: Factor, part: int, worker: str, it: int):
        """Rows of part `part` of the fixed factor gathered on `worker` (cached on the factor)."""
        lo, hi = h.col_bounds[part], h.col_bounds[part + 1]
        if (lo, hi, worker) not in fixed.placed:
            name = "Theta" if h.side == "x" else "X"
            fixed.placed[(lo, hi, worker)] = self.gather(
                fixed, lo, hi, worker, f"gather-{name}-part{part}-it{it}"
            )
        return fixed.placed[(lo, hi, worker)]

    def gather(self, factor: Factor, lo: int, hi: int, worker: str, name: str) -> Future:
        """Rows [lo, hi) of a factor assembled on `worker` from its pieces."""
        key = f"{name}-on-{self.place.index(worker)}-{factor.version}"
        return self.submit(
            tasks.assemble, lo, hi, self.backend, factor.pieces, key=key, worker=worker,
            compute=False,
        )  # fmt: skip

    def prepare(self, f: int) -> None:
        """Compile each worker's kernels in the background (not a compute task: loads and
        computations that need the kernels wait for the compile lock, not for this task)."""
        for k, worker in enumerate(self.place.workers):
            self.submit(tasks.prepare, f, self.backend, key=f"prepare-{k}", worker=worker,
                        compute=False)  # fmt: skip

    # ------------------------------------------------------------------ factors
    def initial(self, n_rows: int, f: int, seed: int) -> Factor:
        """The seeded initial factor, one piece per worker."""
        bounds = balanced_bounds(n_rows, len(self.place.workers))
        pieces: list[Piece] = []
        for k in range(len(bounds) - 1):
            lo, hi = bounds[k], bounds[k + 1]
            fut = self.submit(
                tasks.initial_factor, n_rows, f, seed, lo, hi, self.backend,
                key=f"init-factor-{k}", worker=self.place.piece(k),
            )  # fmt: skip
            pieces.append((lo, hi, fut))
        return Factor(n_rows, f, pieces)

    def from_host(self, array: np.ndarray) -> Factor:
        """A factor scattered to the workers from a host array (used when resuming)."""
        bounds = balanced_bounds(len(array), len(self.place.workers))
        pieces: list[Piece] = []
        for k in range(len(bounds) - 1):
            lo, hi = bounds[k], bounds[k + 1]
            worker = self.place.piece(k)
            [fut] = self.client.scatter([array[lo:hi]], workers=[worker])
            if not self.backend.startswith("numpy"):
                fut = self.submit(
                    tasks.to_backend, fut, self.backend,
                    key=f"to-device-{k}-{uuid.uuid4().hex[:4]}", worker=worker, compute=False,
                )  # fmt: skip
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
        futures = [f for _, _, f in pieces]
        for done, fut in enumerate(as_completed(futures, loop=self.client.loop), 1):
            if fut.status == "error":
                fut.result()  # raises the task's exception here, with its message
            if progress is not None:
                progress(stage, done, len(pieces))
        return Factor(h.n_rows, h.f, pieces)

    def _model_parallel(self, h: HalfStepPlan, fixed: Factor, it: int) -> list[Piece]:
        pieces: list[Piece] = []
        for j in range(h.q):
            worker = self.place.block(h, 0, j)
            lo, hi = h.row_bounds[j], h.row_bounds[j + 1]
            fut = self.submit(
                tasks.update, self.block(h, 0, j, it), self.fixed_on(h, fixed, 0, worker, it),
                self.counts(h, lo, hi, worker), self.lam, self.backend,
                key=f"update-{h.label}-batch{j}-it{it}", worker=worker,
            )  # fmt: skip
            pieces.append((lo, hi, fut))
        return pieces

    def _data_parallel(self, h: HalfStepPlan, fixed: Factor, it: int) -> list[Piece]:
        pieces: list[Piece] = []
        reduction, workers = self.plan.reduction, self.place.workers
        for j in range(h.q):
            lo, hi = h.row_bounds[j], h.row_bounds[j + 1]
            slices = slice_bounds(hi - lo, h.p, reduction)
            partials: list[list[Future]] = [[] for _ in slices]
            sources = []
            for i in range(h.p):
                worker = self.place.block(h, i, j)
                sources.append(self.place.index(worker))
                herm = self.submit(
                    tasks.hermitian_slices, self.block(h, i, j, it),
                    self.fixed_on(h, fixed, i, worker, it), slices, self.backend,
                    key=f"hermitian-{h.label}-batch{j}-part{i}-it{it}", worker=worker,
                )  # fmt: skip
                for k in range(len(slices)):
                    partials[k].append(
                        self.submit(
                            operator.getitem, herm, k, worker=worker, compute=False,
                            key=f"slice-{h.label}-batch{j}-part{i}-slice{k}-it{it}",
                        )
                    )
            for k, (a, b) in enumerate(slices):
                target = self.place.reduced_slice(k, reduction)
                tag = f"{h.label}-batch{j}-slice{k}-it{it}"
                inputs = final_inputs(
                    partials[k], sources, self.place.index(target), reduction,
                    self.plan.groups, workers, self.submit, tag,
                )  # fmt: skip
                fut = self.submit(
                    tasks.reduce_solve, self.counts(h, lo + a, lo + b, target), self.lam,
                    h.f, self.backend, *inputs, key=f"reduce-solve-{tag}", worker=target,
                )  # fmt: skip
                pieces.append((lo + a, lo + b, fut))
        return pieces

    # ------------------------------------------------------------------ evaluation
    def rmse(self, X: Factor, Theta: Factor, it: int, split: str = "train") -> float:
        """RMSE over the training (or held-out) ratings, computed where the X-side blocks live."""
        return self.rmses(X, Theta, it, (split,))[split]

    def rmses(self, X: Factor, Theta: Factor, it: int, splits: tuple[str, ...]) -> dict[str, float]:
        """RMSE of each split ("train", "test") in one round of tasks: the X rows and Theta
        parts are placed once for all splits, and one gather waits for every error."""
        h = self.plan.x
        futures: dict[str, list[Future]] = {split: [] for split in splits}
        for j in range(h.q):
            lo, hi = h.row_bounds[j], h.row_bounds[j + 1]
            for i in range(h.p):
                worker = self.place.block(h, i, j)
                x_rows = self.gather(X, lo, hi, worker, f"gather-X-batch{j}-eval")
                fixed = self.fixed_on(h, Theta, i, worker, it)
                for split in splits:
                    futures[split].append(
                        self.submit(
                            tasks.block_squared_error, self.block(h, i, j, it, split), x_rows,
                            fixed, self.backend, key=f"error-{split}-batch{j}-part{i}-it{it}",
                            worker=worker,
                        )
                    )
        results = self.client.gather(futures)
        out = {}
        for split, parts in results.items():
            total, count = sum(r[0] for r in parts), sum(r[1] for r in parts)
            out[split] = float(np.sqrt(total / count)) if count else float("nan")
        return out

    def release(self) -> None:
        """Let go of the resident blocks and counts held on the workers."""
        self._resident.clear()
