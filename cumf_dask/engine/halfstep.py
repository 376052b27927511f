"""SU-ALS half-steps as Dask task graphs over the plan's blocks.

Update X (update Theta is the same with the roles swapped; the "col" orientation of R):

* p == 1 (model parallelism): the whole fixed factor goes to every worker (each piece
  once; the task that uses them puts them together: :meth:`SUALSEngine.fixed_on`);
  batch j runs ``update`` (hermitian + solve, no reduction) on its worker next to its
  resident block R^(0j).
* p > 1 (data + model parallelism): part i of the fixed factor lives on its worker with
  the blocks R^(ij); ``hermitian`` there gives partial A^(ij), B^(ij), packed to their lower
  triangles, and each worker sums those of its parts (batch by batch, or with the parts as
  the outer loop when the fixed factor is in host memory, so each part is copied to the GPU
  once: ``HalfStepPlan.parts_outer``); the reduction (:mod:`.reduce`) cuts the sums into
  slices, adds up each slice and solves it. Weighted lambda is added once, in the solve.

Implicit feedback (:mod:`cumf_dask.backend.objective`) adds the fixed factor's Gram
G0 = Y^T Y to every row's system: one small ``gram`` task per piece of the fixed factor, on
the piece's worker, and one ``sum-gram`` task; the update (p == 1) and reduce-solve (p > 1)
tasks take it as an input, so Dask moves the f x f result to each worker that needs it once.
Like lambda it is added after the reduction: the partial Hermitians never include it. The CG
solver warm-starts each row from its previous value: the rows of the previous iterate of the
solved factor are gathered next to each update or reduce-solve task.

Where each task runs is :mod:`.placement`'s decision. All q batches are submitted at once,
so loading or computing batch j+1 overlaps batch j on every worker. Blocks read from the
store every half-step (``plan.blocks: store``, out of core) are read one block ahead of
each worker's computation, no further (:class:`ReadAhead`), so a worker holds at most two;
big blocks in host memory (``plan.blocks: host``) are copied to the device the same way,
on the loading thread and a side stream, so a block's copy overlaps the computation before
it (smaller ones are copied by the task that uses them).
Every wait goes through :class:`~.watch.Watch` (a lost or memory-paused worker raises
instead of hanging), and :meth:`SUALSEngine.recover` re-places everything on the workers
present after a loss.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
from distributed import Client, Future

from ..backend.objective import UpdateSpec, as_spec
from ..callbacks import Progress
from ..data.store import RatingsStore
from . import tasks
from .cluster import workers_info
from .placement import Factor, Piece, Pinned, Placement, Rows
from .plan import HalfStepPlan, Plan, balanced_bounds
from .reduce import final_inputs, slice_bounds
from .watch import Watch

SCORING = 1  # task priority of scoring: before the next iteration's tasks, queued already


class ReadAhead:
    """Bounds the blocks a plan moves per use holds: the read (``blocks: store``) or the copy
    to the device (``blocks: host``) of a worker's next block waits for the computation two
    before it on that worker (one block computing, one arriving). One instance spans
    consecutive half-steps, which are submitted behind each other."""

    def __init__(self, streamed: bool, name: str):
        self.streamed = streamed
        self.name = name  # in the reads' task keys: one block read for two uses is two reads
        self._computed: dict[str, deque[Future]] = {}

    def after(self, worker: str) -> Future | None:
        """What the next read on `worker` waits for (None: nothing, or blocks on the device)."""
        done = self._computed.get(worker)
        return done[0] if self.streamed and done is not None and len(done) == 2 else None

    def computed(self, worker: str, fut: Future) -> None:
        """`fut` computes on the block read last on `worker`."""
        if self.streamed:
            self._computed.setdefault(worker, deque(maxlen=2)).append(fut)


class SUALSEngine:
    """Runs half-steps of a plan on a client; keeps resident blocks and counts between calls."""

    def __init__(
        self,
        client: Client,
        store: RatingsStore,
        plan: Plan,
        spec: UpdateSpec | float,
        backend: str,
        workers: list[str],
        compute_slots: bool = False,
        read_threads: dict[str, int] | None = None,
    ):
        self.client = client
        self.store = store
        self.plan = plan
        self.spec = as_spec(spec)
        self.backend = backend
        self.place = Placement(workers)
        self.run = uuid.uuid4().hex[:8]
        self.submit = Pinned(client, self.run, compute_slots)
        self.read_threads = read_threads or {}  # threads per worker for reading blocks
        self.watch = Watch(client, workers)
        self._resident: dict[Any, Future] = {}  # blocks and counts loaded once
        self._ahead = self._read_ahead("update")  # the half-steps' reads

    def recover(
        self, workers: list[str], plan: Plan, compute_slots: bool, read_threads: dict[str, int]
    ) -> None:
        """Start over on `workers` with `plan` (made for them) after a loss: new placement
        and task keys; the resident blocks are dropped (the next half-step reloads them from
        the store where they now belong). Factors on the workers are not kept: the caller
        restores them."""
        self._resident.clear()  # dropped, which releases them (see watch.check)
        self.plan = plan
        self.read_threads = read_threads
        self.place = Placement(workers)
        self.run = uuid.uuid4().hex[:8]
        self.submit = Pinned(self.client, self.run, compute_slots)
        self.watch = Watch(self.client, workers)
        self._ahead = self._read_ahead("update")

    # ------------------------------------------------------------------ inputs on workers
    def _read_ahead(self, name: str) -> ReadAhead:
        """A read-ahead bound for one use of the blocks (bounds the blocks not kept on the
        devices)."""
        return ReadAhead(self.plan.blocks != "device", name)

    def staged(self, h: HalfStepPlan) -> bool:
        """Whether `h`'s blocks in host memory are copied to the device by tasks of their own
        (``tasks.staged_copy``), each while the block before it is computed: where the plan
        says so (blocks big enough, ``plan.STAGED_BLOCK_BYTES``, for the copy to outlast the
        scheduler's round trip that such a task adds). Facebook x0.01 on an H200: update X's
        1.6 GB blocks, 0.39 -> 0.26 s per half-step; update Theta's 118 MB ones, 0.81 ->
        0.87-1.13 s."""
        return self.plan.blocks == "host" and h.staged

    def _moved_per_use(self, h: HalfStepPlan) -> bool:
        """Whether each use of `h`'s blocks reads them from the store or stages a copy."""
        return self.plan.blocks == "store" or self.staged(h)

    def _cached(self, key: Any, make: Any) -> Future:
        if key not in self._resident:
            self._resident[key] = make()
        return self._resident[key]

    def block(
        self,
        h: HalfStepPlan,
        part: int,
        batch: int,
        it: int,
        split: str = "train",
        ahead: ReadAhead | None = None,
    ):
        """R^(ij) (or the held-out ratings of that block) on its worker; loaded once when
        the plan keeps R resident (on the device or the host), else every half-step, as
        `ahead` allows."""
        rows = (h.row_bounds[batch], h.row_bounds[batch + 1])
        cols = (h.col_bounds[part], h.col_bounds[part + 1])
        tag = f"load-{split}-{h.label}-batch{batch}-part{part}"

        worker = self.place.block(h, part, batch)

        def load() -> Future:
            return self.submit(
                tasks.load_block, self.store, h.orient, split, rows, cols, self.backend,
                self.read_threads.get(worker, 1), self.plan.blocks == "host",
                ahead.after(worker) if ahead is not None and not self.plan.resident else None,
                worker=worker, compute=False,
                key=tag if self.plan.resident else f"{tag}-it{it}-{ahead.name if ahead else ''}",
            )  # fmt: skip

        return self._cached((split, h.side, part, batch), load) if self.plan.resident else load()

    def block_in_use(
        self, h: HalfStepPlan, part: int, batch: int, it: int, ahead: ReadAhead
    ) -> Future:
        """R^(ij) where an update task reads it; where :meth:`staged`, a block in host memory
        copied to the device for this use on its worker's loading thread, while the block
        before it is computed (`ahead` bounds it to one block ahead)."""
        block = self.block(h, part, batch, it, ahead=ahead)
        if not self.staged(h):
            return block
        worker = self.place.block(h, part, batch)
        return self.submit(
            tasks.staged_copy, block, self.backend, ahead.after(worker), worker=worker,
            compute=False, key=f"stage-{h.label}-batch{batch}-part{part}-it{it}-{ahead.name}",
        )  # fmt: skip

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

    def fixed_on(self, h: HalfStepPlan, fixed: Factor, part: int, worker: str, it: int) -> Rows:
        """Rows of part `part` of the fixed factor for a task on `worker`, which assembles
        them (``tasks.rows_from``). A factor on the devices is handed over as its own
        pieces: the task waits for the solves themselves, not for a gather task between
        (one round trip through the scheduler less, 2-3 ms per half-step on two GPUs). A
        factor in host memory is gathered on the worker once, cached on the factor, so its
        tasks do not each concatenate host arrays."""
        lo, hi = h.col_bounds[part], h.col_bounds[part + 1]
        if not self.plan.on_host(self.plan.other(h.side).side):
            return fixed.rows(lo, hi)
        if (lo, hi, worker) not in fixed.placed:
            name = "Theta" if h.side == "x" else "X"
            fixed.placed[(lo, hi, worker)] = self.gather(
                fixed, lo, hi, worker, f"gather-{name}-part{part}-it{it}"
            )
        return lo, hi, [(lo, hi, fixed.placed[(lo, hi, worker)])]

    def copied_in(
        self, h: HalfStepPlan, fixed: Factor, part: int, worker: str, it: int, after: Any
    ) -> Rows:
        """Part `part` of a fixed factor in host memory assembled in `worker`'s device
        memory, once for the half-step's tasks on it (``h.parts_outer``); a compute task
        after `after` (every task that used the worker's previous part), so a worker holds
        one part and the next one arriving. Not cached on the factor: it goes once this
        half-step's tasks are done."""
        lo, hi = h.col_bounds[part], h.col_bounds[part + 1]
        name = "Theta" if h.side == "x" else "X"
        copy = self.gather(fixed, lo, hi, worker, f"copy-in-{name}-part{part}-it{it}",
                           on_device=True, after=after)  # fmt: skip
        return lo, hi, [(lo, hi, copy)]

    def gather(
        self,
        factor: Factor,
        lo: int,
        hi: int,
        worker: str,
        name: str,
        priority: int = 0,
        on_device: bool = False,
        after: Any = None,
    ) -> Future:
        """Rows [lo, hi) of a factor assembled on `worker` by a task of its own (only the
        pieces that hold them move: a batch's warm start or RMSE rows are mostly on its own
        worker); `on_device`, `after`: see :meth:`copied_in`."""
        key = f"{name}-on-{self.place.index(worker)}-{factor.version}"
        return self.submit(
            tasks.rows_from, factor.rows(lo, hi), self.backend, on_device, after, key=key,
            worker=worker, compute=on_device, priority=priority,
        )  # fmt: skip

    def preload(self, held_out: bool) -> None:
        """Start loading every resident block of both half-steps now (loads take no compute
        slot), so update Theta's blocks arrive while update X computes; with `held_out`
        also the held-out blocks the RMSE reads. Streamed plans load per half-step."""
        if not self.plan.resident:
            return
        splits = ("train", "test") if held_out else ("train",)
        for split in splits:
            for h in (self.plan.x, self.plan.theta) if split == "train" else (self.plan.x,):
                for j in range(h.q):
                    for i in range(h.p):
                        self.block(h, i, j, 0, split)

    def prepare(self, f: int) -> None:
        """Compile each worker's kernels in the background (a task that starts a thread of
        the worker's own, so call this before the loads are queued: the task is then the
        first to run; computations that need the kernels wait for the compile lock)."""
        for k, worker in enumerate(self.place.workers):
            self.submit(tasks.prepare, f, self.backend, self.spec, key=f"prepare-{k}",
                        worker=worker, compute=False)  # fmt: skip

    # ------------------------------------------------------------------ factors
    def initial(self, side: str, f: int, seed: int, scale: float | None = None) -> Factor:
        """The seeded initial factor solved by half-step `side`, one piece per worker (random
        stream 1: Theta, 2: X; values uniform in [0, scale), see
        :func:`~cumf_dask.factors.init_factor`)."""
        n_rows = self.plan.half(side).n_rows
        stream = 2 if side == "x" else 1
        bounds = balanced_bounds(n_rows, len(self.place.workers))
        pieces: list[Piece] = []
        owners = []
        for k in range(len(bounds) - 1):
            lo, hi = bounds[k], bounds[k + 1]
            fut = self.submit(
                tasks.initial_factor, n_rows, f, seed, lo, hi, self.backend, stream, scale,
                self.plan.on_host(side), key=f"init-factor{stream}-{k}",
                worker=self.place.piece(k),
            )  # fmt: skip
            pieces.append((lo, hi, fut))
            owners.append(self.place.piece(k))
        return Factor(n_rows, f, pieces, owners=owners)

    def from_host(self, array: np.ndarray, side: str) -> Factor:
        """The factor solved by half-step `side`, scattered to the workers from a host array
        (used when resuming)."""
        bounds = balanced_bounds(len(array), len(self.place.workers))
        pieces: list[Piece] = []
        owners = []
        for k in range(len(bounds) - 1):
            lo, hi = bounds[k], bounds[k + 1]
            worker = self.place.piece(k)
            owners.append(worker)
            [fut] = self.client.scatter([array[lo:hi]], workers=[worker])
            if not self.backend.startswith("numpy"):
                fut = self.submit(
                    tasks.to_backend, fut, self.backend, self.plan.on_host(side),
                    key=f"to-device-{k}-{uuid.uuid4().hex[:4]}", worker=worker, compute=False,
                )  # fmt: skip
            pieces.append((lo, hi, fut))
        return Factor(len(array), array.shape[1], pieces, owners=owners)

    def factor_gram(self, factor: Factor, name: str) -> Future:
        """G = factor^T factor: one task per piece on its worker, then one sum task."""
        grams = []
        for k, ((_, _, fut), owner) in enumerate(zip(factor.pieces, factor.owners, strict=True)):
            key = f"gram-{name}-piece{k}-{factor.version}"
            grams.append(self.submit(tasks.gram, fut, self.backend, worker=owner, key=key))
        return self.submit(
            tasks.sum_grams, *grams, key=f"sum-gram-{name}-{factor.version}",
            worker=factor.owners[0],
        )  # fmt: skip

    # ------------------------------------------------------------------ the half-step
    def submit_half_step(
        self, side: str, fixed: Factor, it: int, previous: Factor | None = None
    ) -> Factor:
        """Submit a half-step's graph and return at once: the solved factor's pieces are
        futures, so the next half-step can be submitted behind it and starts as soon as
        they exist (no round trip through this process in between). `previous`: the solved
        factor's previous iterate, where the CG solver starts from."""
        h = self.plan.half(side)
        gram0 = None
        if self.spec.implicit:
            gram0 = self.factor_gram(fixed, "Theta" if side == "x" else "X")
        warm = previous if self.spec.cg else None
        build = self._model_parallel if h.p == 1 else self._data_parallel
        pieces, owners = build(h, fixed, it, gram0, warm)
        return Factor(h.n_rows, h.f, pieces, owners=owners,
                      checks=self._finite_checks(h, pieces, owners, it))  # fmt: skip

    def _finite_checks(
        self, h: HalfStepPlan, pieces: list[Piece], owners: list[str], it: int
    ) -> list[Future]:
        """One tasks.check_finite per worker over the pieces it solved (see there). Not a
        compute task: it waits for the GPU to finish them, while the worker's compute slot
        queues the next tasks' kernels behind them."""
        checks = []
        for worker in dict.fromkeys(owners):
            mine = [(p[0], p[2]) for p, w in zip(pieces, owners, strict=True) if w == worker]
            checks.append(self.submit(
                tasks.check_finite, [lo for lo, _ in mine], self.backend,
                self.plan.on_host(h.side), *(fut for _, fut in mine), worker=worker, compute=False,
                key=f"finite-{h.label}-w{self.place.index(worker)}-it{it}",
            ))  # fmt: skip
        return checks

    def wait(self, factor: Factor, side: str, progress: Progress | None = None) -> Factor:
        """Wait for a submitted half-step and its non-finite checks; `progress(stage, done,
        total)` as its batches (or slices) finish."""
        stage = f"update {self.plan.half(side).label}"
        done = 0

        def report(_: Future) -> None:
            nonlocal done
            done += 1
            if progress is not None:
                progress(stage, done, len(factor.pieces))

        self.watch.wait([f for _, _, f in factor.pieces], on_done=report)
        self.watch.wait(factor.checks)
        return factor

    def _warm(
        self, h: HalfStepPlan, previous: Factor | None, lo: int, hi: int, worker: str, tag: str
    ) -> Future | None:
        """Rows [lo, hi) of the previous iterate on `worker` (None: no warm start)."""
        if previous is None:
            return None
        return self.gather(previous, lo, hi, worker, f"warm-{h.label}-{tag}")

    def _model_parallel(
        self, h: HalfStepPlan, fixed: Factor, it: int, gram0: Any, previous: Factor | None
    ) -> tuple[list[Piece], list[str]]:
        pieces: list[Piece] = []
        owners = []
        ahead = self._ahead
        copies: dict[str, Rows] = {}  # h.parts_outer: the fixed factor on each device
        for j in range(h.q):
            worker = self.place.block(h, 0, j)
            lo, hi = h.row_bounds[j], h.row_bounds[j + 1]
            if not h.parts_outer:
                fixed_part = self.fixed_on(h, fixed, 0, worker, it)
            elif worker in copies:
                fixed_part = copies[worker]
            else:
                fixed_part = copies[worker] = self.copied_in(h, fixed, 0, worker, it, None)
            x0 = self._warm(h, previous, lo, hi, worker, f"batch{j}-it{it}")
            fut = self.submit(
                tasks.update, self.block_in_use(h, 0, j, it, ahead), fixed_part,
                self.counts(h, lo, hi, worker), self.spec, self.backend, gram0, x0,
                self.plan.on_host(h.side), lo, key=f"update-{h.label}-batch{j}-it{it}",
                worker=worker,
            )  # fmt: skip
            ahead.computed(worker, fut)
            pieces.append((lo, hi, fut))
            owners.append(worker)
        return pieces, owners

    def _partial_sums(
        self, h: HalfStepPlan, fixed: Factor, it: int, solved: list[list[Future]]
    ) -> Iterator[tuple[int, dict[str, Future]]]:
        """p > 1: (batch, each worker's sum of the partial Hermitians of its parts, by worker)
        as soon as a batch's are submitted (``tasks.hermitian_sums`` adds each part's to
        the previous part's, in place), so its reduction is submitted before the next batch.
        Batches are the outer loop, and a worker's sums of batch j wait for batch j - 2's
        slices to be solved (`solved[j - 2]`, which the caller appends as it submits them):
        every sum is ready at once, so without that a worker would hold all q batches' sums
        while the reductions wait for the other workers; with it, about two. With
        ``h.parts_outer`` the parts are the outer loop: each part of a fixed factor in host
        memory is then copied to the device once, not once per batch, and the sums of all
        batches are held until the last part."""
        ahead = self._ahead
        sums: list[dict[str, Future]] = [{} for _ in range(h.q)]
        uses: dict[str, list[Future]] = {}  # worker: the hermitian tasks on its current copy
        for i, j in self._order(h):
            worker = self.place.block(h, i, j)  # part i's worker (p > 1)
            if not h.parts_outer:
                fixed_part = self.fixed_on(h, fixed, i, worker, it)
            elif j == 0:  # part i's first batch: its copy, after the worker's previous part
                fixed_part = self.copied_in(h, fixed, i, worker, it, uses.pop(worker, None))
            first = worker not in sums[j]  # this worker's first part of batch j
            after = solved[j - 2] if first and j >= 2 and not h.parts_outer else None
            herm = self.submit(
                tasks.hermitian_sums, self.block_in_use(h, i, j, it, ahead), fixed_part,
                self.backend, self.spec, sums[j].get(worker), after,
                key=f"hermitian-{h.label}-batch{j}-part{i}-it{it}", worker=worker,
            )  # fmt: skip
            if h.parts_outer:
                uses.setdefault(worker, []).append(herm)
            if self._moved_per_use(h):  # a small stand-in: the sums are not held longer
                ahead.computed(worker, self.submit(
                    tasks.finished, herm, worker=worker, compute=False,
                    key=f"hermitian-done-{h.label}-batch{j}-part{i}-it{it}",
                ))  # fmt: skip
            else:  # still bounds the copies of the next half-step's first blocks
                ahead.computed(worker, herm)
            sums[j][worker] = herm
            if i == h.p - 1 and not h.parts_outer:
                yield j, sums[j]
        if h.parts_outer:
            yield from enumerate(sums)

    @staticmethod
    def _order(h: HalfStepPlan) -> Iterator[tuple[int, int]]:
        """(part, batch) in the order their partial Hermitians are submitted."""
        if h.parts_outer:
            return ((i, j) for i in range(h.p) for j in range(h.q))
        return ((i, j) for j in range(h.q) for i in range(h.p))

    def _data_parallel(
        self, h: HalfStepPlan, fixed: Factor, it: int, gram0: Any, previous: Factor | None
    ) -> tuple[list[Piece], list[str]]:
        pieces: list[Piece] = []
        owners = []
        reduction, workers = self.plan.reduction, self.place.workers
        solved: list[list[Future]] = []  # per batch: its slices' solves, done (see below)
        for j, sums in self._partial_sums(h, fixed, it, solved):
            lo, hi = h.row_bounds[j], h.row_bounds[j + 1]
            slices = slice_bounds(hi - lo, h.p, len(workers), reduction)
            sources = [self.place.index(worker) for worker in sums]
            done: list[Future] = []
            partials = [[self.submit(
                tasks.rows_of, herm, a, b, worker=worker, compute=False,
                key=f"slice-{h.label}-batch{j}-w{self.place.index(worker)}-slice{k}-it{it}",
            ) for worker, herm in sums.items()] for k, (a, b) in enumerate(slices)]  # fmt: skip
            for k, (a, b) in enumerate(slices):
                target = self.place.reduced_slice(k, reduction)
                tag = f"{h.label}-batch{j}-slice{k}-it{it}"
                inputs = final_inputs(
                    partials[k], sources, self.place.index(target), reduction,
                    self.plan.groups, workers, self.submit, tag,
                )  # fmt: skip
                x0 = self._warm(h, previous, lo + a, lo + b, target, tag)
                fut = self.submit(
                    tasks.reduce_solve, self.counts(h, lo + a, lo + b, target), self.spec,
                    self.backend, gram0, x0, self.plan.on_host(h.side), lo + a, *inputs,
                    key=f"reduce-solve-{tag}", worker=target,
                )  # fmt: skip
                pieces.append((lo + a, lo + b, fut))
                owners.append(target)
                if j + 2 < h.q:  # a small stand-in: batch j + 2's sums wait for it
                    done.append(self.submit(tasks.finished, fut, worker=target, compute=False,
                                            key=f"solved-{tag}"))  # fmt: skip
            solved.append(done)
        return pieces, owners

    # ------------------------------------------------------------------ evaluation
    def rmse(self, X: Factor, Theta: Factor, it: int, split: str = "train") -> float:
        """RMSE over the training (or held-out) ratings, computed where the X-side blocks live."""
        return self.rmses(X, Theta, it, (split,))[split]

    def rmses(self, X: Factor, Theta: Factor, it: int, splits: tuple[str, ...]) -> dict[str, float]:
        """RMSE of each split ("train", "test") in one round of tasks: the X rows and Theta
        parts are placed once for all splits, and one gather waits for every error."""
        h = self.plan.x
        futures: dict[str, list[Future]] = {split: [] for split in splits}
        ahead = self._read_ahead("eval")
        for j in range(h.q):
            lo, hi = h.row_bounds[j], h.row_bounds[j + 1]
            for i in range(h.p):
                worker = self.place.block(h, i, j)
                x_rows = self.gather(X, lo, hi, worker, f"gather-X-batch{j}-eval", SCORING)
                fixed = self.fixed_on(h, Theta, i, worker, it)
                for split in splits:
                    error = self.submit(
                        tasks.block_squared_error, self.block(h, i, j, it, split, ahead),
                        x_rows, fixed, self.backend, key=f"error-{split}-batch{j}-part{i}-it{it}",
                        worker=worker, priority=SCORING,
                    )  # fmt: skip
                    ahead.computed(worker, error)
                    futures[split].append(error)
        results = {split: self.watch.gather(parts) for split, parts in futures.items()}
        out = {}
        for split, parts in results.items():
            total, count = sum(r[0] for r in parts), sum(r[1] for r in parts)
            out[split] = float(np.sqrt(total / count)) if count else float("nan")
        return out

    def implicit_loss(self, X: Factor, Theta: Factor, it: int) -> dict[str, float]:
        """The implicit objective (:mod:`cumf_dask.backend.objective`) of (X, Theta), summed
        over all m x n pairs without forming them: trace(X^T X Theta^T Theta) counts every pair
        as c = 1, p = 0; the stored entries' tasks correct their own terms (where the X-side
        blocks live); each factor piece adds its regularization. ``loss`` divides by the total
        confidence of all pairs (implicit's ``calculate_loss``)."""
        h = self.plan.x
        blocks = []
        ahead = self._read_ahead("loss")
        for j in range(h.q):
            lo, hi = h.row_bounds[j], h.row_bounds[j + 1]
            for i in range(h.p):
                worker = self.place.block(h, i, j)
                x_rows = self.gather(X, lo, hi, worker, f"gather-X-batch{j}-loss", SCORING)
                loss = self.submit(
                    tasks.block_implicit_loss, self.block(h, i, j, it, ahead=ahead), x_rows,
                    self.fixed_on(h, Theta, i, worker, it), self.spec, self.backend,
                    key=f"loss-batch{j}-part{i}-it{it}", worker=worker, priority=SCORING,
                )  # fmt: skip
                ahead.computed(worker, loss)
                blocks.append(loss)
        terms = []
        for factor, half in ((X, self.plan.x), (Theta, self.plan.theta)):
            futures = []
            for k, ((lo, hi, fut), owner) in enumerate(
                zip(factor.pieces, factor.owners, strict=True)
            ):
                futures.append(
                    self.submit(
                        tasks.factor_terms, fut, self.counts(half, lo, hi, owner), self.spec,
                        self.backend, key=f"terms-{half.label}-piece{k}-it{it}", worker=owner,
                        priority=SCORING,
                    )
                )  # fmt: skip
            terms.append(futures)
        stored = self.watch.gather(blocks)
        (x_terms, theta_terms) = (self.watch.gather(t) for t in terms)
        gx = sum(g for g, _ in x_terms)
        gt = sum(g for g, _ in theta_terms)
        reg = sum(r for _, r in x_terms) + sum(r for _, r in theta_terms)
        objective = float((gx * gt).sum()) + sum(s for s, _ in stored) + self.spec.lam * reg
        store = self.store
        total_confidence = store.m * store.n - store.nnz + sum(c for _, c in stored)
        return {"loss": objective / total_confidence, "objective": objective}

    def finished_at(self, *factors: Factor) -> list[float]:
        """When each waited-for half-step ended: its last worker's check time (workers'
        clocks, ``time.time()``)."""
        times = iter(self.watch.gather([fut for f in factors for fut in f.checks]))
        return [max(next(times) for _ in f.checks) for f in factors]

    def drop(self, *factors: Factor) -> None:
        """Let go of submitted half-steps that will not be used (their pieces, checks, and
        the copies of them gathered for the next half-step): the scheduler forgets what no
        one needs, and what has not run does not run. (Not ``Client.cancel``: cancelling
        tasks that depend on each other in one call can fail on the scheduler.) The reads
        ahead start afresh: they waited for these half-steps' computations."""
        for factor in factors:
            for fut in [p[2] for p in factor.pieces] + factor.checks + [*factor.placed.values()]:
                fut.release()
        self._ahead = self._read_ahead("update")

    def release(self) -> None:
        """Let go of the resident blocks and counts held on the workers, and of the memory
        the workers' backend keeps for reuse (GPU: the last blocks, cached device and
        page-locked memory)."""
        self._resident.clear()
        self._ahead = self._read_ahead("update")
        if self.plan.backend == "cupy":
            present = workers_info(self.client)  # a lost worker's address would hold
            live = [w for w in self.place.workers if w in present]  # client.run 30 s
            if live:
                self.client.run(tasks.release_memory, self.backend, workers=live)
