"""The ALS loop on a cluster: plan, start (fresh or from a checkpoint), iterate, checkpoint.

Each iteration runs update X (Theta fixed) then update Theta (X fixed) as SU-ALS half-steps
(:mod:`.halfstep`), times both, scores train (and held-out) RMSE where the blocks live,
writes an atomic checkpoint, and calls the callbacks with the iteration's record.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from distributed import Client

from ..backend import backend_spec
from ..callbacks import IterationCallback, Progress
from ..checkpoint import Checkpointer
from ..config import PlanConfig
from ..data.store import RatingsStore
from ..errors import ConfigError, StoreError
from .cluster import (
    CumfWorkerSetup,
    has_compute_slots,
    measure_link,
    worker_addresses,
    worker_memory,
)
from .halfstep import SUALSEngine
from .placement import Factor
from .plan import Plan, make_plan
from .session import Session


@dataclass(frozen=True)
class ALSParams:
    """The model's hyper-parameters, as the engine and its checkpoints need them."""

    factors: int
    regularization: float
    iterations: int
    seed: int = 0
    precision: str = "float32"

    def attrs(self, store: RatingsStore) -> dict[str, Any]:
        """What a checkpoint or saved model records of the fit."""
        return {
            "factors": self.factors,
            "regularization": self.regularization,
            "seed": self.seed,
            "m": store.m,
            "n": store.n,
        }


@dataclass
class FitResult:
    plan: Plan
    metrics: list[dict[str, Any]]
    iterations_done: int
    session: Session


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
    """Fit on `client`'s workers with `backend` ("numpy" or "cupy", already resolved)."""
    client.register_plugin(CumfWorkerSetup())  # BLAS threads, kernel cache
    workers = worker_addresses(client)
    plan = make_plan(
        store.m, store.n, store.nnz, params.factors, len(workers),
        worker_memory(client, backend), store.counts("row"), store.counts("col"),
        plan_config, backend, link=measure_link(client, workers, backend),
    )  # fmt: skip
    engine = SUALSEngine(
        client, store, plan, params.regularization, backend_spec(backend, params.precision),
        workers, has_compute_slots(client),
    )  # fmt: skip
    engine.prepare(params.factors)  # kernels compile while the first blocks load
    checkpointer = Checkpointer(checkpoint_dir) if checkpoint_dir else None
    if resume and checkpointer is None:
        raise ConfigError("fit(resume=True) needs checkpoint_dir (output.checkpoint)")
    start, metrics, theta = _start(engine, store, params, checkpointer if resume else None)
    X: Factor | None = None
    began = time.perf_counter()
    for it in range(start + 1, params.iterations + 1):
        t0 = time.perf_counter()
        X = engine.half_step("x", theta, it, progress)
        theta.placed.clear()  # its copies on the workers are no longer needed
        t1 = time.perf_counter()
        theta = engine.half_step("theta", X, it, progress)
        X.placed.clear()
        t2 = time.perf_counter()
        record: dict[str, Any] = {
            "iteration": it,
            "seconds": t2 - t0,
            "x_seconds": t1 - t0,
            "theta_seconds": t2 - t1,
        }
        if evaluate:
            splits = ("train", "test") if store.has_test else ("train",)
            errors = engine.rmses(X, theta, it, splits)
            record.update({f"{split}_rmse": errors[split] for split in splits})
        record["elapsed"] = time.perf_counter() - began
        metrics.append(record)
        if checkpointer is not None:
            Xd, Td = Session(engine, X, theta).factors_as_dask()
            attrs = {**params.attrs(store), "metrics": metrics}
            checkpointer.save(it, {"user_factors": Xd, "item_factors": Td}, attrs, client)
        for callback in callbacks:
            callback(record)
    if X is None:  # nothing left to run (resumed at the end, or iterations == 0)
        X = engine.half_step("x", theta, start + 1)
    engine.release()
    done = max(start, params.iterations)
    return FitResult(plan, metrics, done, Session(engine, X, theta))


def _start(
    engine: SUALSEngine,
    store: RatingsStore,
    params: ALSParams,
    checkpointer: Checkpointer | None,
) -> tuple[int, list[dict[str, Any]], Factor]:
    """(iterations done, their metrics, Theta): from the last checkpoint, else fresh."""
    found = checkpointer.latest() if checkpointer is not None else None
    if found is None:
        return 0, [], engine.initial(store.n, params.factors, params.seed)
    start, attrs, arrays = found
    want = {"m": store.m, "n": store.n, "factors": params.factors}
    got = {k: attrs.get(k) for k in want}
    if got != want:
        raise StoreError(
            f"{checkpointer.directory}: the checkpoint is for {got}, this fit is {want}; "  # type: ignore[union-attr]
            "use another checkpoint_dir or resume=False"
        )
    return start, list(attrs.get("metrics", [])), engine.from_host(arrays["item_factors"])
