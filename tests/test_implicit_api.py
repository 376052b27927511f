"""ImplicitALS as users of implicit use it: recommend (liked items filtered, candidate subsets),
similar items and users, folding in new users, save/load and pickling, batches on the
workers; own ids in and out (both estimators' id maps); the ranking metrics (of either
estimator) and the split by user; the CLI with count data."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import random_ratings
from reference import implicit_half_step

from cumf_dask.cli import main
from cumf_dask.data.spill import build_store
from cumf_dask.errors import ConfigError, CumfWarning, StoreError
from cumf_dask.evaluate import ranking_metrics
from cumf_dask.ids import IdMap
from cumf_dask.implicit import ImplicitALS, ranking_metrics_at_k, train_test_split
from cumf_dask.implicit.metrics import _metrics
from cumf_dask.model import ALS

M, N, F = 70, 45, 5


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, clients):
    """A model fitted on a store with held-out pairs, its client still open (a session)."""
    rows, cols, vals = random_ratings(M, N, 0.15, seed=41, empty_cols=[3])
    vals = np.round(vals)
    path = tmp_path_factory.mktemp("implicit-api") / "c.zarr"
    store = build_store(str(path), rows, cols, vals, shape=(M, N), test_fraction=0.2,
                        split_seed=1)  # fmt: skip
    model = ImplicitALS(F, 0.05, 2.0, 4, backend="numpy").fit(store, client=clients(2))
    return model, store


def _liked(store, user):
    _, cols, _ = store.read_coo("row", (user, user + 1))
    return set(cols.tolist())


def test_recommend_filters_liked_items_and_ranks_by_score(fitted):
    model, store = fitted
    users = np.array([0, 5, 9])
    top, scores = model.recommend(users, k=6)
    assert top.shape == scores.shape == (3, 6)
    for row, u in enumerate(users):
        full = model.item_factors_ @ model.user_factors_[u]
        liked = _liked(store, u)
        assert not set(top[row]) & liked
        allowed = [i for i in np.argsort(-full, kind="stable") if i not in liked]
        np.testing.assert_array_equal(top[row], allowed[:6])
        np.testing.assert_allclose(scores[row], full[top[row]], rtol=1e-5)
    unfiltered, _ = model.recommend(users, k=6, filter_already_liked_items=False)
    np.testing.assert_array_equal(
        unfiltered[0], np.argsort(-(model.item_factors_ @ model.user_factors_[0]))[:6]
    )


def test_recommend_among_candidates_pads_with_minus_one(fitted):
    model, store = fitted
    liked = sorted(_liked(store, 2))
    candidates = np.array([*liked[:2], 10, 20, 30])
    candidates = np.unique(candidates)
    top, scores = model.recommend([2], k=10, items=candidates)
    assert top.shape == (1, len(candidates))
    free = [i for i in candidates if i not in liked]
    assert set(top[0][: len(free)]) == set(free)
    assert (top[0][len(free) :] == -1).all() and np.isneginf(scores[0][len(free) :]).all()


def test_similar_items_and_users_are_cosine(fitted):
    model, _ = fitted
    for factors, method in ((model.item_factors_, model.similar_items),
                            (model.user_factors_, model.similar_users)):  # fmt: skip
        top, scores = method([1, 4], k=4)
        normed = factors / np.maximum(np.linalg.norm(factors, axis=1, keepdims=True), 1e-10)
        for row, q in enumerate([1, 4]):
            cos = normed @ normed[q]
            np.testing.assert_array_equal(top[row], np.argsort(-cos, kind="stable")[:4])
            assert top[row][0] == q and scores[row][0] == pytest.approx(1.0, abs=1e-5)
    _, scores = model.similar_items([3], k=2)  # an item without interactions: factor 0
    assert (scores == 0).all()  # so not itself first (the docstring's exception)


def test_recalculate_user_folds_in_without_refitting(fitted):
    model, store = fitted
    before = model.user_factors_.copy()
    r, c, v = store.read_coo("row", (7, 9))
    X = model.recalculate_user((r - 7, c, v))
    ref = implicit_half_step(r - 7, c, v, 2, model.item_factors_.astype(np.float64), 0.05, 2.0)
    np.testing.assert_allclose(X, ref, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(model.user_factors_, before)
    scipy = pytest.importorskip("scipy.sparse")
    matrix = scipy.csr_matrix((v, (r - 7, c)), shape=(2, N))
    np.testing.assert_allclose(model.recalculate_user(matrix), X, rtol=1e-6)
    halves = (np.repeat(r - 7, 2), np.repeat(c, 2), np.repeat(v / 2, 2))  # each pair twice:
    np.testing.assert_allclose(model.recalculate_user(halves), X, rtol=1e-5)  # counts summed
    for bad, message in ((([0], [1.7], [1.0]), "item indices must be .* integers"),
                         (([0, 1], [1], [1.0]), "1-d arrays of one length")):  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            model.recalculate_user(bad)
    top, _ = model.recommend(["new-a", "new-b"], k=3, user_items=matrix, recalculate_user=True)
    expect = np.argsort(-(X @ model.item_factors_.T), axis=1, kind="stable")
    for row in range(2):
        liked = set(c[r - 7 == row].tolist())
        np.testing.assert_array_equal(top[row], [i for i in expect[row] if i not in liked][:3])


def test_k_users_and_items_are_checked(fitted):
    """k an integer >= 1 (clamped to n with a note), indices in range, as ALS checks them."""
    model, _ = fitted
    for method in (model.recommend, model.similar_items, model.similar_users):
        for k in (0, -2, 2.5, True, "3"):
            with pytest.raises(ConfigError, match="'k' must be"):
                method([1], k=k)
    with pytest.warns(CumfWarning, match=f"more than the {N} items"):
        top, _ = model.recommend([1], k=N + 5, filter_already_liked_items=False)
    assert top.shape == (1, N)
    for users, items in (([-1], None), ([M], None), ([0], [-1, 3]), ([0], [N])):
        with pytest.raises(ConfigError, match="out of range"):
            model.recommend_indices(users, 3, items=items, filter_already_liked_items=False)


def test_methods_run_here_once_the_fit_client_is_closed():
    """After the client's `with` block the model uses its host copy (README)."""
    from distributed import Client, LocalCluster

    rows, cols, vals = random_ratings(30, 20, 0.3, seed=8)
    with LocalCluster(n_workers=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:  # fmt: skip
        model = ImplicitALS(3, 0.1, 1.0, 2, backend="numpy")
        model.fit((rows, cols, np.round(vals), (30, 20)), client=client)
        open_top = model.recommend([0, 1], k=3)
    np.testing.assert_array_equal(model.recommend([0, 1], k=3)[0], open_top[0])
    assert model.similar_items([2], k=2)[0].shape == (1, 2)
    assert model.recalculate_user(([0], [4], [1.0])).shape == (1, 3)


def test_batches_on_the_workers_match_local(fitted):
    model, _ = fitted
    assert model._session is not None
    local = pickle.loads(pickle.dumps(model))  # no cluster: computed in this process
    assert getattr(local, "_session", None) is None
    for method, args in (("recommend", ([1, 2, 3], 4)), ("similar_items", ([0, 8], 3))):
        a = getattr(model, method)(*args, batch=2)
        b = getattr(local, method)(*args)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_allclose(a[1], b[1], rtol=1e-6)


def test_save_load_and_names(fitted, tmp_path):
    model, store = fitted
    model.save(tmp_path / "m.zarr")
    loaded = ALS.load(tmp_path / "m.zarr")
    assert isinstance(loaded, ImplicitALS)
    assert (loaded.alpha, loaded.solver, loaded.regularization_mode) == (2.0, "cg", "plain")
    np.testing.assert_array_equal(loaded.user_factors, model.user_factors_)
    top, _ = loaded.recommend([3], k=4)  # liked items from the store the model names
    np.testing.assert_array_equal(top, model.recommend([3], k=4)[0])
    loaded.store_url_ = str(tmp_path / "moved.zarr")  # the training store moved or deleted
    with pytest.raises(StoreError, match=r"^the model's training store cannot be opened .* "
                       r"pass store= .* filter_already_liked_items=False"):  # fmt: skip
        loaded.recommend([3], k=4)
    assert "ImplicitALS(factors=5" in repr(loaded)
    assert {"loss", "objective"} <= set(model.metrics_[-1])
    explicit = ALS(3, 0.1, 1, backend="numpy").fit(store, client=model._session.client)
    explicit.save(tmp_path / "e.zarr")
    with pytest.raises(StoreError, match="explicit model"):
        ImplicitALS.load(tmp_path / "e.zarr")
    model.save(tmp_path / "e.zarr")  # a saved model of either kind is replaced (save's doc)
    assert isinstance(ImplicitALS.load(tmp_path / "e.zarr"), ImplicitALS)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="not a cumf-dask model"):
        model.save(tmp_path / "other")


def test_fit_takes_a_scipy_matrix_and_refuses_negative_counts(client2):
    scipy = pytest.importorskip("scipy.sparse")
    rows, cols, vals = random_ratings(30, 20, 0.3, seed=4)
    model = ImplicitALS(3, 0.1, 1.0, 2, backend="numpy")
    model.fit(scipy.coo_matrix((np.round(vals), (rows, cols)), shape=(30, 20)), client=client2)
    assert model.user_factors_.shape == (30, 3) and np.isfinite(model.user_factors_).all()
    with pytest.raises(ConfigError, match=r"^the data given to fit: .* counts >= 0") as err:
        ImplicitALS(3, backend="numpy").fit((rows, cols, vals - 3, (30, 20)))
    assert "cumf-fit" not in str(err.value)  # not the temporary store built from the arrays
    with pytest.raises(ConfigError, match="alpha"):
        ImplicitALS(3, alpha=-1, backend="numpy").fit((rows, cols, vals, (30, 20)))
    with pytest.raises(ConfigError, match="user id 30 is not in the model's user ids"):
        model.recommend([30])


# ----------------------------------------------------------------------------- own ids


def test_empty_places_are_none_with_text_ids(client2):
    """Ingest keeps text ids as NumPy's StringDType: an empty place is None, not "-1"."""
    users = np.array(["a"] * 5 + ["b"] * 2)
    items, counts = np.array(["x", "y", "z", "w", "v", "x", "y"]), np.arange(1, 8.0)
    implicit = ImplicitALS(2, iterations=2, backend="numpy").fit((users, items, counts),
                                                                 client=client2)  # fmt: skip
    explicit = ALS(2, iterations=2, backend="numpy").fit((users, items, counts), client=client2)
    for top in (implicit.recommend(["a", "b"], k=4)[0], explicit.recommend(["a", "b"], k=4)[0],
                implicit.recommend(["b"], k=3, items=["x", "z", "v"])[0]):  # fmt: skip
        assert top[0].tolist()[-1] is None and "-1" not in top.tolist()
    assert implicit.recommend(["b"], k=4)[0].tolist() == [["v", "w", "z", None]]


def test_an_unknown_id_error_names_the_id_that_is_not_there():
    """Ids that are the indices (a shape, a SciPy matrix): whole numbers of any type are
    indices, each id is checked on its own, and the error names one that is not there."""
    users = IdMap("user", None, 50)
    assert users.indices(np.array([1, 2], object)).tolist() == [1, 2]
    assert users.indices([4.0, np.int64(3)]).tolist() == [4, 3]
    cases = [([1, 2.5], "2.5"), ([3, 50], "50"), (np.array([1, "a"], object), "'a'"),
             (np.array([0, True], object), "True"), (np.array([2, None], object), "None")]
    for ids, bad in cases:
        with pytest.raises(ConfigError, match=f"^user id {bad} is not in"):
            users.indices(ids)


# ----------------------------------------------------------------------------- metrics


def _reference_metrics(X, Y, train, test, k, n_items):
    """Per user, implicit 0.7.3's formulas (ranking_metrics_at_k), but nneg without the
    filtered training items (nor the held-out ones that are not among them), plus the
    textbook precision and recall."""
    out = dict.fromkeys(("precision", "recall", "map", "ndcg", "auc"), 0.0)
    hits_all = capped_all = 0.0
    users = sorted({u for u, _ in test})
    for u in users:
        liked = {i for v, i in train if v == u}
        likes = {i for v, i in test if v == u}
        scores = Y @ X[u]
        ranked = [i for i in np.argsort(-scores, kind="stable") if i not in liked][:k]
        npos, nneg = len(likes), n_items - len(liked) - len(likes - liked)
        hit = miss = ap = dcg = auc = 0.0
        for pos, item in enumerate(ranked):
            if item in likes:
                hit += 1
                ap += hit / (pos + 1)
                dcg += 1 / np.log2(pos + 2)
            else:
                miss += 1
                auc += hit
        auc += (hit + npos) / 2 * (nneg - miss)
        idcg = sum(1 / np.log2(j + 2) for j in range(min(k, npos)))
        out["precision"] += hit / k
        out["recall"] += hit / npos
        out["map"] += ap / min(k, npos)
        out["ndcg"] += dcg / idcg
        out["auc"] += auc / (npos * nneg)
        hits_all += hit
        capped_all += min(k, npos)
    result = {f"{key}@{k}": value / len(users) for key, value in out.items()}
    result[f"capped_recall@{k}"] = hits_all / capped_all
    return result


def test_ranking_metrics_match_their_definitions(fitted):
    model, store = fitted
    k = 5
    train_r, train_c, _ = store.read_coo("row")
    test_r, test_c, _ = store.read_coo("row", split="test")
    got = ranking_metrics_at_k(model, store, k)
    ref = _reference_metrics(model.user_factors_, model.item_factors_,
                             list(zip(train_r, train_c, strict=True)),
                             list(zip(test_r, test_c, strict=True)), k, N)  # fmt: skip
    assert got["users"] == len(set(test_r.tolist()))
    for key, value in ref.items():
        assert got[key] == pytest.approx(value, rel=1e-9), key
    arrays = ranking_metrics_at_k(model, (test_r, test_c), k, train=(train_r, train_c))
    assert arrays == pytest.approx(got)
    # repeat plays: held-out items that are also training items (never ranked, but positives)
    rep_r, rep_c = np.r_[test_r, train_r[::3]], np.r_[test_c, train_c[::3]]
    ref = _reference_metrics(model.user_factors_, model.item_factors_,
                             list(zip(train_r, train_c, strict=True)),
                             list(zip(rep_r, rep_c, strict=True)), k, N)  # fmt: skip
    for train in ((train_r, train_c), None):  # given as arrays, or the model's store
        got = ranking_metrics_at_k(model, (rep_r, rep_c), k, train=train)
        assert 0 <= got[f"auc@{k}"] <= 1
        for key, value in ref.items():
            assert got[key] == pytest.approx(value, rel=1e-9), key


def test_ranking_metrics_take_the_data_own_ids(client2):
    """Arrays given to the metrics are in the ids the model was fitted with, like every
    other method's (mapped ids here, where dense indices would score other users)."""
    rows, cols, vals = random_ratings(60, 30, 0.25, seed=12)
    (tr, tc, tv), (sr, sc, _) = train_test_split(rows, cols, np.round(vals), 0.25, seed=2)
    seen = np.isin(sc, tc)  # held-out items the model knows
    users, items = tr * 7 + 1000, tc * 3 + 500  # own ids, not indices
    model = ImplicitALS(3, 0.1, 1.0, 3, backend="numpy").fit((users, items, tv), client=client2)
    got = ranking_metrics_at_k(model, (sr[seen] * 7 + 1000, sc[seen] * 3 + 500), 5,
                               train=(users, items))  # fmt: skip
    dense = (model.user_indices(users), model.item_indices(items))
    ref = _reference_metrics(model.user_factors_, model.item_factors_,
                             list(zip(*dense, strict=True)),
                             list(zip(model.user_indices(sr[seen] * 7 + 1000),
                                      model.item_indices(sc[seen] * 3 + 500), strict=True)),
                             5, model.item_factors_.shape[0])  # fmt: skip
    for key, value in ref.items():
        assert got[key] == pytest.approx(value, rel=1e-9), key
    with pytest.raises(ConfigError, match="not in the model's user ids"):
        ranking_metrics_at_k(model, (sr, sc), 5, train=(users, items))


def test_repeated_pairs_count_once(fitted):
    """Repeated lines of a log (the same held-out or training pair twice) change nothing."""
    model, store = fitted
    train_r, train_c, _ = store.read_coo("row")
    test_r, test_c, _ = store.read_coo("row", split="test")
    once = ranking_metrics_at_k(model, (test_r, test_c), 5, train=(train_r, train_c))
    twice = ranking_metrics_at_k(model, (np.repeat(test_r, 2), np.repeat(test_c, 2)), 5,
                                 train=(np.repeat(train_r, 2), np.repeat(train_c, 2)))  # fmt: skip
    assert twice == pytest.approx(once, rel=1e-12)


def test_ranking_metrics_of_either_estimator(fitted):
    """evaluate.ranking_metrics ranks both estimators (the implicit one's precision, recall and
    NDCG are ranking_metrics_at_k's); ranking_metrics_at_k refuses the explicit one, naming
    the function to use; both take a store's path."""
    model, store = fitted
    path = Path(store.url)
    at_k = ranking_metrics_at_k(model, store.url, 5)
    assert at_k == ranking_metrics_at_k(model, store, 5) == ranking_metrics_at_k(model, path, 5)
    got = ranking_metrics(model, store.url, k=5, max_users=None)
    for key in ("precision@5", "recall@5", "ndcg@5", "users"):
        assert got[key] == pytest.approx(at_k[key], rel=1e-9), key
    explicit = ALS(3, 0.1, 1, backend="numpy").fit(store, client=model._session.client)
    assert ranking_metrics(explicit, store.url, k=5) == ranking_metrics(explicit, store, k=5)
    with pytest.raises(ConfigError, match=r"got ALS: .* use cumf_dask\.evaluate\.ranking_metrics"):
        ranking_metrics_at_k(explicit, store, 5)


def test_ranking_metrics_clamp_k_to_the_items_and_check_arrays(fitted):
    """k above the n items is n, in the keys and "k" too (as evaluate.ranking_metrics);
    arrays of unequal lengths or with NaN counts are one clear error."""
    model, store = fitted
    got = ranking_metrics_at_k(model, store, N + 5)
    assert got == ranking_metrics_at_k(model, store, N) and got["k"] == N and f"auc@{N}" in got
    for name, bad, message in (("test", ([0, 1], [3]), "1-d arrays of one length"),
                               ("test", ([0, 1], [3, 3], [np.nan, 1]), "counts must be finite"),
                               ("test", ([0],), r"\(users, items\[, counts\]\)"),
                               ("train", ([0], [[3]]), "1-d arrays of one length")):  # fmt: skip
        args = {"test": bad} if name == "test" else {"test": ([0], [3]), "train": bad}
        with pytest.raises(ConfigError, match=f"^{name} .*{message}"):
            ranking_metrics_at_k(model, k=3, **args)


def test_auc_of_held_out_items_that_are_training_items():
    """Hand computed: 6 items, trained on 0 and 1, held out 1 (a repeat) and 2; ranked 3, 2.
    Pairs (positive, negative) over negatives 3, 4, 5: item 2 is below 3 and above 4 and 5
    (unranked); item 1, never ranked, is below 3 and halfway with 4 and 5: (0+1+1 + 0+.5+.5)/6."""
    got = _metrics(np.array([[3, 2]]), np.array([0, 0]), np.array([1, 2]), n_items=6,
                   n_train=np.array([2]), k=2, trained=np.array([True, False]))  # fmt: skip
    assert got["auc@2"] == pytest.approx(3 / 6) and got["recall@2"] == pytest.approx(1 / 2)
    # held out only a training item, every other item ranked above it: 0 (it was -1/6)
    repeat = _metrics(np.array([[1, 2, 3, 4]]), np.array([0]), np.array([0]), 5, np.array([1]),
                      4, trained=np.array([True]))  # fmt: skip
    assert repeat["auc@4"] == 0


def test_metrics_of_a_perfect_ranking():
    top = np.array([[3, 1, -1], [2, 0, 4]])
    pos, cols = np.array([0, 0, 1]), np.array([1, 3, 2])
    got = _metrics(top, pos, cols, n_items=5, n_train=np.array([0, 0]), k=3)
    assert got["capped_recall@3"] == 1 and got["ndcg@3"] == 1 and got["map@3"] == 1
    assert got["recall@3"] == 1 and got["precision@3"] == pytest.approx((2 / 3 + 1 / 3) / 2)
    twice = _metrics(top, np.repeat(pos, 2), np.repeat(cols, 2), 5, np.array([0, 0]), 3)
    assert twice == got  # a repeated held-out pair is one positive


def test_split_by_user_keeps_every_user_in_training(tmp_path):
    rows, cols, vals = random_ratings(60, 40, 0.1, seed=3, skew=0.9)
    (tr, tc, _), (sr, sc, _) = train_test_split(rows, cols, vals, 0.25, seed=7)
    assert set(tr.tolist()) == set(rows.tolist())  # every user keeps a training interaction
    n = np.bincount(rows, minlength=60)
    held = np.bincount(sr, minlength=60)
    np.testing.assert_array_equal(held, np.minimum(np.floor(0.25 * n + 0.5), np.maximum(n - 1, 0)))
    pairs = set(zip(rows.tolist(), cols.tolist(), strict=True))
    train = set(zip(tr.tolist(), tc.tolist(), strict=True))
    test = set(zip(sr.tolist(), sc.tolist(), strict=True))
    assert train | test == pairs and not train & test
    order = np.random.default_rng(0).permutation(rows.size)  # the input order does not matter
    again = train_test_split(rows[order], cols[order], vals[order], 0.25, seed=7)[1]
    assert set(zip(again[0].tolist(), again[1].tolist(), strict=True)) == test
    store = build_store(str(tmp_path / "u.zarr"), rows[order], cols[order], vals[order],
                        shape=(60, 40), test_fraction=0.25, split_seed=7, split="users",
                        tile_rows=16)  # fmt: skip
    held_r, held_c, _ = store.read_coo("row", split="test")
    assert set(zip(held_r.tolist(), held_c.tolist(), strict=True)) == test  # the same pairs
    assert store.nnz == len(train) and store.nnz_test == len(test)


def test_split_keeps_ids_of_any_kind():
    """Text and fractional ids split by user as integers do, and come back as given."""
    users = np.repeat(np.array(["ann", "bob", "cy"], object), 4)
    items = np.tile(np.array([0.5, 1.5, 2.5, 3.5]), 3)
    (tr, tc, tv), (sr, sc, sv) = train_test_split(users, items, np.arange(12), 0.5, seed=3)
    assert tr.dtype == sr.dtype == object and tc.dtype == np.float64
    assert sorted(sr.tolist()) == ["ann", "ann", "bob", "bob", "cy", "cy"]
    for u, i, v in zip([*tr, *sr], [*tc, *sc], [*tv, *sv], strict=True):
        assert (users[v], items[v]) == (u, i)  # each pair with its value, ids as given
    order = np.arange(12)[::-1]  # the input order and the ids' array type do not matter
    again = train_test_split(users[order].astype(str), items[order], order, 0.5, seed=3)[1]
    assert sorted(again[2].tolist()) == sorted(sv.tolist())
    whole = train_test_split([0.0, 0.0, 1.0, 1.0], [0, 1, 0, 1], np.arange(4), 0.5)[1]
    ints = train_test_split([0, 0, 1, 1], [0, 1, 0, 1], np.arange(4), 0.5)[1]
    assert whole[2].tolist() == ints[2].tolist()  # whole-number floats split as integers
    with pytest.raises(ConfigError, match="one length"):
        train_test_split([1, 2], [1], [1, 1])

# ----------------------------------------------------------------------------- CLI

CONFIG = """\
data:
  source: ingest
  store: data/counts.zarr
  test_fraction: 0.2
  split: users
  ingest:
    path: plays.csv
    duplicates: sum
model:
  kind: implicit
  factors: 4
  regularization: 0.05
  alpha: 3.0
  iterations: 2
  solver: cg
cluster:
  n_workers: 1
  dashboard_address: null
output:
  name: plays
"""


def test_cli_trains_evaluates_and_recommends_on_counts(tmp_path, capsys, monkeypatch):
    """Repeated (user, item) plays are summed at ingest; the model trains (in a subprocess: it
    starts its own cluster), evaluates and recommends in the user's own ids."""
    rng = np.random.default_rng(0)
    plays = rng.integers(0, [60, 25], size=(1500, 2))  # repeats: summed to counts
    (tmp_path / "plays.csv").write_text(
        "user,item,plays\n" + "\n".join(f"u{u},song {i},1" for u, i in plays) + "\n"
    )
    (tmp_path / "plays.yaml").write_text(CONFIG)

    def cli(*args):
        if args[0] == "train":
            command = [sys.executable, "-m", "cumf_dask", *args, "--json"]
            proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True,
                                  timeout=180)  # fmt: skip
            assert proc.returncode == 0, proc.stderr
            return json.loads(proc.stdout)
        capsys.readouterr()
        assert main([*args, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    monkeypatch.chdir(tmp_path)
    summary = cli("train", "plays.yaml")
    assert summary["kind"] == "implicit" and summary["loss"] > 0
    model = summary["model"]
    metrics = cli("evaluate", model, "data/counts.zarr", "-k", "5")
    assert {"precision@5", "recall@5", "map@5", "ndcg@5", "auc@5"} <= set(metrics)
    top = cli("recommend", model, "--user", "u7", "-k", "3")
    assert len(top["items"]) == 3 and all(i.startswith("song ") for i in top["items"])
    from cumf_dask.data.store import RatingsStore

    store = RatingsStore.open(str(tmp_path / "data" / "counts.zarr"))
    total = store.nnz + store.nnz_test
    assert total == len({tuple(p) for p in plays.tolist()}) and store.stats["max"] > 1
    assert (store.counts("row") > 0).all()  # split by user: everyone keeps training plays


def test_held_out_counts_of_zero_are_not_relevant_in_either_metric(tmp_path, client2):
    """A count of 0 is no preference (p = 0): evaluate.ranking_metrics scored it as relevant
    for an ImplicitALS, and so ranked other users, with other numbers, than
    ranking_metrics_at_k on the same model."""
    rng = np.random.default_rng(1)
    users = np.repeat(np.arange(20), 6)
    items = np.concatenate([rng.choice(15, 6, replace=False) for _ in range(20)])
    counts = rng.integers(0, 3, users.size).astype(float)  # a third are 0
    store = build_store(str(tmp_path / "z.zarr"), users, items, counts, shape=(20, 15),
                        test_fraction=0.3, split="users")  # fmt: skip
    assert (store.read_coo("row", split="test")[2] == 0).any()
    model = ImplicitALS(3, 0.1, 1.0, 3, backend="numpy").fit(store, client=client2)
    ours, theirs = ranking_metrics(model, store, 5), ranking_metrics_at_k(model, store, 5)
    for key in ("precision@5", "recall@5", "ndcg@5", "users"):
        assert ours[key] == pytest.approx(theirs[key]), key
        assert type(ours[key]) in (float, int)


def test_bad_implicit_inputs_are_one_clear_error(tmp_path, client2):
    """Pairs given twice to the split (a test pair would leak into training), counts all 0
    (nothing to learn: all-zero factors that rank at random), a held-out item the model
    never saw, and metrics without a training store: each one error naming the fix."""
    with pytest.raises(ConfigError, match=r"given more than once .* sum their counts first"):
        train_test_split(np.array([0, 0, 0, 0]), np.array([5, 5, 1, 2]), np.ones(4), 0.5)
    zeros = (np.array([0, 1, 2]), np.array([0, 1, 2]), np.zeros(3), (3, 3))
    with pytest.raises(ConfigError, match="needs some positive counts, and every one of its 3"):
        ImplicitALS(2, backend="numpy").fit(zeros, client=client2)
    users, items = np.array(["a", "a", "b", "b"]), np.array(["x", "y", "x", "w"])
    model = ImplicitALS(2, iterations=1, backend="numpy").fit((users, items, np.ones(4)),
                                                              client=client2)  # fmt: skip
    with pytest.raises(ConfigError, match=r"'z' .*leave such pairs out of test, or fit with a "
                       "shape"):  # fmt: skip
        ranking_metrics_at_k(model, (np.array(["a"]), np.array(["z"])), 2,
                             train=(users, items))  # fmt: skip
    model.save(tmp_path / "arrays.zarr")  # loaded, it names no training store
    with pytest.raises(ConfigError, match=r"names no training store.*pass train="):
        ranking_metrics_at_k(ALS.load(tmp_path / "arrays.zarr"),
                             (np.array(["a"]), np.array(["w"])), 2)  # fmt: skip
