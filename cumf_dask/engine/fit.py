"""The ALS loop on a cluster: plan, start (fresh or from a checkpoint), iterate, checkpoint.

Each iteration runs update X (Theta fixed) then update Theta (X fixed) as SU-ALS half-steps
(:mod:`.halfstep`), times both, scores train (and held-out) RMSE where the blocks live (the
implicit model: its objective, see ``SUALSEngine.implicit_loss``), writes an atomic
checkpoint, and calls the callbacks with the iteration's record. With the CG solver each
half-step starts from the solved factor's previous iterate (X's first one is drawn from the
seed like Theta's, stream 2), and a resumed fit restores both factors.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from distributed import Client

from ..backend import backend_spec
from ..backend.objective import UpdateSpec
from ..callbacks import IterationCallback, Progress
from ..checkpoint import Checkpointer
from ..config import PlanConfig
from ..data.store import RatingsStore
from ..errors import ConfigError, StoreError
from .cluster import (
    CumfWorkerSetup,
    has_compute_slots,
    measure_link,
    read_threads,
    worker_addresses,
    worker_memory,
)
from .halfstep import SUALSEngine
from .placement import Factor
from .plan import Plan, make_plan
from .session import Session


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
        """What a checkpoint records of the fit."""
        return {**self.settings(), "m": store.m, "n": store.n}

    def settings(self) -> dict[str, Any]:
        """The hyper-parameters a checkpoint or saved model records."""
        return {
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
    spec = params.spec()
    engine = SUALSEngine(
        client, store, plan, spec, backend_spec(backend, params.precision),
        workers, has_compute_slots(client), read_threads(client, workers),
    )  # fmt: skip
    engine.prepare(params.factors)  # kernels compile while the first blocks load
    checkpointer = Checkpointer(checkpoint_dir) if checkpoint_dir else None
    if resume and checkpointer is None:
        raise ConfigError("fit(resume=True) needs checkpoint_dir (output.checkpoint)")
    start, metrics, theta, X = _start(engine, store, params, checkpointer if resume else None)
    began = time.perf_counter()
    for it in range(start + 1, params.iterations + 1):
        t0 = time.perf_counter()
        X = engine.half_step("x", theta, it, progress, previous=X)
        theta.placed.clear()  # its copies on the workers are no longer needed
        t1 = time.perf_counter()
        theta = engine.half_step("theta", X, it, progress, previous=theta)
        X.placed.clear()
        t2 = time.perf_counter()
        record: dict[str, Any] = {
            "iteration": it,
            "seconds": t2 - t0,
            "x_seconds": t1 - t0,
            "theta_seconds": t2 - t1,
        }
        if evaluate and spec.implicit:
            record.update(engine.implicit_loss(X, theta, it))
        elif evaluate:
            record["train_rmse"] = engine.rmse(X, theta, it, "train")
            if store.has_test:
                record["test_rmse"] = engine.rmse(X, theta, it, "test")
        record["elapsed"] = time.perf_counter() - began
        metrics.append(record)
        if checkpointer is not None:
            Xd, Td = Session(engine, X, theta).factors_as_dask()
            attrs = {**params.attrs(store), "metrics": metrics}
            checkpointer.save(it, {"user_factors": Xd, "item_factors": Td}, attrs, client)
        for callback in callbacks:
            callback(record)
    if X is None:  # nothing left to run (resumed at the end, or iterations == 0); CG kept
        X = engine.half_step("x", theta, start + 1)  # its X (a solve would move it on)
    engine.release()
    done = max(start, params.iterations)
    return FitResult(plan, metrics, done, Session(engine, X, theta))


def _start(
    engine: SUALSEngine,
    store: RatingsStore,
    params: ALSParams,
    checkpointer: Checkpointer | None,
) -> tuple[int, list[dict[str, Any]], Factor, Factor | None]:
    """(iterations done, their metrics, Theta, X or None): from the last checkpoint, else
    fresh. X is None unless the CG solver needs a starting point."""
    cg = params.solver == "cg"
    found = checkpointer.latest() if checkpointer is not None else None
    if found is None:
        scale = params.init_scale
        theta = engine.initial(store.n, params.factors, params.seed, scale=scale)
        x = engine.initial(store.m, params.factors, params.seed, 2, scale) if cg else None
        return 0, [], theta, x
    start, attrs, arrays = found
    want = {"m": store.m, "n": store.n, "factors": params.factors, "kind": params.kind}
    got = {k: attrs.get(k, "explicit" if k == "kind" else None) for k in want}
    if got != want:
        raise StoreError(
            f"{checkpointer.directory}: the checkpoint is for {got}, this fit is {want}; "  # type: ignore[union-attr]
            "use another checkpoint_dir or resume=False"
        )
    theta = engine.from_host(arrays["item_factors"])
    x = engine.from_host(arrays["user_factors"]) if cg else None
    return start, list(attrs.get("metrics", [])), theta, x
