"""The ALS estimator: a thin scikit-learn style facade over the engine (:mod:`.engine.fit`).

``__init__`` only stores parameters; ``fit`` returns ``self`` with fitted attributes ending
in ``_``; a fitted model pickles (the live cluster state is dropped, as implicit's GPU model
drops its device handles); predict, rmse, recommend, save and load use the host factors.

Ids: the model keeps the maps between the data's own user and item ids and the rows of its
factors (dense indices), both ways, and saves them. ``recommend(user_ids)`` and
``predict(user_ids, item_ids)`` take and return the data's ids, as Spark's ALSModel does;
``recommend_indices`` and ``predict_indices`` take and return dense indices (the rows of
``user_factors_`` / ``item_factors_``), as implicit does, for loops that stay in indices.
Data without ids (a declared shape, a SciPy matrix) has the indices as its ids.
"""

from __future__ import annotations

import inspect
import os
import shutil
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import dask.array as da
import numpy as np

from .backend import PRECISIONS, get_backend, resolve_backend_name
from .callbacks import IterationCallback
from .checkpoint import MODEL_FORMAT, MODEL_VERSION, read_factors, write_factors
from .checks import check_choice, check_number
from .config import ClusterConfig, PlanConfig, check_plan_config
from .data.store import RatingsStore
from .engine import tasks
from .engine.cluster import backend_on, check_client, cluster_client
from .engine.fit import ALSParams, fit, ratings_digest, same_ratings
from .engine.plan import Plan, check_gpu_factors
from .engine.session import Session
from .errors import ConfigError, NotFittedError, StoreError, warn
from .ids import IdMap
from .locks import clear_dead_folders, owned_folder
from .paths import is_url
from .records import model_path


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
    solver : {"cholesky", "cg"}
        "cholesky" solves each row exactly; "cg" runs `cg_steps` conjugate-gradient steps
        warm-started from the row's previous factor (as implicit does).
    cg_steps : int
        CG steps per row and half-step (solver "cg").
    plan : PlanConfig, optional
        Force p, q, the memory budget, residency or the reduction.
    checkpoint_dir : str, optional
        Write X and Theta after every iteration (atomically); ``fit(resume=True)`` uses it.
    evaluate : bool
        Compute train (and, if the store has held-out ratings, test) RMSE every iteration.
    callbacks : callable or sequence of callables
        Each is called with the iteration's metrics record (a dict) after every iteration.
    progress : callable, optional
        ``progress(stage, done, total)`` as the batches of each half-step finish
        (stages "update X" and "update Theta").

    Attributes
    ----------
    user_factors_ : ndarray (m, f)
    item_factors_ : ndarray (n, f)
    user_ids_ : ndarray (m,) or None
        The data's own id of each row of user_factors_ (None: the ids are 0..m-1).
    item_ids_ : ndarray (n,) or None
        The data's own id of each row of item_factors_ (None: the ids are 0..n-1).
    store_url_ : str or None
        The store the model was fitted on, a local path made absolute (None for one built
        from in-memory data); ``store_ratings_`` its counts and statistics then, so that a
        store rebuilt there since is noticed (a CumfWarning).
    metrics_ : list of dict
        Per iteration: iteration, seconds, x_seconds, theta_seconds, train_rmse, test_rmse.
    plan_ : Plan
        The plan of the fit (a fitted model only: :meth:`load` does not restore it).
    iterations_done_ : int
        Iterations the fit ran, resumed ones included (a fitted model only).
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
        solver: str = "cholesky",
        cg_steps: int = 3,
        plan: PlanConfig | None = None,
        checkpoint_dir: str | None = None,
        evaluate: bool = True,
        callbacks: IterationCallback | Sequence[IterationCallback] | None = (),
        progress: Callable[[str, int, int | None], None] | None = None,
    ):
        self.factors = factors
        self.regularization = regularization
        self.iterations = iterations
        self.seed = seed
        self.backend = backend
        self.precision = precision
        self.solver = solver
        self.cg_steps = cg_steps
        self.plan = plan
        self.checkpoint_dir = checkpoint_dir
        self.evaluate = evaluate
        self.callbacks = callbacks  # kept as given (scikit-learn's clone checks identity)
        self.progress = progress

    def __repr__(self) -> str:
        """The parameters; when fitted also the shape, the ids and the last test RMSE."""
        extra = ""
        if self._fitted:
            extra = f", fitted {self.shape_[0]:,} users x {self.shape_[1]:,} items"
            if self.user_ids_ is not None or self.item_ids_ is not None:
                extra += " (own ids)"
            last = self.metrics_[-1] if self.metrics_ else {}
            if "test_rmse" in last:
                extra += f", test RMSE {last['test_rmse']:.4f}"
            extra += self._fitted_with_note()
        return (
            f"ALS(factors={self.factors}, regularization={self.regularization}, "
            f"iterations={self.iterations}, backend={self.backend!r}{extra})"
        )

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """The constructor's parameters by name, as scikit-learn estimators give them (so
        ``sklearn.base.clone`` and parameter searches work); `deep` changes nothing."""
        return {name: getattr(self, name) for name in self._param_names()}

    def set_params(self, **params: Any) -> ALS:
        """Set constructor parameters by name (checked when :meth:`fit` runs); returns self."""
        names = self._param_names()
        unknown = sorted(set(params) - set(names))
        if unknown:
            raise ConfigError(f"{type(self).__name__} has no parameter {unknown[0]!r}; its "
                              f"parameters are {', '.join(names)}")  # fmt: skip
        for name, value in params.items():
            setattr(self, name, value)
        return self

    def _fitted_params(self) -> ALSParams:
        """The hyper-parameters the factors were fitted with: set_params after a fit sets
        the next fit's, and save, fold-in and repr keep to these."""
        return getattr(self, "_fitted_with", None) or self._params()

    def _fitted_with_note(self) -> str:
        """For repr: the fitted values of parameters set since the fit, else nothing."""
        names = self._param_names()
        changed = [f"{k}={v!r}" for k, v in self._fitted_params().settings().items()
                   if k in names and getattr(self, k) != v]  # fmt: skip
        return f" (fitted with {', '.join(changed)})" if changed else ""

    @classmethod
    def _param_names(cls) -> list[str]:
        return [p for p in inspect.signature(cls.__init__).parameters if p != "self"]

    def _callbacks(self) -> list[IterationCallback]:
        """`callbacks` as a list: a single callable may be given alone, or None."""
        if self.callbacks is None:
            return []
        if callable(self.callbacks):
            return [self.callbacks]
        try:
            return list(self.callbacks)
        except TypeError:
            raise ConfigError(f"callbacks must be a callable or a sequence of callables; "
                              f"got {self.callbacks!r}") from None  # fmt: skip

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the live cluster state, the temporary store folder (and the store
        in it, which goes with this model: a copy needs ``store=`` to exclude seen items)
        and id lookups."""
        drop = ("_session", "_tmp", "_maps", "_matched")
        if getattr(self, "_tmp", None) is not None:
            drop += ("_store",)
        return {k: v for k, v in self.__dict__.items() if k not in drop}

    # ------------------------------------------------------------------ fitting
    def fit(
        self,
        data: Any,
        *,
        client: Any = None,
        resume: bool = False,
    ) -> ALS:
        """Fit on ratings; returns self.

        Parameters
        ----------
        data
            A RatingsStore or its path/URL; ``(users, items, ratings)`` or ``(users, items,
            ratings, (m, n))`` arrays; a pandas or Dask DataFrame with ``user``, ``item``,
            ``rating`` columns; a NumPy or Dask array of shape (nnz, 3); or a SciPy sparse
            matrix. Ids are kept and spoken by predict/recommend (a shape, and SciPy, make
            them indices); see :mod:`cumf_dask.data.inputs`. All of it is training data:
            to hold ratings out, build a store with ``test_fraction`` (the ingest functions
            and ``cumf-dask ingest`` hold out 10% by default) and fit on the store.
        client : distributed.Client, optional
            Without one, a local cluster of the right kind is started and closed again
            (threads of this process for small CPU problems, ``cluster.processes``); with
            one, the factors also stay on the cluster (:meth:`factors_as_dask`).
        resume : bool
            Continue from the last checkpoint in ``checkpoint_dir``.
        """
        self._check_params()
        if client is not None:
            check_client(client, "fit")
        store, tmp = self._as_store(data, client)
        try:
            self._check_store(store)
            if client is not None:
                self._fit(store, client, backend_on(client, self.backend), resume)
            else:
                backend = resolve_backend_name(self.backend)
                check_gpu_factors(self.factors, backend)  # before a cluster starts
                config = ClusterConfig(backend=backend, dashboard_address=None)
                with cluster_client(config, nnz=store.nnz) as own:
                    self._fit(store, own, backend, resume)
                    self._session.close()  # type: ignore[union-attr]  # before the cluster
                self._session = None
        except BaseException:
            if tmp is not None:
                tmp.cleanup()
            raise
        self._tmp = tmp  # a store built from arrays lives as long as the model
        self.store_url_ = None if tmp is not None else _location(store.url)
        return self

    def _check_params(self) -> None:
        check_number("factors", self.factors, 1, integer=True)
        check_number("regularization", self.regularization, 0, low_inclusive=False)
        check_number("iterations", self.iterations, 0, integer=True)
        check_number("seed", self.seed, 0, integer=True)
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("backend", self.backend, ("auto", "numpy", "cupy"))
        if self.plan is not None:
            if not isinstance(self.plan, PlanConfig):
                raise ConfigError(
                    f"plan must be a cumf_dask.config.PlanConfig or None, got "
                    f"{type(self.plan).__name__}: e.g. plan=PlanConfig(p=2)"
                )
            check_plan_config(self.plan)  # as a config file's plan section is checked
        if not isinstance(self.evaluate, (bool, np.bool_)):
            raise ConfigError(f"'evaluate' must be True or False, got {self.evaluate!r}")
        if self.progress is not None and not callable(self.progress):
            raise ConfigError(f"progress must be None or a callable progress(stage, done, "
                              f"total); got {self.progress!r}")  # fmt: skip
        bad = [c for c in self._callbacks() if not callable(c)]
        if bad:
            raise ConfigError(f"callbacks must be callables (each takes the iteration's "
                              f"record); got {bad[0]!r}")  # fmt: skip
        self._params().spec()  # checks the solver and its options

    def _params(self) -> ALSParams:
        """The hyper-parameters the engine fits with (the implicit estimator adds its own)."""
        return ALSParams(
            self.factors, self.regularization, self.iterations, self.seed, self.precision,
            solver=self.solver, cg_steps=self.cg_steps,
        )  # fmt: skip

    def _check_store(self, store: RatingsStore) -> None:
        """Refuse data this model cannot fit (the explicit model fits any ratings)."""

    def _as_store(self, data: Any, client: Any) -> tuple[RatingsStore, Any]:
        """The store `data` is or names, else a temporary one built from it (a Dask input is
        computed on `client` when one is given); the temporary directory is returned too."""
        if isinstance(data, RatingsStore):
            return data, None
        if isinstance(data, (str, Path)):
            return RatingsStore.open(str(data)), None
        from .data.inputs import ingest_input

        tmp = _TempFolder()
        try:
            store = ingest_input(
                data, f"{tmp.name}/ratings.zarr", test_fraction=0.0, client=client
            )
        except BaseException:
            tmp.cleanup()
            raise
        return store, tmp

    def _fit(self, store: RatingsStore, client: Any, backend: str, resume: bool) -> None:
        params = self._params()
        ids = store.ids("rows"), store.ids("cols")  # read (and checked) before training
        result = fit(
            client, store, params, backend, plan_config=self.plan, evaluate=self.evaluate,
            checkpoint_dir=self.checkpoint_dir, resume=resume, callbacks=self._callbacks(),
            progress=self.progress,
        )  # fmt: skip
        self._fitted_with = params
        self.plan_: Plan = result.plan
        self.metrics_: list[dict[str, Any]] = result.metrics
        self.iterations_done_ = result.iterations_done
        self.shape_ = (store.m, store.n)
        self.user_ids_: np.ndarray | None = ids[0]
        self.item_ids_: np.ndarray | None = ids[1]
        self._maps: dict[str, IdMap] = {}
        self.user_factors_, self.item_factors_ = result.factors
        self._store = store
        self.store_ratings_ = ratings_digest(store)
        self._matched = {_identity(store)}  # the fit's own store: its ids are the model's
        self._session: Session | None = result.session

    # ------------------------------------------------------------------ factors
    def _live_session(self) -> Session | None:
        """The fit's factors on its cluster, while its client is open, its workers hold
        them and there is a worker to run on (else the host copy serves)."""
        session = getattr(self, "_session", None)
        return session if session is not None and session.is_usable else None

    @property
    def _fitted(self) -> bool:
        return hasattr(self, "user_factors_")

    def _check_fitted(self) -> None:
        if not self._fitted:
            raise NotFittedError("the model is not fitted: call fit() or ALS.load() first")

    def factors_as_dask(self) -> tuple[da.Array, da.Array]:
        """(X, Theta) as Dask arrays on the cluster (only while the fit's client is open)."""
        self._check_fitted()
        if not self._live_session():
            raise NotFittedError(
                "factors live on a cluster only after fit(client=...), while that client is "
                "open and its workers hold them (a restart or scaling to no workers lets them "
                "go); use user_factors_ and item_factors_ here"
            )
        return self._session.factors_as_dask()  # type: ignore[union-attr]

    # ------------------------------------------------------------------ ids
    def user_indices(self, users: Any) -> np.ndarray:
        """Dense indices (rows of user_factors_) of the data's own user ids."""
        return self._map("user").indices(users)

    def item_indices(self, items: Any) -> np.ndarray:
        """Dense indices (rows of item_factors_) of the data's own item ids."""
        return self._map("item").indices(items)

    def _map(self, noun: str) -> IdMap:
        self._check_fitted()
        maps = self.__dict__.setdefault("_maps", {})
        if noun not in maps:
            labels = self.user_ids_ if noun == "user" else self.item_ids_
            maps[noun] = IdMap(noun, labels, self.shape_[0 if noun == "user" else 1])
        return maps[noun]

    # ------------------------------------------------------------------ using the model
    def predict(self, users: Any, items: Any) -> np.ndarray:
        """Predicted ratings x_u . theta_v of (user, item) pairs given in the data's own ids."""
        return self.predict_indices(self.user_indices(users), self.item_indices(items))

    def predict_indices(self, users: Any, items: Any) -> np.ndarray:
        """Predicted ratings x_u . theta_v for dense row/column indices (pairs)."""
        users = self._as_indices(users, "user")
        items = self._as_indices(items, "item")
        if users.size != items.size:
            raise ConfigError(
                f"predict takes (user, item) pairs: {users.size} users but {items.size} items"
            )
        self._check_indices(users, items)
        be = get_backend("numpy")
        return be.predict(self.user_factors_, self.item_factors_, users, items)

    def rmse(self, data: RatingsStore | str | tuple, kind: str = "test") -> float:
        """RMSE on a store's held-out ("test") or training ("train") ratings, or on
        (users, items, ratings) arrays in the data's own ids."""
        check_choice("kind", kind, ("test", "train"))
        if isinstance(data, tuple):
            if len(data) != 3:
                raise ConfigError(f"rmse takes a store, or (users, items, ratings) arrays: got a "
                                  f"tuple of {len(data)}")  # fmt: skip
            vals = np.asarray(data[2], np.float64)
            if not np.isfinite(vals).all():
                raise ConfigError("rmse: the ratings must be finite numbers (NaN or inf given)")
            rows, cols = self.user_indices(data[0]), self.item_indices(data[1])
            if not rows.size == cols.size == vals.size:
                raise ConfigError(
                    f"rmse takes (users, items, ratings) of one length: {rows.size}, "
                    f"{cols.size}, {vals.size}"
                )
            chunks = [(rows, cols, vals)]
        else:
            store = self._matching(data if isinstance(data, RatingsStore) else str(data))
            chunks = store.iter_bands("row", "test" if kind == "test" else "train")
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
        """Top-k items and scores for users given in the data's own ids, best first.

        Returns (items, scores) of shape (len(users), k): items in the data's own item ids.
        Other parameters as for :meth:`recommend_indices`.
        """
        indices = self.user_indices(users)
        top, scores = self.recommend_indices(indices, k, exclude_seen, store, batch)
        self._warn_cold(indices)
        return self._map("item").ids(top), scores

    def recommend_indices(
        self,
        users: Any,
        k: int = 10,
        exclude_seen: bool = True,
        store: RatingsStore | str | None = None,
        batch: int = 4096,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k items (dense indices) and scores per user (dense indices), best first.

        Batches of users run as tasks on the fit's workers while its client is open, else
        here. ``exclude_seen`` skips each user's training items, read from `store` (by
        default the store the model was fitted on, for a loaded model the one it names).

        `k` must be an integer >= 1. A `k` above the number of items n is clamped to n (with
        a CumfWarning). A user with fewer than k items left to recommend (the others seen in
        training) gets them all, then item -1 with score -inf in the remaining places (as
        ImplicitALS does): no real score is -inf, so the score tells an empty place from an
        item whose own id is -1 (:meth:`recommend`; as a dense index -1 is never an item).
        """
        self._check_fitted()
        k = self._top_k(k, self.item_factors_.shape[0])
        check_number("batch", batch, 1, integer=True)
        users = self._as_indices(users, "user")
        self._check_indices(users, np.zeros(0, np.int64))
        if exclude_seen:
            store = store if store is not None else getattr(self, "_store", None)
            if store is None:
                store = self._training_store()
            store = self._matching(store)
        else:
            store = None
        chunks = [users[lo : lo + batch] for lo in range(0, len(users), batch)]
        session = self._live_session()
        if session is None:
            X, Theta = self.user_factors_, self.item_factors_
            results = [tasks.recommend_batch(X[c], Theta, c, k, store, "numpy") for c in chunks]
        else:
            results = session.recommend(
                self.user_factors_, self.item_factors_, chunks, k, store
            )
        if not results:
            return np.zeros((0, k), np.int64), np.zeros((0, k), np.float32)
        return np.concatenate([r[0] for r in results]), np.concatenate([r[1] for r in results])

    def _warn_cold(self, users: np.ndarray) -> None:
        """A CumfWarning when users given to :meth:`recommend` (dense `users`) have zero
        factors (no training rating, or only ratings of 0): every item scores 0 for them,
        so their list is in no meaningful order. Not said in rankings of many users
        (``evaluate``), whose fit warned of them already."""
        X, step = self.user_factors_, 1 << 16
        cold = sum(int(np.count_nonzero(~X[users[lo : lo + step]].any(axis=1)))
                   for lo in range(0, len(users), step))  # fmt: skip
        if cold:
            warn(f"{cold:,} of the {len(users):,} users have zero factors (no training rating, "
                 "or only ratings of 0): every item scores 0 for them, so their "
                 "recommendations are in no meaningful order")

    def _training_store(self) -> RatingsStore:
        """The store the model records it was trained on (for the items each user has
        seen), opened, or an error saying how to do without it."""
        url = getattr(self, "store_url_", None)
        if url is None:
            raise ConfigError(
                "recommend(exclude_seen=True) reads each user's rated items from the training "
                "store, and this model names none (it was fitted on in-memory ratings): pass "
                "store= (a store of those ratings, from ingest_arrays), or exclude_seen=False"
            )
        return self._open_training_store(url, "pass store= (the store it was trained on), or "
                                              "exclude_seen=False")  # fmt: skip

    @staticmethod
    def _open_training_store(url: str, fix: str) -> RatingsStore:
        """The store at `url`, recorded as the one a model was trained on; one that moved
        or was deleted since is a StoreError saying so and what to do (`fix`)."""
        try:
            return RatingsStore.open(url)
        except StoreError as exc:
            raise StoreError(
                f"the model's training store cannot be opened ({exc}); {fix}"
            ) from None

    @staticmethod
    def _top_k(k: Any, n: int, noun: str = "items", per: str = "user") -> int:
        """`k` checked (an integer >= 1) and clamped to the `n` `noun` there are to rank for
        each `per`, with a CumfWarning."""
        k = int(k) if isinstance(k, np.integer) else k
        check_number("k", k, 1, integer=True)
        if k > n:
            warn(f"k={k} is more than the {n:,} {noun}: returning {n:,} per {per}")
        return min(k, n)

    @staticmethod
    def _as_indices(values: Any, noun: str) -> np.ndarray:
        """Dense indices as int64: whole numbers in a 1-d list or array, else a ConfigError
        (a float is not truncated, a nested list is not ranked row by row)."""
        arr = np.asarray(values)
        if arr.ndim > 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ConfigError(
                f"{noun} indices must be a 1-d list or array of integers, got "
                f"{arr.dtype} of shape {arr.shape}"
            )
        return arr.astype(np.int64).reshape(-1)

    def _matching(self, store: RatingsStore | str) -> RatingsStore:
        """`store` (opened if a path) when it holds this model's data: its shape, and its
        user and item ids in the model's rows. Scores and seen items pair the store's rows
        with the model's by position, so a store built again from the data in another order
        (ids numbered otherwise) would give wrong answers without this check."""
        store = RatingsStore.open(store) if isinstance(store, str) else store
        matched = self.__dict__.setdefault("_matched", set())
        if _identity(store) in matched:  # a store rebuilt at the same path is checked again
            return store
        if (store.m, store.n) != self.shape_:
            raise StoreError(
                f"{store.url} is {store.m:,} x {store.n:,} but the model is "
                f"{self.shape_[0]:,} x {self.shape_[1]:,}: use the store it was trained on"
            )
        for noun, axis in (("user", "rows"), ("item", "cols")):
            size = store.m if axis == "rows" else store.n
            differ = _first_difference(self._map(noun).labels, store.ids(axis), size)
            if differ is not None:
                row, here, there = differ
                raise StoreError(
                    f"{store.url} numbers its {noun}s otherwise than the model ({noun} "
                    f"{there!r} at row {row} there, {here!r} in the model): use the store the "
                    "model was trained on"
                )
        self._warn_if_rebuilt(store)
        matched.add(_identity(store))
        return store

    def _warn_if_rebuilt(self, store: RatingsStore) -> None:
        """A CumfWarning when `store` holds other ratings than the model was trained on:
        the training store rebuilt or replaced since, or another store (another split of
        the same data, whose held-out ratings may include ones the model trained on: its
        test scores would look better than they are)."""
        then = getattr(self, "store_ratings_", None)
        if then is None:
            return
        now = ratings_digest(store)
        if same_ratings(then, now):
            return
        trained_on = getattr(self, "store_url_", None)
        if _location(store.url) == trained_on:
            why = (f"{store.url} holds other ratings than when the model was trained on it "
                   f"(then {then}, now {now}): it was rebuilt or replaced")  # fmt: skip
        else:
            where = f"the store it was trained on ({trained_on})" if trained_on else (
                "the in-memory ratings it was fitted on")
            why = (f"{store.url} holds other ratings than {where} (then {then}, here {now}): "
                   "if it splits the same data otherwise, its held-out ratings may include "
                   "ones the model trained on and its test scores look better than they are")
        warn(f"{why}; RMSE and seen items come from what it holds")

    def _check_indices(self, users: np.ndarray, items: np.ndarray) -> None:
        self._check_fitted()
        m, n = self.user_factors_.shape[0], self.item_factors_.shape[0]
        if users.size and (users.min() < 0 or users.max() >= m):
            raise ConfigError(f"user index out of range [0, {m})")
        if items.size and (items.min() < 0 or items.max() >= n):
            raise ConfigError(f"item index out of range [0, {n})")

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path, *, after_error: str = "then save it again") -> None:
        """Write the model (factors, parameters, metrics, id maps, which store it was
        trained on) as a Zarr group. A model already saved at `path` (of either kind) is
        replaced, atomically; a folder that is not a saved model is refused. `after_error`:
        what a full disk's message says to do once space is freed."""
        if not self._fitted:
            raise NotFittedError("nothing to save: the model is not fitted")
        arrays: dict[str, Any] = {
            "user_factors": self.user_factors_,
            "item_factors": self.item_factors_,
            "user_ids": self.user_ids_,
            "item_ids": self.item_ids_,
        }
        attrs = {
            **self._fitted_params().settings(),
            "m": self.shape_[0],
            "n": self.shape_[1],
            "metrics": self.metrics_,
            "format": MODEL_FORMAT,
            "version": MODEL_VERSION,
            "store": self.store_url_,
            "store_ratings": getattr(self, "store_ratings_", None),
        }
        write_factors(path, arrays, attrs, after_error=after_error)

    @classmethod
    def _init_from(cls, attrs: dict[str, Any]) -> dict[str, Any]:
        """Constructor arguments recorded in a saved model's attrs."""
        return {
            "factors": int(attrs["factors"]),
            "regularization": float(attrs["regularization"]),
            "iterations": int(attrs["iterations"]),
            "seed": int(attrs["seed"]),
            "solver": str(attrs.get("solver", "cholesky")),
            "cg_steps": int(attrs.get("cg_steps", 3)),
            "precision": str(attrs.get("precision", "float32")),
        }

    @classmethod
    def load(cls, path: str | Path) -> ALS:
        """A fitted model from :meth:`save` (factors on the host); `path` is the model's
        folder or a run folder holding it (``runs/NAME-latest``).

        ``ALS.load`` reads any saved model (an implicit one as its :class:`ImplicitALS`);
        ``ImplicitALS.load`` only implicit ones.
        """
        attrs, arrays = read_factors(model_path(path), MODEL_FORMAT)
        kind = attrs.get("kind", "explicit")
        if kind == "implicit" and not getattr(cls, "implicit", False):
            from .implicit.model import ImplicitALS

            cls = ImplicitALS
        elif kind != "implicit" and getattr(cls, "implicit", False):
            raise StoreError(f"{path}: an explicit model; load it with ALS.load")
        model = cls(**cls._init_from(attrs), backend="numpy")
        model._fitted_with = model._params()
        model.user_factors_ = arrays["user_factors"]
        model.item_factors_ = arrays["item_factors"]
        model.shape_ = (int(attrs["m"]), int(attrs["n"]))
        model.metrics_ = list(attrs.get("metrics", []))
        model.user_ids_ = arrays.get("user_ids")
        model.item_ids_ = arrays.get("item_ids")
        model.store_url_ = attrs.get("store")
        model.store_ratings_ = attrs.get("store_ratings")
        model._maps = {}
        return model


class _TempFolder:
    """The folder of a store built from in-memory data, living as long as the model that
    holds it: removed by cleanup() or when the model lets go of it (collected, or refitted),
    quietly: TemporaryDirectory warns (ResourceWarning) at the latter, the normal case here."""

    PREFIX = "cumf-fit-"

    def __init__(self) -> None:
        clear_dead_folders(self.PREFIX, "store folder(s) of killed fits on in-memory data")
        self.name = str(owned_folder(self.PREFIX))
        self._remove = weakref.finalize(self, shutil.rmtree, self.name, ignore_errors=True)

    def cleanup(self) -> None:
        self._remove()


def _location(url: str) -> str:
    """A store's URL, a local path made absolute: a saved model finds its store from any
    working directory."""
    return url if is_url(url) else os.path.abspath(url)


def _identity(store: RatingsStore) -> tuple[str, Any]:
    """Where a store is and which build of it: a store rebuilt at the same path differs."""
    return _location(store.url), store.attrs.get("build")


def _first_difference(
    ours: np.ndarray | None, theirs: np.ndarray | None, size: int
) -> tuple[int, Any, Any] | None:
    """(row, our id, their id) at the first row whose id differs between two id arrays of
    `size` rows (None: the ids are the indices), or None when they agree (numbers with
    numbers, text with text)."""
    ours = np.arange(size) if ours is None else np.asarray(ours)
    theirs = np.arange(size) if theirs is None else np.asarray(theirs)
    text = [a.dtype.kind in "OUST" for a in (ours, theirs)]
    if text[0] != text[1]:
        differ = np.zeros(1, np.int64)
    else:
        same = ours.astype(object) == theirs.astype(object) if text[0] else ours == theirs
        differ = np.flatnonzero(~same)
    if not differ.size:
        return None
    row = int(differ[0])
    here, there = (a[row].item() if isinstance(a[row], np.generic) else a[row]
                   for a in (ours, theirs))  # fmt: skip
    return row, here, there
