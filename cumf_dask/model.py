"""The ALS estimator: fit on a Dask cluster, then predict, score, recommend, save and load."""

from __future__ import annotations

import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import dask.array as da
import numpy as np

from .backend import PRECISIONS, backend_spec, get_backend, resolve_backend_name
from .checkpoint import MODEL_FORMAT, MODEL_VERSION, Checkpointer, read_factors, write_factors
from .config import ClusterConfig, PlanConfig
from .data.spill import build_store
from .data.store import RatingsStore
from .engine import tasks
from .engine.cluster import (
    CumfWorkerSetup,
    backend_on,
    cluster_client,
    plan_on,
    worker_addresses,
)
from .engine.graph import Factor, SUALSEngine, even_bounds
from .errors import ConfigError, StoreError
from .plan import Plan

Callback = Callable[[dict[str, Any]], None]


class ALS:
    """Alternating least squares with weighted-lambda regularization (cuMF's MO-ALS + SU-ALS).

    Parameters
    ----------
    factors : int
        f, the latent dimension.
    regularization : float
        lambda; each row's term is weighted by its rating count (n_u * lambda).
    iterations : int
        Full iterations (update X, then update Theta).
    seed : int
        Seed of the initial Theta (the result does not depend on the plan or worker count).
    backend : {"auto", "numpy", "cupy"}
        "auto" uses the GPU when one is visible.
    precision : {"float32", "bfloat16"}
        Storage precision of the fixed factor the Hermitians are built from; "bfloat16"
        halves its bytes (products and sums stay float32). Off by default; its measured
        error and speed are in benchmarks/RESULTS.md.
    plan : PlanConfig, optional
        Force p, q, the memory budget, residency or the reduction.
    checkpoint_dir : str, optional
        Write X and Theta after every iteration (atomically); ``fit(resume=True)`` uses it.
    evaluate : bool
        Compute train (and, if the store has held-out ratings, test) RMSE every iteration.
    callbacks : sequence of callables
        Each is called with the iteration's metrics record (a dict) after every iteration.
    progress : callable, optional
        ``progress(stage, done, total)`` as the batches of each half-step finish
        (stages "update X" and "update Theta").

    Attributes
    ----------
    user_factors_ : ndarray (m, f)
    item_factors_ : ndarray (n, f)
    metrics_ : list of dict
        Per iteration: iteration, seconds, x_seconds, theta_seconds, train_rmse, test_rmse.
    plan_ : Plan
    """

    def __init__(
        self,
        factors: int = 10,
        regularization: float = 0.05,
        iterations: int = 10,
        seed: int = 0,
        *,
        backend: str = "auto",
        precision: str = "float32",
        plan: PlanConfig | None = None,
        checkpoint_dir: str | None = None,
        evaluate: bool = True,
        callbacks: Sequence[Callback] = (),
        progress: Callable[[str, int, int], None] | None = None,
    ):
        self.factors = factors
        self.regularization = regularization
        self.iterations = iterations
        self.seed = seed
        self.backend = backend
        self.precision = precision
        self.plan = plan
        self.checkpoint_dir = checkpoint_dir
        self.evaluate = evaluate
        self.callbacks = list(callbacks)
        self.progress = progress

    # ------------------------------------------------------------------ fitting
    def fit(
        self,
        data: RatingsStore | str | tuple,
        *,
        client: Any = None,
        resume: bool = False,
    ) -> ALS:
        """Fit on a RatingsStore (or its URL), or on (rows, cols, ratings[, (m, n)]) arrays.

        With no `client`, a local cluster of the right kind is started and closed again;
        the factors are then gathered to this process. With a client, the factors also stay
        on the cluster (:meth:`factors_as_dask`).
        """
        self._check_params()
        store, tmp = self._as_store(data)
        try:
            if client is not None:
                self._fit(store, client, backend_on(client, self.backend), resume)
                self._gather()
                return self
            backend = resolve_backend_name(self.backend)
            with cluster_client(ClusterConfig(backend=backend, dashboard_address=None)) as own:
                self._fit(store, own, backend, resume)
                self._gather()
            self._engine = None
            self._X = self._Theta = None
        except BaseException:
            if tmp is not None:
                tmp.cleanup()
            raise
        self._tmp = tmp  # a store built from arrays lives as long as the model
        return self

    def _check_params(self) -> None:
        if not isinstance(self.factors, int) or self.factors < 1:
            raise ConfigError(f"factors must be a positive integer, got {self.factors!r}")
        if not self.regularization > 0:
            raise ConfigError(
                f"regularization must be > 0 (rows with fewer than f ratings need it), "
                f"got {self.regularization!r}"
            )
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}"
            )
        if not isinstance(self.iterations, int) or self.iterations < 0:
            raise ConfigError(f"iterations must be a non-negative integer, got {self.iterations!r}")

    def _as_store(self, data: Any) -> tuple[RatingsStore, Any]:
        if isinstance(data, RatingsStore):
            return data, None
        if isinstance(data, (str, Path)):
            return RatingsStore.open(str(data)), None
        if isinstance(data, tuple) and len(data) in (3, 4):
            tmp = tempfile.TemporaryDirectory(prefix="cumf-fit-")
            shape = data[3] if len(data) == 4 else None
            store = build_store(f"{tmp.name}/ratings.zarr", *data[:3], shape=shape)
            return store, tmp
        raise ConfigError(
            "fit() takes a RatingsStore, a store path/URL, or (rows, cols, ratings[, (m, n)])"
        )

    def _fit(self, store: RatingsStore, client: Any, backend: str, resume: bool) -> None:
        client.register_plugin(CumfWorkerSetup())  # BLAS threads, kernel cache
        workers = worker_addresses(client)
        self.plan_: Plan = plan_on(
            client,
            (store.m, store.n, store.nnz),
            self.factors,
            self.plan,
            backend,
            (store.counts("row"), store.counts("col")),
        )
        spec = backend_spec(backend, self.precision)
        engine = SUALSEngine(client, store, self.plan_, self.regularization, spec, workers)
        self._engine, self._store, self._backend = engine, store, backend
        self.shape_ = (store.m, store.n)
        self.metrics_: list[dict[str, Any]] = []
        start = 0
        checkpointer = Checkpointer(self.checkpoint_dir) if self.checkpoint_dir else None
        spread = even_bounds(store.n, len(workers))
        X: Factor | None = None
        theta: Factor | None = None
        if resume:
            if checkpointer is None:
                raise ConfigError("fit(resume=True) needs checkpoint_dir (output.checkpoint)")
            found = checkpointer.latest()
            if found is not None:
                start, attrs, arrays = found
                self._check_checkpoint(attrs, store)
                theta = engine.from_host(arrays["item_factors"], spread)
                self.metrics_ = list(attrs.get("metrics", []))
        if theta is None:
            theta = engine.initial(store.n, self.factors, self.seed, spread)
        began = time.perf_counter()
        for it in range(start + 1, self.iterations + 1):
            t0 = time.perf_counter()
            X = engine.half_step("x", theta, it, self.progress)
            theta.placed.clear()  # its copies on the workers are no longer needed
            t1 = time.perf_counter()
            theta = engine.half_step("theta", X, it, self.progress)
            X.placed.clear()
            t2 = time.perf_counter()
            record: dict[str, Any] = {
                "iteration": it,
                "seconds": t2 - t0,
                "x_seconds": t1 - t0,
                "theta_seconds": t2 - t1,
            }
            if self.evaluate:
                record["train_rmse"] = engine.rmse(X, theta, it, "train")
                if store.has_test:
                    record["test_rmse"] = engine.rmse(X, theta, it, "test")
            record["elapsed"] = time.perf_counter() - began
            self.metrics_.append(record)
            self._X, self._Theta = X, theta
            if checkpointer is not None:
                checkpointer.save(it, self._factor_arrays(), self._attrs(), client)
            for callback in self.callbacks:
                callback(record)
        if X is None:  # nothing left to run (resumed at the end, or iterations == 0)
            X = engine.half_step("x", theta, start + 1)
        self._X, self._Theta = X, theta
        engine.release()
        self.iterations_done_ = max(start, self.iterations)

    def _check_checkpoint(self, attrs: dict, store: RatingsStore) -> None:
        want = {"m": store.m, "n": store.n, "factors": self.factors}
        got = {k: attrs.get(k) for k in want}
        if got != want:
            raise StoreError(
                f"{self.checkpoint_dir}: the checkpoint is for {got}, this fit is {want}; "
                "use another checkpoint_dir or resume=False"
            )

    # ------------------------------------------------------------------ factors
    def _dask(self, factor: Factor) -> da.Array:
        backend = self._backend
        parts = [
            da.from_delayed(
                self._engine.client.submit(tasks.to_host, fut, backend, pure=False),
                shape=(hi - lo, factor.f),
                dtype=np.float32,
            )
            for lo, hi, fut in factor.pieces
        ]
        return da.concatenate(parts, axis=0)

    def factors_as_dask(self) -> tuple[da.Array, da.Array]:
        """(X, Theta) as Dask arrays on the cluster (only while the fit's client is open)."""
        if getattr(self, "_engine", None) is None or self._X is None:
            raise ConfigError("factors live on a cluster only after fit(client=...) with a client")
        return self._dask(self._X), self._dask(self._Theta)

    def _factor_arrays(self) -> dict[str, Any]:
        X, Theta = self.factors_as_dask()
        return {"user_factors": X, "item_factors": Theta}

    def _gather(self) -> None:
        X, Theta = self.factors_as_dask()
        client = self._engine.client
        self.user_factors_, self.item_factors_ = client.compute([X, Theta], sync=True)

    def _attrs(self) -> dict[str, Any]:
        return {
            "factors": self.factors,
            "regularization": self.regularization,
            "seed": self.seed,
            "m": self.shape_[0],
            "n": self.shape_[1],
            "metrics": self.metrics_,
        }

    # ------------------------------------------------------------------ using the model
    def predict(self, users: Any, items: Any) -> np.ndarray:
        """Predicted ratings x_u . theta_v for dense row/column indices (pairs)."""
        users = np.asarray(users, np.int64)
        items = np.asarray(items, np.int64)
        self._check_indices(users, items)
        be = get_backend("numpy")
        return be.predict(self.user_factors_, self.item_factors_, users, items)

    def rmse(self, data: RatingsStore | str | tuple, kind: str = "test") -> float:
        """RMSE on a store's held-out ("test") or training ("train") ratings, or on arrays."""
        if isinstance(data, tuple):
            rows, cols, vals = (np.asarray(a) for a in data[:3])
            chunks = [(rows, cols, vals)]
        else:
            store = data if isinstance(data, RatingsStore) else RatingsStore.open(str(data))
            chunks = store.iter_bands("test" if kind == "test" else "row")
        total, count = 0.0, 0
        be = get_backend("numpy")
        for rows, cols, vals in chunks:
            self._check_indices(rows, cols)
            total += be.squared_error(self.user_factors_, self.item_factors_, rows, cols, vals)
            count += len(vals)
        if count == 0:
            raise StoreError(f"no {kind} ratings to score")
        return float(np.sqrt(total / count))

    def recommend(
        self,
        users: Any,
        k: int = 10,
        exclude_seen: bool = True,
        store: RatingsStore | str | None = None,
        batch: int = 4096,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k items (dense indices) and scores per user, best first.

        Batches of users run as tasks on the fit's workers while its client is open, else
        here. ``exclude_seen`` skips each user's training items (read from `store`, by
        default the store the model was fitted on).
        """
        users = np.asarray(users, np.int64)
        self._check_indices(users, np.zeros(0, np.int64))
        if exclude_seen:
            store = store if store is not None else getattr(self, "_store", None)
            if store is None:
                raise ConfigError("recommend(exclude_seen=True) needs the rating store")
            if isinstance(store, str):
                store = RatingsStore.open(store)
        else:
            store = None
        chunks = [users[lo : lo + batch] for lo in range(0, len(users), batch)]
        engine = getattr(self, "_engine", None)
        if engine is None:
            results = [
                tasks.recommend_batch(
                    self.user_factors_[c], self.item_factors_, c, k, store, "numpy"
                )
                for c in chunks
            ]
        else:
            client = engine.client
            [theta] = client.scatter([self.item_factors_], broadcast=True)
            futures = [
                client.submit(
                    tasks.recommend_batch,
                    self.user_factors_[c],
                    theta,
                    c,
                    k,
                    store,
                    self._backend,
                    key=f"recommend-batch{i}-{engine.run}-{uuid.uuid4().hex[:6]}",
                )
                for i, c in enumerate(chunks)
            ]
            results = client.gather(futures)
        if not results:
            return np.zeros((0, k), np.int64), np.zeros((0, k), np.float32)
        return np.concatenate([r[0] for r in results]), np.concatenate([r[1] for r in results])

    def _check_indices(self, users: np.ndarray, items: np.ndarray) -> None:
        if not hasattr(self, "user_factors_"):
            raise ConfigError("the model is not fitted: call fit() or ALS.load() first")
        m, n = self.user_factors_.shape[0], self.item_factors_.shape[0]
        if users.size and (users.min() < 0 or users.max() >= m):
            raise ConfigError(f"user index out of range [0, {m})")
        if items.size and (items.min() < 0 or items.max() >= n):
            raise ConfigError(f"item index out of range [0, {n})")

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> None:
        """Write the model (factors, parameters, metrics, id maps) as a Zarr group."""
        if not hasattr(self, "user_factors_"):
            raise ConfigError("nothing to save: the model is not fitted")
        store = getattr(self, "_store", None)
        arrays: dict[str, Any] = {
            "user_factors": self.user_factors_,
            "item_factors": self.item_factors_,
        }
        if store is not None:
            arrays["user_ids"] = store.ids("rows")
            arrays["item_ids"] = store.ids("cols")
        attrs = {
            **self._attrs(),
            "format": MODEL_FORMAT,
            "version": MODEL_VERSION,
            "iterations": self.iterations,
            "store": store.url if store is not None else None,
        }
        write_factors(path, arrays, attrs)

    @classmethod
    def load(cls, path: str | Path) -> ALS:
        """A fitted model from :meth:`save` (factors on the host)."""
        attrs, arrays = read_factors(path, MODEL_FORMAT)
        model = cls(
            factors=int(attrs["factors"]),
            regularization=float(attrs["regularization"]),
            iterations=int(attrs["iterations"]),
            seed=int(attrs["seed"]),
            backend="numpy",
        )
        model.user_factors_ = arrays["user_factors"]
        model.item_factors_ = arrays["item_factors"]
        model.shape_ = (int(attrs["m"]), int(attrs["n"]))
        model.metrics_ = list(attrs.get("metrics", []))
        model.user_ids_ = arrays.get("user_ids")
        model.item_ids_ = arrays.get("item_ids")
        model.store_url_ = attrs.get("store")
        return model
