"""Ranking metrics at k on held-out interactions, and a train/test split by user.

Definitions (per user u with at least one held-out positive; npos = |test_u|, the top k
ranked among the items u has no training interaction with; means over those users):

* ``precision@k`` = hits / k, ``recall@k`` = hits / npos: the textbook ones.
* ``capped_recall@k`` = sum_u hits / sum_u min(k, npos): what implicit 0.7.3 calls
  "precision" (micro-averaged, its denominator capped at npos, so it is a recall that a
  perfect ranking brings to 1). Reported under its own name for comparisons with implicit;
  precision here is the textbook one, which does not reward users with few positives more.
* ``map@k``: sum over hit ranks i (0-based) of hits-so-far / (i + 1), divided by min(k, npos)
  (implicit's).
* ``ndcg@k``: binary gains, DCG = sum over hits of 1 / log2(i + 2), divided by the ideal DCG of
  min(k, npos) hits (implicit's).
* ``auc@k``: implicit's k-limited AUC: the negatives ranked below each hit in the top k, the
  negatives outside the top k counted as ranked halfway: ``(sum over misses of the hits
  before them + (hits + npos) / 2 * (nneg - misses)) / (npos nneg)``; but nneg counts only
  the negatives that could be ranked (n minus u's training items minus the held-out items
  that are not training items), where implicit also counts the training items it filtered
  out of the ranking. A held-out item that is also a training item (a repeat play) is one of
  the npos positives, as in implicit, that the ranking can never hit: it ranks below every
  ranked negative and halfway among the others.

``k`` above the number of items n is clamped to n (the keys and ``"k"`` say the k used), as
:func:`cumf_dask.evaluate.ranking_metrics` does.

The split (:func:`train_test_split`) holds out, for each user, ``round(test_fraction * n_u)``
of their interactions but never all of them, so every user keeps at least one training
interaction (implicit's own ``train_test_split`` draws each pair independently, so a user can
end up with none). Which ones is decided by a hash of (user, item, seed): deterministic,
independent of the input order (:func:`cumf_dask.data.hashing.user_split_mask`; for data whose
ids are the indices 0, 1, ..., stores built with ``split="users"``, config ``data.split:
users``, hold out the same pairs). Whole-number ids are hashed as they are; any other ids
(text, fractions) by a hash of their value, so they split too, and come back as given.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..checks import check_columns_match, check_fraction, check_positive_int
from ..data.hashing import user_split_mask
from ..data.store import RatingsStore
from ..errors import ConfigError, StoreError
from .model import ImplicitALS

Triple = tuple[np.ndarray, np.ndarray, np.ndarray]


def train_test_split(
    rows: Any, cols: Any, values: Any, test_fraction: float = 0.2, seed: int = 0
) -> tuple[Triple, Triple]:
    """((rows, cols, values) for training, the same held out): per user, round(test_fraction
    n_u) interactions held out, at most n_u - 1 (see the module doc). Ids of any kind (numbers,
    text) come back as given. Each (user, item) once: a pair given twice could land on both
    sides, its held-out interaction then also a training one, so that is refused."""
    check_fraction("test_fraction", test_fraction)
    rows, cols, values = np.asarray(rows), np.asarray(cols), np.asarray(values)
    check_columns_match("train_test_split", "rows, cols and values", rows, cols, values)
    users, items = _split_keys(rows), _split_keys(cols)
    repeated = len(np.unique(np.stack([users, items], axis=1), axis=0)) < len(users)
    if repeated:
        raise ConfigError(
            "train_test_split: some (user, item) pairs are given more than once (a log's "
            "repeated lines): sum their counts first, e.g. with pandas: "
            "df.groupby(['user', 'item'], as_index=False)['count'].sum()"
        )
    test = user_split_mask(users, items, test_fraction, seed)
    train = ~test
    return (rows[train], cols[train], values[train]), (rows[test], cols[test], values[test])


def _split_keys(ids: np.ndarray) -> np.ndarray:
    """The int64 keys the split hashes: whole-number ids themselves (so they split as the same
    integers do), any other ids (text, fractions) pandas' stable hash of each value."""
    if ids.dtype == object:
        ids = np.asarray(ids.tolist())  # Python ints as int64, texts as text
    if ids.dtype.kind in "iu":
        return ids.astype(np.int64)
    if ids.dtype.kind == "f" and (ids == np.floor(ids)).all() and (abs(ids) < 2.0**63).all():
        return ids.astype(np.int64)
    import pandas as pd

    return pd.util.hash_array(ids).view(np.int64)


def ranking_metrics_at_k(
    model: ImplicitALS,
    test: RatingsStore | str | os.PathLike | tuple,
    k: int = 10,
    *,
    train: RatingsStore | str | os.PathLike | tuple | None = None,
    batch: int = 4096,
) -> dict[str, float]:
    """precision, recall, capped_recall, map, ndcg and auc at k (module doc) of a fitted
    ImplicitALS (an explicit ALS: :func:`cumf_dask.evaluate.ranking_metrics`), and k (clamped
    to the number of items) and users.

    Parameters
    ----------
    test : RatingsStore or its path (its held-out split), or (users, items[, counts]) arrays
        Held-out interactions; those with a count <= 0 are not positives, and a pair given
        more than once (repeated lines of a log) is one positive. Arrays are in the data's
        own ids, as the model's methods take them (the indices themselves when the model was
        fitted with a shape or a SciPy matrix); an id the model does not know is a
        ConfigError.
    train : RatingsStore or its path, or (users, items[, counts]) arrays in own ids, optional
        The training interactions, filtered out of each user's ranking: by default the
        store the model was fitted on (a store given as `test`: its training split).
    """
    check_positive_int("k", k)
    if not isinstance(model, ImplicitALS):
        raise ConfigError(
            f"ranking_metrics_at_k scores an ImplicitALS, got {type(model).__name__}: for the "
            "explicit ALS use cumf_dask.evaluate.ranking_metrics(model, store, k)"
        )
    model._check_fitted()
    n_items = model.item_factors_.shape[0]
    k = min(k, n_items)
    ids = model._ids
    test, train = _opened(test), _opened(train)
    if isinstance(test, RatingsStore):
        model._matching(test)
        if not test.has_test:
            raise StoreError(
                f"{test.url}: the store has no held-out interactions; build it with a test "
                "fraction, or pass test=(rows, items) arrays"
            )
        t_rows, t_cols, t_vals = test.read_coo("row", split="test")
        train = test if train is None else train
    else:
        t_users, t_items, t_vals = _arrays("test", test)
        try:
            t_rows, t_cols = ids.users(t_users), ids.items(t_items)
        except ConfigError as exc:  # with own ids a model knows only its training data's
            raise ConfigError(
                f"{exc}; a held-out interaction of a user or item the training data does not "
                "have (train_test_split can hold out every interaction of an item) cannot be "
                "ranked: leave such pairs out of test, or fit with a shape (ids as indices)"
            ) from None
    keep = t_vals > 0
    t_rows, t_cols = t_rows[keep], t_cols[keep]
    users, pos = np.unique(t_rows, return_inverse=True)
    if users.size == 0:
        raise StoreError("no held-out positive interactions to rank")
    held_out = pos * np.int64(n_items) + t_cols  # (user position, item) keys
    if train is not None and not isinstance(train, RatingsStore):
        r_users, r_items, _ = _arrays("train", train)
        r, c = ids.users(r_users), ids.items(r_items)
        at = np.clip(np.searchsorted(users, r), 0, users.size - 1)
        mine = users[at] == r
        pairs = np.unique(at[mine] * np.int64(n_items) + c[mine])  # a repeated pair counts once
        trained = np.isin(held_out, pairs)
        at, c = pairs // n_items, pairs % n_items
        user_items = (at, c, np.ones(at.size, np.float32))
        n_train = np.bincount(at, minlength=users.size)
        top, _ = model.recommend_indices(users, k, user_items=user_items, batch=batch)
    else:
        if train is None and getattr(model, "_store", None) is None and not model.store_url_:
            raise ConfigError("the model names no training store, whose items are left out of "
                              "the rankings: pass train= (the training store, or (users, "
                              "items) arrays of the training interactions)")  # fmt: skip
        store = model._seen_store(train)
        n_train = store.counts("row")[users]
        # a store holds each pair once: its held-out pairs are never its training pairs
        trained = None if store is test else _trained(store, users, held_out, n_items, batch)
        top, _ = model.recommend_indices(users, k, store=store, batch=batch)
    return _metrics(top, pos, t_cols, n_items, n_train, k, trained)


def _opened(data: Any) -> Any:
    """The store a path names, opened; anything else as it is."""
    return RatingsStore.open(os.fspath(data)) if isinstance(data, (str, os.PathLike)) else data


def _arrays(name: str, data: Any) -> Triple:
    """(users, items, counts) of the `test` or `train` arrays (counts 1 when not given),
    checked: 1-d of one length, counts finite (a NaN would silently drop a pair)."""
    if not isinstance(data, (tuple, list)) or len(data) not in (2, 3):
        raise ConfigError(
            f"{name} must be a RatingsStore, its path, or (users, items[, counts]) arrays"
        )
    users, items = np.asarray(data[0]), np.asarray(data[1])
    counts = np.asarray(data[2], np.float64) if len(data) == 3 else np.ones(users.shape)
    check_columns_match(name, "users, items and counts", users, items, counts)
    if not np.isfinite(counts).all():
        raise ConfigError(f"{name} counts must be finite")
    return users, items, counts


def _trained(
    store: RatingsStore, users: np.ndarray, held_out: np.ndarray, n_items: int, batch: int
) -> np.ndarray:
    """Which `held_out` (user position, item) keys are also training pairs in `store`, read
    `batch` users at a time."""
    found = np.zeros(held_out.size, bool)
    for lo in range(0, users.size, batch):
        block = store.rows_block(users[lo : lo + batch])
        rows = np.repeat(np.arange(lo, lo + block.n_rows), np.diff(block.indptr))
        found |= np.isin(held_out, rows * np.int64(n_items) + block.indices)
    return found


def _metrics(
    top: np.ndarray,
    pos: np.ndarray,
    cols: np.ndarray,
    n_items: int,
    n_train: np.ndarray,
    k: int,
    trained: np.ndarray | None = None,
) -> dict[str, float]:
    """The module doc's metrics from each user's top (U, k) (-1: no item) and the held-out
    (user position, item) pairs, a repeated pair counted once; `n_train`: each user's
    training items (filtered out of the ranking), `trained`: which held-out pairs are also
    training pairs (default: none)."""
    n_users, width = top.shape
    truth, first = np.unique(pos * np.int64(n_items) + cols, return_index=True)
    npos = np.bincount(truth // n_items, minlength=n_users).astype(np.float64)
    rankable = npos
    if trained is not None:  # positives that are training items cannot be ranked
        rankable = npos - np.bincount(truth[trained[first]] // n_items, minlength=n_users)
    valid = top >= 0
    hits = valid & np.isin(np.arange(n_users)[:, None] * np.int64(n_items) + top, truth)
    found = hits.sum(axis=1)
    capped = np.minimum(k, npos)
    before = np.cumsum(hits, axis=1)
    ranks = np.arange(1, width + 1)
    gains = 1.0 / np.log2(ranks + 1)
    ideal = np.cumsum(1.0 / np.log2(np.arange(2, k + 2)))[capped.astype(np.int64) - 1]
    misses = valid & ~hits
    nneg = np.maximum(n_items - n_train - rankable, 1)  # 1: no negative left to rank
    auc = (np.where(misses, before, 0).sum(axis=1)
           + (found + npos) / 2 * (nneg - misses.sum(axis=1))) / (npos * nneg)  # fmt: skip
    return {
        f"precision@{k}": float(np.mean(found / k)),
        f"recall@{k}": float(np.mean(found / npos)),
        f"capped_recall@{k}": float(found.sum() / capped.sum()),
        f"map@{k}": float(np.mean((hits * before / ranks).sum(axis=1) / capped)),
        f"ndcg@{k}": float(np.mean((hits * gains).sum(axis=1) / ideal)),
        f"auc@{k}": float(np.mean(auc)),
        "k": k,
        "users": int(n_users),
    }
