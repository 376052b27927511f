"""The ALS loop on a cluster: plan, start (fresh or from a checkpoint), iterate, checkpoint.

Each iteration runs update X (Theta fixed) then update Theta (X fixed) as SU-ALS half-steps
(:mod:`.halfstep`), times both (one small task per worker checks that the pieces it solved
are finite: one device sync per half-step, no data moved), scores train (and held-out) RMSE where
the blocks live (the implicit model: its objective, see ``SUALSEngine.implicit_loss``),
starts its atomic checkpoint (written on a thread while the next iterations run:
:class:`~cumf_dask.checkpoint.BackgroundSaves`), and calls the callbacks with the
iteration's record; the next iteration is already queued behind it by then (see
``_Run._iterate``). With the
CG solver each half-step starts from the solved factor's previous iterate (X's first one is
drawn from the seed like Theta's, stream 2), and a resumed fit restores both factors.

What can go wrong, and what happens:

* non-finite factors: :class:`~cumf_dask.errors.NumericalError` naming the iteration, the
  factor and a likely cause, before that iteration is scored or checkpointed (the last good
  checkpoint stays);
* a worker lost (killed, or its machine gone): the fit waits up to REPLACE_S for the nanny's
  replacement, re-places the blocks and factor pieces on the workers present, and goes on
  from its last checkpoint (or from the start without checkpoints): the result is the one of
  an uninterrupted fit. After MAX_RECOVERIES losses it stops with
  :class:`~cumf_dask.errors.WorkerLostError`;
* a worker out of memory (restarted by its nanny past its memory limit, paused for memory,
  or a GPU allocation failing): :class:`~cumf_dask.errors.DeviceMemoryError` with a plan that
  fits the memory there is.
"""

from __future__ import annotations

import itertools
import math
import os
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, replace
from typing import Any

import dask
import numpy as np
from distributed import Client
from distributed.client import FutureCancelledError

from ..backend import backend_spec
from ..backend.objective import UpdateSpec
from ..callbacks import IterationCallback, Progress
from ..checkpoint import BackgroundSaves, Checkpointer
from ..config import PlanConfig, plain
from ..data.store import RatingsStore
from ..errors import (
    ConfigError,
    CumfError,
    DeviceMemoryError,
    HostMemoryError,
    NumericalError,
    PlanError,
    StoreError,
    WorkerLostError,
    is_out_of_memory,
    warn,
)
from ..paths import is_url
from . import tasks
from .cluster import (
    blas_pinned,
    has_compute_slots,
    host_memory,
    measure_link,
    plan_memory,
    process_memory,
    read_threads,
    retired,
    wait_for_workers,
    worker_addresses,
    worker_memory,
)
from .halfstep import SUALSEngine
from .placement import Factor
from .plan import BLOCK_TIERS, Plan, make_plan
from .session import Session
from .watch import Watch, WorkerLost, WorkersPaused

MAX_RECOVERIES = 3  # worker losses a fit goes on after
REPLACE_S = 30.0  # how long a fit waits for lost workers to be replaced


@dataclass(frozen=True)
class ALSParams:
    """The model's hyper-parameters, as the engine and its checkpoints need them.

    ``kind``: "explicit" (ratings) or "implicit" (counts, Hu et al.; alpha, confidence and
    eps define c = 1 + alpha r or 1 + alpha log(1 + r / eps)). ``regularization_mode``:
    "weighted" (lambda n_u) or "plain" (lambda). See :mod:`cumf_dask.backend.objective`.
    """

    factors: int
    regularization: float
    iterations: int
    seed: int = 0
    precision: str = "float32"
    kind: str = "explicit"
    alpha: float = 1.0
    confidence: str = "linear"
    eps: float = 1.0
    regularization_mode: str = "weighted"
    solver: str = "cholesky"
    cg_steps: int = 3
    init_scale: float | None = None  # initial factors uniform in [0, this); None: 1/sqrt(f)

    def spec(self) -> UpdateSpec:
        """What each row update solves, and how."""
        return UpdateSpec(
            self.regularization, weighted=self.regularization_mode == "weighted",
            implicit=self.kind == "implicit", alpha=self.alpha, confidence=self.confidence,  # type: ignore[arg-type]
            eps=self.eps, solver=self.solver, cg_steps=self.cg_steps,  # type: ignore[arg-type]
        )  # fmt: skip

    def attrs(self, store: RatingsStore) -> dict[str, Any]:
        """What a checkpoint records of the fit: the settings, the shape, the ratings' counts
        and statistics, a digest of the ids and which store build it is (which a resumed fit
        must all match). Reads the store's ids: made once per fit."""
        return {**self.settings(), "m": store.m, "n": store.n, "ratings": ratings_digest(store),
                "ids": ids_digest(store), "data": store_build(store)}  # fmt: skip

    def settings(self) -> dict[str, Any]:
        """The hyper-parameters a checkpoint or saved model records (NumPy scalars given as
        parameters recorded as the Python numbers they are)."""
        settings = {
            "factors": self.factors,
            "regularization": self.regularization,
            "seed": self.seed,
            "iterations": self.iterations,
            "kind": self.kind,
            "alpha": self.alpha,
            "confidence": self.confidence,
            "eps": self.eps,
            "regularization_mode": self.regularization_mode,
            "solver": self.solver,
            "cg_steps": self.cg_steps,
            "init_scale": self.init_scale,
            "precision": self.precision,
        }
        return plain(settings)


# what a resumed fit must share with its checkpoint, beside the shape: the objective's
# terms (the solver, its steps, the seed, the precision and the iteration count may change)
RESUME_MUST_MATCH = ("factors", "kind", "regularization", "regularization_mode", "alpha",
                     "confidence", "eps")  # fmt: skip


def ratings_digest(store: RatingsStore) -> dict[str, Any]:
    """The ratings' counts and statistics as a checkpoint records them: other ratings of the
    same shape (another file, another split, the values changed) almost surely differ."""
    return {"nnz": store.nnz, "nnz_test": store.nnz_test, **store.stats}


def ids_digest(store: RatingsStore) -> dict[str, int | None]:
    """A CRC-32 of the store's user and of its item ids (None: dense indices). The same
    ratings ingested in another order number their ids otherwise: the counts and statistics
    agree, these do not."""
    out: dict[str, int | None] = {}
    for axis in ("rows", "cols"):
        ids = store.ids(axis)  # type: ignore[arg-type]
        if ids is None:
            out[axis] = None
        elif ids.dtype.kind in "iuf":
            out[axis] = zlib.crc32(np.ascontiguousarray(ids))
        else:
            out[axis] = zlib.crc32("\0".join(map(str, ids)).encode())
    return out


def store_build(store: RatingsStore) -> dict[str, str | None]:
    """Where the store is and which build of it (the id each build records): a store rebuilt
    in place since a checkpoint may hold other ratings of the same counts and statistics."""
    url = store.url if is_url(store.url) else os.path.abspath(store.url)
    return {"url": url, "build": store.attrs.get("build")}


def resume_mismatch(attrs: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """'name: checkpoint value, this fit's value' for each way a checkpoint's fit differs
    from this one, whose attrs are `here` (:meth:`ALSParams.attrs`); a checkpoint from
    before the ratings or ids were recorded is not compared on them."""
    keys = ("m", "n", *RESUME_MUST_MATCH)
    got = {k: attrs.get(k, "explicit" if k == "kind" else None) for k in keys}
    differ = [f"{k}: {got[k]!r} there, {here[k]!r} here" for k in keys if got[k] != here[k]]
    if "ratings" in attrs and not same_ratings(attrs["ratings"], here["ratings"]):
        differ.append(f"ratings: {attrs['ratings']} there, {here['ratings']} here")
    for axis, noun in (("rows", "user"), ("cols", "item")):
        if "ids" in attrs and attrs["ids"].get(axis) != here["ids"][axis]:
            differ.append(f"{noun} ids: numbered otherwise (the same ratings in another "
                          "order, or other ids)")  # fmt: skip
    then, now = attrs.get("data", {}), here["data"]
    if then.get("url") == now["url"] and then.get("build") != now["build"]:
        differ.append(f"store: {now['url']} was rebuilt since the checkpoint (build "
                      f"{then.get('build')} there, {now['build']} here); to resume, give the "
                      "store the checkpoint was made on")  # fmt: skip
    return differ


def same_ratings(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal counts, statistics equal to rounding (a store built again with other bands sums
    them in another order)."""
    return a.keys() == b.keys() and all(
        a[k] == b[k] or math.isclose(a[k], b[k], rel_tol=1e-9) for k in a
    )


@dataclass
class FitResult:
    plan: Plan
    metrics: list[dict[str, Any]]
    iterations_done: int
    session: Session
    factors: tuple[np.ndarray, np.ndarray]  # (X, Theta) on the host


@dataclass
class _State:
    """Where a fit stands: iterations done, their metrics, the factors on the workers."""

    done: int
    metrics: list[dict[str, Any]]
    theta: Factor
    X: Factor | None = None


def fit(
    client: Client,
    store: RatingsStore,
    params: ALSParams,
    backend: str,
    *,
    plan_config: PlanConfig | None = None,
    evaluate: bool = True,
    checkpoint_dir: str | None = None,
    resume: bool = False,
    callbacks: Sequence[IterationCallback] = (),
    progress: Progress | None = None,
) -> FitResult:
    """Fit on `client`'s workers with `backend` ("numpy" or "cupy", already resolved).

    With `checkpoint_dir`, the folder is locked for the fit's duration (a second fit
    writing it fails at once with a StoreError). The workers' BLAS runs one thread for the
    fit's duration only (:func:`~.cluster.blas_pinned`).
    """
    checkpointer = Checkpointer(checkpoint_dir) if checkpoint_dir else None
    if resume and checkpointer is None:
        raise ConfigError("fit(resume=True) needs checkpoint_dir (output.checkpoint)")
    locked = checkpointer.locked() if checkpointer is not None else nullcontext()
    with locked, _cluster_kept(client, checkpointer is not None), blas_pinned(client):
        here = params.attrs(store)
        found = _resumed(checkpointer, resume, here, params.iterations)
        workers = worker_addresses(client)
        baseline = process_memory(client)
        memory = worker_memory(client, backend)
        workers, link = _link(client, workers, backend, memory)
        room = plan_memory(client, backend)
        if room < 1e6:
            raise DeviceMemoryError(
                f"the workers have (almost) no memory left for data: Dask pauses a worker at "
                f"{_dask_fraction('pause', 0.8):.0%} of its memory limit ({memory / 1e6:.0f} "
                f"MB), and its process takes {baseline / 1e6:.0f} MB; give them more memory "
                "(cluster.memory_limit) or use fewer, larger workers"
            )
        rows, cols = store.counts("row"), store.counts("col")
        _warn_unrated(rows, cols, params.kind == "implicit")

        def plan_for(count: int, config: PlanConfig | None, memory: int) -> Plan:
            return make_plan(
                store.m, store.n, store.nnz, params.factors, count, memory, rows, cols,
                config, backend, link=link, host_memory=host_memory(client, backend),
                held_out=store.nnz_test if evaluate and store.has_test else 0,
                tensor_cores=params.precision == "float32" and params.kind == "explicit",
                checkpoint=checkpointer is not None,
            )  # fmt: skip

        def replan(now: list[str]) -> Plan:
            """The plan for the workers left after a loss: their number may differ, and
            worker groups named for the old ones would drop or misplace partial sums."""
            config = plan_config
            if config is not None and config.groups is not None and len(now) != len(workers):
                warn(f"plan.groups {config.groups} named {len(workers)} workers and "
                     f"{len(now)} are left: the two-phase reduction goes on with one flat group")
                config = replace(config, groups=None)
            return plan_for(len(now), config, plan_memory(client, backend))

        plan = plan_for(len(workers), plan_config, room)
        engine = SUALSEngine(
            client, store, plan, params.spec(), backend_spec(backend, params.precision),
            workers, has_compute_slots(client), read_threads(client, workers),
        )  # fmt: skip
        engine.prepare(params.factors)  # kernels compile while the blocks load
        engine.preload(held_out=evaluate and store.has_test)
        run = _Run(engine, store, params, here, checkpointer, evaluate, callbacks, progress,
                   replan)  # fmt: skip
        try:
            return run.until_done(found)
        except (WorkersPaused, WorkerLost) as exc:  # WorkerLost escapes only for memory
            raise _out_of_memory(exc, engine, memory, baseline, plan_config) from None
        except Exception as exc:  # an allocation failed in a task (a GPU's, or the CPU's)
            if not is_out_of_memory(exc):
                raise
            oom = (
                exc
                if isinstance(exc, DeviceMemoryError)
                else DeviceMemoryError(f"a worker ran out of memory ({type(exc).__name__}: {exc})")
            )
            raise _out_of_memory(oom, engine, memory, baseline, plan_config) from None


@contextmanager
def _cluster_kept(client: Client, resumable: bool) -> Iterator[None]:
    """A fit whose client was closed, whose scheduler went away, or whose tasks were
    cancelled (``client.restart()``) ends in one WorkerLostError saying so (Dask's own
    errors then are of every kind: a closed comm, a connect timeout, an attribute of a
    closed client, a cancelled future). It says how to go on: with checkpoints, resume."""
    again = ("then fit again with resume=True (CLI: --resume) to continue from the last "
             "checkpoint" if resumable else "then fit again (with checkpoint_dir, or "
             "output.checkpoint in a config, a fit can resume after this)")  # fmt: skip
    try:
        yield
    except CumfError:
        raise
    except FutureCancelledError as exc:
        raise WorkerLostError(f"the fit's tasks were cancelled ({exc.reason}: a "
                              f"client.restart() or a scheduler that let them go); {again}"
                              ) from None  # fmt: skip
    except Exception as exc:
        if client.status == "running":
            raise
        if client.status == "closed":
            raise WorkerLostError(f"the fit's Dask client was closed during the fit; {again}"
                                  ) from None  # fmt: skip
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise WorkerLostError(
            f"the fit's Dask client lost its scheduler (client {client.status}: {detail}); "
            f"check that the scheduler runs and the client stays open, {again}"
        ) from None


def _warn_unrated(rows: np.ndarray, cols: np.ndarray, implicit: bool) -> None:
    """A CumfWarning when users or items have no training rating: ALS leaves their factors
    at zero, so they predict 0, and held-out ratings of theirs are scored as such (the
    implicit model: every item scores 0 for such a user, such an item for every user)."""
    empty = [f"{k:,} of {c.size:,} {noun}" for c, noun in ((rows, "users"), (cols, "items"))
             if (k := int(np.count_nonzero(c == 0)))]  # fmt: skip
    if empty:
        scored = ("they score 0 in every ranking" if implicit else
                  "they predict 0 (held-out ratings of theirs count so in the test RMSE)")
        warn(f"{' and '.join(empty)} have no training rating: their factors stay zero, so "
             f"{scored}")


def _resumed(
    checkpointer: Checkpointer | None, resume: bool, here: dict[str, Any], iterations: int
) -> tuple[int, dict, dict] | None:
    """The checkpoint a fit resumes from (iteration, attrs, arrays), checked against this
    fit (`here`: its attrs) before any data is loaded; None: a fresh start. A fresh start
    over another fit's checkpoints says that it replaces them."""
    if checkpointer is None:
        return None
    if not resume:
        earlier = checkpointer.names()
        if earlier:
            warn(f"{checkpointer.directory} holds checkpoints of an earlier fit "
                 f"({', '.join(earlier)}); this fit starts over and replaces them "
                 "(resume=True, or --resume, continues from them)")  # fmt: skip
        return None
    found = checkpointer.latest()
    if found is None:
        return None
    start, attrs, _ = found
    differ = resume_mismatch(attrs, here)
    if differ:
        raise StoreError(
            f"{checkpointer.directory}: its checkpoint is of another fit ({'; '.join(differ)}); "
            "run without --resume (resume=False) to start over, or give this fit other "
            "checkpoints (output.dir, checkpoint_dir)"
        )
    if start > iterations:
        raise ConfigError(
            f"{checkpointer.directory}: its checkpoint is at iteration {start}, past the "
            f"{iterations} asked for; ask for {start} or more (model.iterations), or run "
            "without --resume (resume=False) to start over"
        )
    _note_precision(attrs, here, start)
    return found


def _note_precision(attrs: dict[str, Any], here: dict[str, Any], start: int) -> None:
    """A CumfWarning when a fit resumes with another precision than its checkpoint's: a
    speed setting, so allowed (as another solver is), but the result then differs slightly
    from an uninterrupted fit of either precision."""
    then = attrs.get("precision")
    if then is not None and then != here["precision"]:
        warn(f"resuming a {then} fit in {here['precision']} (model.precision): "
             f"iterations after {start} store the fixed factor in "
             f"{here['precision']}, so the result differs slightly from an "
             "uninterrupted fit")  # fmt: skip


def _link(client: Client, workers: list[str], backend: str, memory: int):
    """(workers, measured link): a worker lost while measuring is waited for (its nanny
    replaces it), and the link left unmeasured; one lost for memory ends the fit."""
    watch = Watch(client, workers)
    try:
        size = (512 if backend == "cupy" else 64) << 20  # NVLink moves 64 MiB in ~1 ms
        return workers, measure_link(client, workers, backend, min(size, memory // 16),
                                     watch=watch)  # fmt: skip
    except WorkersPaused as exc:
        raise DeviceMemoryError(
            f"worker {exc.worker} ran out of memory before any data was loaded ({exc.detail}); "
            "give the workers more memory (cluster.memory_limit)"
        ) from None
    except WorkerLost as lost:
        if lost.memory:
            raise DeviceMemoryError(
                f"worker {', '.join(lost.lost)} was killed for memory before any data was "
                f"loaded ({lost.memory}); give the workers more memory (cluster.memory_limit)"
            ) from None
        return wait_for_workers(client, len(workers), REPLACE_S), None


class _Run:
    """One fit's loop, with its recovery from lost workers."""

    def __init__(self, engine: SUALSEngine, store: RatingsStore, params: ALSParams,
                 here: dict[str, Any], checkpointer: Checkpointer | None, evaluate: bool,
                 callbacks: Sequence[IterationCallback], progress: Progress | None,
                 replan: Callable[[list[str]], Plan]):  # fmt: skip
        self.engine, self.store, self.params, self.here = engine, store, params, here
        self.checkpointer, self.evaluate = checkpointer, evaluate
        self.callbacks, self.progress = callbacks, progress
        self.replan = replan  # the plan for the workers left after a loss
        self.began = time.perf_counter()
        self.saves: BackgroundSaves | None = None

    def until_done(self, found: tuple[int, dict, dict] | None) -> FitResult:
        """The fit's result, from the checkpoint `found` (else from the start); the blocks
        it kept on the workers, and the factors of a failed fit, are let go however it ends
        (a failed fit's traceback, which a notebook keeps, holds its frames, and Dask's
        record of a failed task refers back to them: a cycle only a full GC pass frees)."""
        engine = self.engine
        if self.checkpointer is not None:  # the engine's watch is replaced by a recovery
            self.saves = BackgroundSaves(self.checkpointer, lambda c: engine.watch.compute(c),
                                         found[0] if found else None)  # fmt: skip
        state: _State | None = None
        try:
            state = self._start(found)
            losses = 0
            while True:
                try:
                    self._iterate(state)
                    if self.saves is not None:
                        self.saves.wait()
                    X = state.X if state.done else self._first_x(state)  # 0 iterations
                    session = Session(engine, X, state.theta)
                    factors = self._saved_factors(state.done) or session.gather()
                    break
                except WorkerLost as lost:
                    if lost.memory:
                        raise
                    losses += 1
                    state = self._recover(lost, state, losses)
        except BaseException:
            if state is not None:
                with suppress(Exception):  # the fit's own error is the one to see
                    engine.drop(state.theta, *([state.X] if state.X is not None else []))
            with suppress(Exception):
                engine.release()
            raise
        finally:
            if self.saves is not None:
                self.saves.close()
        engine.release()
        done = state.done
        return FitResult(engine.plan, state.metrics, done, session, (factors[0], factors[1]))

    def _saved_factors(self, done: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The final factors read back from the checkpoint of iteration `done`, if that is
        the last one written: from the page cache, straight from the chunk files on 16
        threads (6.3 GB in 0.5 s), faster than a local cluster's workers send them (2-2.5
        GB/s) and than a joined cluster's scheduler passes them on (0.9 GB/s; H100 machine,
        RESULTS.md). None without it, or if it cannot be read (the factors are gathered
        instead)."""
        checkpointer = self.checkpointer
        if checkpointer is None or self.saves is None or not done or self.saves.complete != done:
            return None
        try:
            _, arrays = checkpointer.load(done)
        except StoreError as exc:  # a later --resume refuses it too: say so now
            warn(f"the checkpoint just written does not read back ({exc}); the "
                 "factors are gathered from the workers instead")  # fmt: skip
            return None
        return arrays["user_factors"], arrays["item_factors"]

    def _first_x(self, state: _State) -> Factor:
        """X from the initial Theta, as an iteration's update X makes it (a user without
        ratings gets a zero factor): the result of a fit of 0 iterations. The CG solver
        starts from its seeded X, which this replaces. Held in `state` while it is solved,
        so that a failure lets it go."""
        state.X = X = self.engine.submit_half_step("x", state.theta, 1, previous=state.X)
        return self.engine.wait(X, "x")

    # ------------------------------------------------------------------ starting points
    def _start(self, found: tuple[int, dict, dict] | None) -> _State:
        """From a checkpoint (iteration, attrs, arrays), else from the seeded initial Theta
        (and, for the CG solver, a seeded initial X to start its first solve from)."""
        engine, params = self.engine, self.params
        cg = params.solver == "cg"
        if found is None:
            scale = params.init_scale
            theta = engine.initial("theta", params.factors, params.seed, scale)
            X = engine.initial("x", params.factors, params.seed, scale) if cg else None
            return _State(0, [], theta, X)
        start, attrs, arrays = found
        theta = engine.from_host(arrays["item_factors"], "theta")
        keep_x = cg or start >= params.iterations  # CG's starting point, or the final X
        X = engine.from_host(arrays["user_factors"], "x") if keep_x else None
        return _State(start, list(attrs.get("metrics", [])), theta, X)

    def _recover(self, lost: WorkerLost, state: _State, losses: int) -> _State:
        """Plan again for the workers present and place everything on them; go back to this
        fit's last checkpoint."""
        engine = self.engine
        where = f" ({lost.what})" if lost.what else ""
        gone = ", ".join(lost.lost) or "a worker"
        restore = self._last_checkpoint()
        back = f"checkpoint {restore}" if restore is not None else "the first iteration"
        if losses > MAX_RECOVERIES:
            raise WorkerLostError(
                f"workers were lost {losses} times during this fit (last: {gone}{where}); "
                "check the workers' logs (killed? out of memory?), then run again with "
                "--resume (resume=True) to continue from the last checkpoint"
            )
        wanted = len(engine.place.workers)
        if retired(engine.client, lost.lost):  # scaled down on purpose: none will replace it
            wanted -= len(lost.lost)
        workers = wait_for_workers(engine.client, wanted, REPLACE_S)
        if not workers:
            raise WorkerLostError(
                f"worker {gone} was lost{where} and no worker is left after {REPLACE_S:.0f} s; "
                "start workers, then run again with --resume (resume=True)"
            )
        warn(f"worker {gone} was lost during iteration {state.done + 1}{where}; going on "
             f"on {len(workers)} worker(s) from {back}")
        client = engine.client
        plan = self.replan(workers)
        engine.recover(workers, plan, has_compute_slots(client), read_threads(client, workers))
        engine.prepare(self.params.factors)
        if restore is None or self.checkpointer is None:
            return self._start(None)
        attrs, arrays = self.checkpointer.load(restore)
        return self._start((restore, attrs, arrays))

    def _last_checkpoint(self) -> int | None:
        """The iteration of this fit's newest complete checkpoint (None: there is none),
        once the save under way has ended: its error is raised, but for a worker lost
        meanwhile (that save stays incomplete, the one before it is kept)."""
        if self.saves is None:
            return None
        try:
            return self.saves.wait()
        except WorkerLost:
            return self.saves.complete

    # ------------------------------------------------------------------ the loop
    def _iterate(self, state: _State) -> None:
        """Run the iterations left, updating `state` after each one (for a recovery).

        Iteration it + 1 is submitted before iteration it is waited for, so the workers go
        on to it without a round trip through this process (~13 ms per iteration of a
        Netflix-sized fit on one GPU) and while it is scored; its tasks are dropped if
        iteration it fails. Not for streamed blocks while scoring: the scoring's reads
        would add to the two blocks a worker holds. The half-steps are timed on the workers
        (when their pieces were checked), so scoring is not counted in them.
        """
        last = self.params.iterations
        lookahead = self.engine.plan.resident or not self.evaluate
        current: tuple[Factor, Factor] | None = None
        pending: tuple[Factor, Factor] | None = None
        try:
            for it in range(state.done + 1, last + 1):
                if pending is None:  # wall clock: compared with the workers' check times
                    begun, pending = time.time(), self._submit(it, state.theta, state.X)
                current = X, theta = pending
                pending = self._submit(it + 1, theta, X) if lookahead and it < last else None
                self._wait(X, "x", it)
                # The X before is not needed once this one is solved (a recovery starts from
                # a checkpoint): let it go now, not after update Theta, when the next X may
                # already be made (a factor in host memory then reuses its page-locked memory
                # instead of locking more: seen as a 1.5 s batch now and then).
                state.X = X
                self._wait(theta, "theta", it)
                x_end, theta_end = self.engine.finished_at(X, theta)
                seconds = (max(x_end - begun, 0.0), max(theta_end - x_end, 0.0))
                self._finish(state, it, X, theta, seconds)
                current, begun = None, theta_end
        except BaseException:
            with suppress(Exception):  # the error that got here is the one to report
                self.engine.drop(*(current or ()), *(pending or ()))
            raise

    def _finish(
        self, state: _State, it: int, X: Factor, theta: Factor, seconds: tuple[float, float]
    ) -> None:
        """Score, checkpoint and report iteration `it`, whose half-steps took `seconds`
        (from the previous half-step's end to their own, on the workers)."""
        engine, store = self.engine, self.store
        state.theta.placed.clear()  # the copies gathered on the workers are not needed
        X.placed.clear()
        # the previous iterates are not needed either (the next iteration is submitted, and
        # a recovery starts from a checkpoint): not held while this one is scored
        state.theta, state.X = theta, X
        record: dict[str, Any] = {
            "iteration": it,
            "seconds": sum(seconds),
            "x_seconds": seconds[0],
            "theta_seconds": seconds[1],
        }
        if self.evaluate and engine.spec.implicit:
            record.update(engine.implicit_loss(X, theta, it))
        elif self.evaluate:
            splits = ("train", "test") if store.has_test else ("train",)
            errors = engine.rmses(X, theta, it, splits)  # one round of tasks for both
            record.update({f"{split}_rmse": errors[split] for split in splits})
        record["elapsed"] = time.perf_counter() - self.began
        record = plain(record)  # JSON for the checkpoint and the run's metrics
        metrics = [*state.metrics, record]
        saves = self.saves  # written while the next iterations run (the last: always)
        steady = [r["seconds"] for r in metrics[1:]] or [record["seconds"]]  # not loading R
        remaining = (self.params.iterations - it) * sum(steady) / len(steady)
        if saves is not None and (it == self.params.iterations or saves.worth_starting(remaining)):
            Xw, Tw = Session(engine, X, theta).factor_writes()
            saves.start(it, {"user_factors": Xw, "item_factors": Tw},
                             {**self.here, "metrics": metrics})  # fmt: skip
        state.done, state.metrics = it, metrics
        for callback in self.callbacks:
            callback(record)

    def _submit(self, it: int, theta: Factor, X: Factor | None) -> tuple[Factor, Factor]:
        """Iteration `it`'s two half-steps, submitted behind each other (update Theta starts
        as X's pieces appear); `theta`, `X`: the previous iterates."""
        X_new = self.engine.submit_half_step("x", theta, it, previous=X)
        return X_new, self.engine.submit_half_step("theta", X_new, it, previous=theta)

    def _wait(self, factor: Factor, side: str, it: int) -> Factor:
        """Wait for a half-step; NumericalError if the task that solved a piece found NaN or
        inf in it (checked there, before anything is scored or checkpointed)."""
        try:
            return self.engine.wait(factor, side, self.progress)
        except tasks.NonFiniteFactor as exc:
            name, rows = ("X", "users") if side == "x" else ("Theta", "items")
            stats = self.store.stats
            top = max(abs(stats.get("min", 0.0)), abs(stats.get("max", 0.0)))
            cause = (
                f"the ratings reach {top:.3g}, far beyond a usual scale: rescale them (and "
                "check the input for a wrong value)"
                if top > 1e6
                else "try a larger regularization (model.regularization), or check the "
                "input for extreme ratings"
            )
            restore = self.saves.settle() if self.saves is not None else None
            kept = (
                f"; the last good checkpoint (iteration {restore}) is kept"
                if restore is not None
                else ""
            )
            raise NumericalError(
                f"iteration {it}: factor {name} became non-finite in update {name} (NaN or inf: "
                f"{exc.count:,} values in one batch, the first in row {exc.row} of the {rows}); "
                f"{cause}{kept}"
            ) from None


def _out_of_memory(
    exc: Exception, engine: SUALSEngine, memory: int, baseline: int, plan_config: Any
) -> Exception:
    """A DeviceMemoryError for a worker out of memory, with a plan that fits what there is.

    The failed plan's estimate was too low by at least (memory used at the failure) /
    (estimate); the suggested plan gets the room there is for data (up to Dask's pause
    threshold, less the process's own memory), divided by that factor and by 2 for margin.
    """
    fraction = _dask_fraction("pause", 0.8)
    if isinstance(exc, HostMemoryError):  # not the device's: R and the factors off the host
        plan = engine.plan
        if plan.blocks != "host" and plan.host_factor is None:
            return HostMemoryError(
                f"{exc}; this plan keeps R and the factors off host memory already: what "
                "could not be locked is the decoding threads' staging buffers (raise the "
                "locked-memory limit)"
            )
        off_host = suggest_plan(engine, memory, plan.budget, plan_config, off_host=True)
        return HostMemoryError(f"{exc}; {off_host}")
    if isinstance(exc, DeviceMemoryError):  # a GPU (or CPU) allocation failed in a task
        what, room = str(exc), _device_capacity(engine) or memory
        used = room
    elif isinstance(exc, WorkersPaused):
        what = f"worker {exc.worker} ran out of memory ({exc.detail})"
        room = int(fraction * memory) - baseline
        used = room
    else:  # WorkerLost, with the evidence that memory killed it
        what = f"worker {', '.join(exc.lost)} was killed for memory: {exc.memory}"  # type: ignore[attr-defined]
        room = int(fraction * memory) - baseline
        used = int(_dask_fraction("terminate", 0.95) * memory) - baseline
    plan = engine.plan
    estimate = max(plan.x.peak, plan.theta.peak) + plan.factor_bytes()
    if plan.blocks_in_worker_memory:
        estimate += plan.block_bytes()
    factor = max(used / max(estimate, 1), 1.0)
    budget = int(room / factor / 2) if room > 0 else 0
    return DeviceMemoryError(f"{what}; {suggest_plan(engine, memory, budget, plan_config)}")


def _device_capacity(engine: SUALSEngine) -> int | None:
    """The smallest device capacity of the workers (a GPU pool's limit, else its memory)."""
    try:
        found = engine.client.run(tasks.memory_capacity, engine.backend.partition("+")[0])
        sizes = [int(v) for v in found.values() if v]
    except Exception:
        return None
    return min(sizes) if sizes else None


def _dask_fraction(name: str, default: float) -> float:
    """distributed.worker.memory.<name> (pause, terminate) as a fraction of the limit."""
    value = dask.config.get(f"distributed.worker.memory.{name}", default)
    return float(value) if value else default


def suggest_plan(
    engine: SUALSEngine, memory: int, budget: int, plan_config: PlanConfig | None,
    off_host: bool = False,
) -> str:
    """'a plan that fits B per worker: ...; run again with --set plan.memory_budget=B', and
    whatever else the user forced that the plan that fits needs changed. `off_host` (host
    memory could not be locked): the plan with R and both factors off host memory, in the
    same budget."""
    store, plan = engine.store, engine.plan
    tiers = {"blocks": "store", "factors": "device"} if off_host else {}
    config = replace(plan_config or PlanConfig(), **tiers)
    mb = f"{max(budget, 0) / 1e6:.1f}MB"
    if budget < 1e6:
        return (
            f"the workers have (almost) no memory left for data after what their processes "
            f"take (memory limit {memory / 1e6:.0f} MB): give them more memory "
            "(cluster.memory_limit) or use fewer, larger workers"
        )

    def plan_with(kept: PlanConfig) -> Plan:
        return make_plan(
            store.m, store.n, store.nnz, plan.x.f, plan.workers, budget, store.counts("row"),
            store.counts("col"), replace(kept, memory_budget=str(budget)), plan.backend,
            host_memory=host_memory(engine.client, plan.backend), held_out=plan.held_out,
            tensor_cores=plan.tensor_cores, checkpoint=plan.checkpoint,
        )  # fmt: skip

    free = PlanConfig(reduction=config.reduction, groups=config.groups, headroom=config.headroom,
                      **tiers)  # fmt: skip
    forced = _forced_dims(config)
    fits = None
    for kept in (config, free) if forced else (free,):  # the user's p and q kept if they fit
        try:
            fits = plan_with(kept)
            break
        except PlanError:
            continue
    if fits is None and off_host:
        return (
            f"no plan keeps R and the factors off host memory in {mb} per worker: raise the "
            "limit on locked memory, or use more workers"
        )
    if fits is None:
        return (
            f"no plan fits {mb} per worker: give the workers more memory "
            "(cluster.memory_limit), use more workers, or fewer factors"
        )
    changed: dict[str, Any] = dict(tiers) or {"memory_budget": mb}
    if kept is free:  # a half-step's own p or q overrides plan.p and plan.q
        for side, dim in itertools.product(("x", "theta"), forced):
            changed[f"{side}.{dim}"] = getattr(fits.half(side), dim)
    # a forced tier the plan that fits does not use must be changed too
    if config.blocks not in ("auto", fits.blocks):
        changed["blocks"] = fits.blocks
    factors = "host" if fits.host_factor else "device"
    if config.factors not in ("auto", factors):
        changed["factors"] = factors
    where = "" if fits.blocks == "device" else ", R " + BLOCK_TIERS[fits.blocks]
    if fits.host_factor:
        where += f", {fits.half(fits.host_factor).label} in pinned host memory"
    return (
        f"a plan that fits {mb} per worker is update X p={fits.x.p} q={fits.x.q}, update "
        f"Theta p={fits.theta.p} q={fits.theta.q}{where}: run again with "
        + " ".join(f"--set plan.{k}={v}" for k, v in changed.items())
        + f" (Python: plan=PlanConfig({_python_args(changed)}))"
    )


def _forced_dims(config: PlanConfig) -> list[str]:
    """The dimensions ("p", "q") the user forced, for both half-steps or for one."""
    levels = (config, config.x, config.theta)
    return [dim for dim in ("p", "q") if any(getattr(c, dim) is not None for c in levels)]


def _python_args(changed: dict[str, Any]) -> str:
    """PlanConfig's arguments for `changed` (half-step keys as x=HalfStepConfig(...))."""
    args = [f"{k}={v!r}" for k, v in changed.items() if "." not in k]
    for side in ("x", "theta"):
        dims = {k.split(".")[1]: v for k, v in changed.items() if k.startswith(f"{side}.")}
        if dims:
            inner = ", ".join(f"{dim}={v}" for dim, v in dims.items())
            args.append(f"{side}=HalfStepConfig({inner})")
    return ", ".join(args)
