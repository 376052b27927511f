"""ImplicitALS: implicit-feedback ALS (Hu, Koren, Volinsky) on cumf-dask's SU-ALS engine."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import numpy as np

from ..backend.objective import CONFIDENCES, UpdateSpec, check_confidence
from ..checks import check_choice, check_number
from ..data.store import RatingsStore
from ..engine import tasks
from ..engine.fit import ALSParams
from ..errors import ConfigError, NumericalError
from ..model import ALS
from .ids import IdLayer, interactions_block

REGULARIZATION_MODES = ("plain", "weighted")


class ImplicitALS(ALS):
    """Alternating least squares for implicit feedback (counts, clicks, plays).

    Each stored count r_ui > 0 is a preference p_ui = 1 with confidence c_ui = 1 + alpha r_ui
    (or 1 + alpha log(1 + r_ui / eps)); every other pair has p = 0, c = 1. The model minimizes
    ``sum_{u,i} c_ui (p_ui - x_u . y_i)^2`` plus the regularization over all m x n pairs,
    without forming them: per row it solves ``(Y^T Y + Y_u^T (C_u - I) Y_u + reg_u I) x_u =
    Y_u^T C_u p_u`` (:mod:`cumf_dask.backend.objective`), on every plan, backend and number of
    workers the explicit :class:`~cumf_dask.ALS` runs on.

    Why a sibling estimator (a subclass sharing the engine, the fit loop, checkpoints, save
    and load) rather than ``ALS(implicit=True)``: the explicit estimator's parameters,
    defaults and methods stay exactly as they are, while this one can take implicit's defaults
    (factors 100, lambda 0.01, plain lambda, 15 iterations, CG with 3 steps) and its method
    names and arguments (``recommend(..., filter_already_liked_items=, items=)``,
    ``similar_items``, ``similar_users``, ``recalculate_user``, ``user_factors``).

    Differences from implicit 0.7.3, on purpose: implicit uses the stored value times alpha as
    the confidence (c = alpha r, so binary data with its default alpha = 1 gives c = 1), where
    this model uses the paper's c = 1 + alpha r: on binary data implicit's model (c = 1 for
    each 1) is this one's with ``alpha = 0``, and implicit fed the matrix 1 + alpha R with its
    alpha = 1 is exactly this model (on counts r the two differ otherwise). Places left when
    fewer than k candidates remain come back as id -1 (None where the ids are text) with
    score -inf (implicit returns filtered items with score -FLT_MAX). Methods take and
    return the data's own user and item ids, as the explicit ALS's do (implicit's take dense
    indices): one id layer (:mod:`.ids`) maps them.
    ``recommend_indices`` works in dense indices (rows of ``user_factors_`` and
    ``item_factors_``), as do the `user_items` of :meth:`recommend` and
    :meth:`recalculate_user`.

    Parameters
    ----------
    factors : int
        f, the latent dimension.
    regularization : float
        lambda.
    alpha : float
        Confidence slope (>= 0): c = 1 + alpha r (``confidence="linear"``) or
        1 + alpha log(1 + r / eps) ("log").
    iterations : int
        Full iterations (update users, then items).
    seed : int
        Seed of the initial factors.
    confidence : {"linear", "log"}
    eps : float
        The log form's scale.
    regularization_mode : {"plain", "weighted"}
        "plain": lambda on every row (implicit's); "weighted": lambda times the row's number of
        interactions (cuMF's).
    solver : {"cg", "cholesky"}
        "cg": ``cg_steps`` conjugate-gradient steps per row, warm-started from the previous
        factors (implicit's); "cholesky": the exact solve.
    cg_steps : int
    init_scale : float
        Initial factors are uniform in [0, init_scale) (implicit's 0.01).
    backend, precision, plan, checkpoint_dir, evaluate, callbacks, progress
        As for :class:`~cumf_dask.ALS`. ``evaluate`` records the objective each iteration
        (``loss``: divided by the total confidence, implicit's ``calculate_loss``).

    Attributes
    ----------
    user_factors_ : ndarray (m, f), also ``user_factors``
    item_factors_ : ndarray (n, f), also ``item_factors``
    metrics_ : list of dict
        Per iteration: iteration, seconds, x_seconds, theta_seconds, loss, objective.
    plan_ : Plan
    """

    implicit = True

    def __init__(
        self,
        factors: int = 100,
        regularization: float = 0.01,
        alpha: float = 1.0,
        iterations: int = 15,
        seed: int = 0,
        *,
        confidence: str = "linear",
        eps: float = 1.0,
        regularization_mode: str = "plain",
        solver: str = "cg",
        cg_steps: int = 3,
        init_scale: float = 0.01,
        backend: str = "auto",
        precision: str = "float32",
        plan: Any = None,
        checkpoint_dir: str | None = None,
        evaluate: bool = True,
        callbacks: Any = (),
        progress: Any = None,
    ):
        super().__init__(
            factors, regularization, iterations, seed, backend=backend, precision=precision,
            solver=solver, cg_steps=cg_steps, plan=plan, checkpoint_dir=checkpoint_dir,
            evaluate=evaluate, callbacks=callbacks, progress=progress,
        )  # fmt: skip
        self.alpha = alpha
        self.confidence = confidence
        self.eps = eps
        self.regularization_mode = regularization_mode
        self.init_scale = init_scale

    def __repr__(self) -> str:
        fitted = ""
        if self._fitted:
            fitted = f", fitted {self.shape_[0]:,} x {self.shape_[1]:,}{self._fitted_with_note()}"
        return (
            f"ImplicitALS(factors={self.factors}, regularization={self.regularization}, "
            f"alpha={self.alpha}, iterations={self.iterations}, solver={self.solver!r}, "
            f"backend={self.backend!r}{fitted})"
        )

    # ------------------------------------------------------------------ fitting
    def _params(self) -> ALSParams:
        check_choice("regularization_mode", self.regularization_mode, REGULARIZATION_MODES)
        check_choice("confidence", self.confidence, CONFIDENCES)
        check_number("alpha", self.alpha, 0)
        check_number("init_scale", self.init_scale, 0, low_inclusive=False)
        return ALSParams(
            self.factors, self.regularization, self.iterations, self.seed, self.precision,
            kind="implicit", alpha=self.alpha, confidence=self.confidence, eps=self.eps,
            regularization_mode=self.regularization_mode, solver=self.solver,
            cg_steps=self.cg_steps, init_scale=self.init_scale,
        )  # fmt: skip

    def _check_store(self, store: RatingsStore, source: str | None = None) -> None:
        """Refuse negative counts, and counts none of which is positive (every preference 0:
        the optimum is all-zero factors, a model that ranks at random), naming `source`
        (default: the store's URL), and an alpha whose confidence of the largest count
        overflows float32."""
        low, high = store.stats.get("min"), store.stats.get("max")
        if low is not None and low < 0:
            raise ConfigError(
                f"{source or store.url}: implicit feedback needs counts >= 0, it holds {low:g}; "
                "use the explicit ALS for signed ratings"
            )
        if high is not None and high <= 0:
            raise ConfigError(
                f"{source or store.url}: implicit feedback needs some positive counts, and "
                f"every one of its {store.nnz:,} training counts is 0: there is nothing to "
                "learn a preference from"
            )
        check_confidence(self._spec(), high)

    def _as_store(self, data: Any, client: Any) -> tuple[RatingsStore, Any]:
        """Also a SciPy sparse user x item matrix, as implicit's ``fit(user_items)``. In-memory
        data is checked here, so that an error names it and not the temporary store."""
        if hasattr(data, "tocoo"):
            coo = data.tocoo()
            data = (coo.row, coo.col, coo.data, coo.shape)
        store, tmp = super()._as_store(data, client)
        if tmp is not None:
            try:
                self._check_store(store, "the data given to fit")
            except ConfigError:
                tmp.cleanup()
                raise
        return store, tmp

    @classmethod
    def _init_from(cls, attrs: dict[str, Any]) -> dict[str, Any]:
        return {
            **super()._init_from(attrs),
            "alpha": float(attrs["alpha"]),
            "confidence": str(attrs["confidence"]),
            "eps": float(attrs["eps"]),
            "regularization_mode": str(attrs["regularization_mode"]),
            "init_scale": float(attrs.get("init_scale") or 0.01),
        }

    @classmethod
    def load(cls, path: str | Path) -> ImplicitALS:
        return cast(ImplicitALS, super().load(path))

    # ------------------------------------------------------------------ implicit's names
    @property
    def user_factors(self) -> np.ndarray:
        self._check_fitted()
        return self.user_factors_

    @property
    def item_factors(self) -> np.ndarray:
        self._check_fitted()
        return self.item_factors_

    @property
    def _ids(self) -> IdLayer:
        return IdLayer(self._map("user"), self._map("item"))

    def _spec(self) -> UpdateSpec:
        return self._params().spec()

    # ------------------------------------------------------------------ batches
    def _run(self, func: Any, shared: list[np.ndarray], batches: list[tuple], name: str):
        """Batches as tasks on the fit's workers while its client is open, else here."""
        session = self._live_session()
        if session is None:
            return [func(*shared, *batch, "numpy") for batch in batches]
        return session.run_batches(func, shared, batches, name)

    def _seen_store(self, store: RatingsStore | str | None) -> RatingsStore:
        """`store`, else the store the model was trained on, opened (for the items each user
        has seen); when that one is gone, an error saying how to do without it."""
        store = store if store is not None else getattr(self, "_store", None)
        url = getattr(self, "store_url_", None)
        if store is None and not url:
            raise ConfigError(
                "filtering liked items reads each user's items from the training store, and "
                "this model names none (it was fitted on in-memory data): pass store= (a store "
                "of that data, from ingest_arrays), user_items, or "
                "filter_already_liked_items=False"
            )
        if store is None:
            fix = ("pass store= (the store it was trained on), user_items, or "
                   "filter_already_liked_items=False")  # fmt: skip
            store = self._open_training_store(url, fix)
        return self._matching(store)

    def recalculate_user(self, user_items: Any, *, batch: int = 4096) -> np.ndarray:
        """Factors of users from their interactions, without refitting (fold-in).

        Each row of `user_items` is one user (new or not), solved exactly against the fitted
        item factors, as one more user half-step would: ``(Y^T Y + Y_u^T (C_u - I) Y_u + reg I)
        x = Y_u^T C_u p_u``. `user_items` is in positions and dense indices, not own ids: a
        SciPy sparse matrix (U, n) whose row r is the r-th user and whose column j is item
        index j (row j of ``item_factors_``; :meth:`item_indices` maps own ids), or
        ``(rows, items, counts)`` arrays, rows the positions 0..U-1 and items such indices
        (integers; a pair given more than once counts as the sum, as SciPy reads it).
        The model does not change. Batches run on the workers while the fit's client is open.
        Returns (U, f) float32, row r for row r of `user_items`.
        """
        self._check_fitted()
        check_number("batch", batch, 1, integer=True)
        block = interactions_block(user_items, None, self.item_factors_.shape[0])
        return self._fold_in(block, batch)

    def _fold_in(self, block: Any, batch: int) -> np.ndarray:
        from ..blocks import take_rows

        theta = self.item_factors_
        gram0 = theta.astype(np.float64).T @ theta.astype(np.float64)
        spec = replace(self._fitted_params().spec(), solver="cholesky")
        batches = [
            (take_rows(block, np.arange(lo, min(lo + batch, block.n_rows))), spec)
            for lo in range(0, block.n_rows, batch)
        ]
        if not batches:
            return np.zeros((0, theta.shape[1]), np.float32)
        parts = self._run(tasks.fold_in_batch, [theta, gram0], batches, "fold-in")
        X = np.concatenate(parts).astype(np.float32)
        if not np.isfinite(X).all():
            raise NumericalError(
                "folding users in gave non-finite factors (a system not positive definite in "
                "float32): use a model with a larger regularization"
            )
        return X

    def recommend(  # type: ignore[override]
        self,
        users: Any,
        k: int = 10,
        *,
        filter_already_liked_items: bool = True,
        items: Any = None,
        user_items: Any = None,
        recalculate_user: bool = False,
        store: RatingsStore | str | None = None,
        batch: int = 4096,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k items and scores (x_u . y_i) per user, best first: ((U, k), (U, k)).

        Parameters
        ----------
        users : an id or array of the data's own user ids
            With ``recalculate_user``, only their number matters (one per row of
            `user_items`): the users need not be in the fit.
        k : int
            At most this many items (at most ``len(items)``).
        filter_already_liked_items : bool
            Skip each user's items: those of `user_items` when given, else their training
            items in `store` (default: the store the model was fitted on).
        items : array of the data's own item ids, optional
            Rank only these candidates.
        user_items : SciPy sparse (U, n) or (rows, items, counts), optional
            The users' interactions, as :meth:`recalculate_user` takes them: rows are the
            positions 0..U-1 in `users` (row r for ``users[r]``, not user ids) and items are
            dense indices (rows of ``item_factors_``, :meth:`item_indices` maps own ids), not
            own ids.
        recalculate_user : bool
            Fold the users in from `user_items` (:meth:`recalculate_user`) instead of using
            their fitted factors.

        Returns own item ids; places left when fewer than k candidates remain are id -1 (None
        where the ids are text) with score -inf.
        """
        self._check_fitted()
        ids = self._ids
        users = np.atleast_1d(np.asarray(users))  # with recalculate_user, only their number counts
        users = np.arange(len(users)) if recalculate_user else ids.users(users)
        top, scores = self.recommend_indices(
            users, k, filter_already_liked_items=filter_already_liked_items,
            items=None if items is None else ids.items(items), user_items=user_items,
            recalculate_user=recalculate_user, store=store, batch=batch,
        )  # fmt: skip
        if not recalculate_user:
            self._warn_cold(users)
        return ids.item_ids(top), scores

    def recommend_indices(  # type: ignore[override]
        self,
        users: Any,
        k: int = 10,
        *,
        filter_already_liked_items: bool = True,
        items: Any = None,
        user_items: Any = None,
        recalculate_user: bool = False,
        store: RatingsStore | str | None = None,
        batch: int = 4096,
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`recommend` in dense indices: users (rows of ``user_factors_``), candidate
        items and the returned items (rows of ``item_factors_``, -1 for an empty place)."""
        self._check_fitted()
        n_items = self.item_factors_.shape[0]
        k = self._top_k(k, n_items)
        check_number("batch", batch, 1, integer=True)
        users = self._as_indices(users, "user")
        candidates = None if items is None else np.unique(self._as_indices(items, "item"))
        none = np.zeros(0, np.int64)
        self._check_indices(none if recalculate_user else users,
                            none if candidates is None else candidates)  # fmt: skip
        given = None
        if user_items is not None:
            given = interactions_block(user_items, len(users), n_items)
        if recalculate_user:
            if given is None:
                raise ConfigError("recommend(recalculate_user=True) needs user_items")
            X = self._fold_in(given, batch)
        else:
            X = self.user_factors_[users]
        chunks = [(lo, min(lo + batch, len(users))) for lo in range(0, len(users), batch)]
        if filter_already_liked_items and given is None and chunks:
            store = self._seen_store(store)
        batches = []
        for lo, hi in chunks:
            seen: Any = None
            if filter_already_liked_items and given is not None:
                from ..blocks import take_rows

                seen = take_rows(given, np.arange(lo, hi))
            elif filter_already_liked_items:
                seen = (store, users[lo:hi])
            batches.append((X[lo:hi], k, seen, candidates))
        width = min(k, n_items if candidates is None else len(candidates))
        if not batches:
            return np.zeros((0, width), np.int64), np.zeros((0, width), np.float32)
        results = self._run(tasks.rank_batch, [self.item_factors_], batches, "recommend")
        return np.concatenate([r[0] for r in results]), np.concatenate([r[1] for r in results])

    def _similar(self, factors: np.ndarray, query: np.ndarray, k: int, batch: int, name: str):
        noun = name.removeprefix("similar-")  # "items" or "users"
        k = self._top_k(k, len(factors), noun, per=noun[:-1])
        check_number("batch", batch, 1, integer=True)
        norms = np.linalg.norm(factors, axis=1, keepdims=True)
        normed = (factors / np.where(norms > 0, norms, 1e-10)).astype(np.float32)
        batches = [
            (normed[query[lo : lo + batch]], k, None, None) for lo in range(0, len(query), batch)
        ]
        if not batches:
            width = min(k, len(factors))
            return np.zeros((0, width), np.int64), np.zeros((0, width), np.float32)
        results = self._run(tasks.rank_batch, [normed], batches, name)
        return np.concatenate([r[0] for r in results]), np.concatenate([r[1] for r in results])

    def similar_items(
        self, items: Any, k: int = 10, *, batch: int = 4096
    ) -> tuple[np.ndarray, np.ndarray]:
        """The k items most similar to each given item by cosine of their factors, best
        first; the item itself comes first (score 1), as in implicit, but for an item with a
        zero factor (no interactions), whose scores are all 0 (it has no direction)."""
        ids = self._ids
        top, score = self._similar(self.item_factors_, ids.items(items), k, batch, "similar-items")
        return ids.item_ids(top), score

    def similar_users(
        self, users: Any, k: int = 10, *, batch: int = 4096
    ) -> tuple[np.ndarray, np.ndarray]:
        """The k users most similar to each given user by cosine of their factors, best
        first: itself first (score 1), but for a user with a zero factor (no interactions),
        whose scores are all 0."""
        ids = self._ids
        top, score = self._similar(self.user_factors_, ids.users(users), k, batch, "similar-users")
        return ids.user_ids(top), score
