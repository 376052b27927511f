"""Ranking metrics on held-out ratings: precision, recall and NDCG at k."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from .checks import check_number
from .data.store import RatingsStore
from .errors import ConfigError, StoreError

if TYPE_CHECKING:
    from .model import ALS


def ranking_metrics(
    model: ALS,
    store: RatingsStore | str | os.PathLike,
    k: int = 10,
    threshold: float | None = None,
    max_users: int | None = 10_000,
    seed: int = 0,
) -> dict[str, float]:
    """precision@k, recall@k, ndcg@k over users with held-out ratings, and k and users.

    `model`: an ALS or an ImplicitALS (whose own metrics, MAP and AUC too, are
    :func:`cumf_dask.implicit.ranking_metrics_at_k`); `store`: the model's store or its path.
    Relevant items are a user's held-out items (rated >= `threshold` when given; for an
    ImplicitALS, those of a positive count: a count of 0 is no preference); training items
    are excluded from the recommendations. At most `max_users` users (a seeded sample).
    `k` must be an integer >= 1; above the number of items n it is clamped to n (the keys and
    ``"k"`` say the k used). A user with fewer than k unseen items is scored on the ones there
    are (the places left count as misses), so no metric is ever NaN.
    """
    k = int(k) if isinstance(k, np.integer) else k
    check_number("k", k, 1, integer=True)
    if max_users is not None:
        check_number("max_users", max_users, 1, integer=True)
    model._check_fitted()
    k = min(k, model.item_factors_.shape[0])
    store = model._matching(os.fspath(store) if isinstance(store, os.PathLike) else store)
    if not store.has_test:
        raise StoreError(
            f"{store.url}: the store has no held-out ratings; ingest or generate it with a "
            "test fraction (--test-fraction) to compute ranking metrics"
        )
    rows, cols, vals = store.read_coo("row", split="test")
    implicit = getattr(model, "implicit", False)
    if threshold is not None:
        keep = vals >= threshold
        if not keep.any():
            top = float(vals.max())
            raise ConfigError(
                f"threshold {threshold:g}: no held-out rating is that high (the highest is "
                f"{top:g}); give a threshold of at most {top:g}, or leave it out"
            )
        rows, cols = rows[keep], cols[keep]
    elif implicit:  # p = 0 for a count of 0: not an item the user is known to like
        keep = vals > 0
        if not keep.any():
            raise StoreError(f"{store.url}: no held-out count is positive, so no item is "
                             "relevant to rank; hold out interactions of counts above 0")
        rows, cols = rows[keep], cols[keep]
    users = np.unique(rows)
    if max_users is not None and users.size > max_users:
        users = np.sort(np.random.default_rng(seed).choice(users, max_users, replace=False))
    order = np.argsort(rows, kind="stable")
    rows, cols = rows[order], cols[order]
    starts = np.searchsorted(rows, users)
    ends = np.searchsorted(rows, users, side="right")
    if implicit:  # ImplicitALS names the option as implicit does
        top, _ = model.recommend_indices(users, k, filter_already_liked_items=True, store=store)
    else:
        top, _ = model.recommend_indices(users, k=k, exclude_seen=True, store=store)
    discounts = 1.0 / np.log2(np.arange(2, k + 2))
    precision = recall = ndcg = 0.0
    for pos in range(users.size):
        relevant = cols[starts[pos] : ends[pos]]
        hits = np.isin(top[pos], relevant)
        precision += hits.sum() / k
        recall += hits.sum() / relevant.size
        ideal = discounts[: min(relevant.size, k)].sum()
        ndcg += (discounts[: hits.size] * hits).sum() / ideal
    count = users.size
    return {
        f"precision@{k}": float(precision / count),
        f"recall@{k}": float(recall / count),
        f"ndcg@{k}": float(ndcg / count),
        "k": k,
        "users": int(count),
    }
