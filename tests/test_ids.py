"""The estimator speaks the data's own ids: fit on any input, recommend/predict in ids,
dense-index methods by name, maps kept through save and load."""

from __future__ import annotations

import dask.array as dsa
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

from cumf_dask.errors import ConfigError, IngestError
from cumf_dask.model import ALS

M, N, K = 60, 25, 600


@pytest.fixture
def client(client2):
    return client2


def ratings(kind: str, seed: int = 0):
    """K distinct (user, item, rating) triples in ids of `kind`, users in scrambled order."""
    rng = np.random.default_rng(seed)
    flat = rng.choice(M * N, K, replace=False)
    rows, cols = flat // N, flat % N
    vals = rng.integers(1, 6, K).astype(np.float64)
    if kind == "str":
        return (np.array([f"user-{r}" for r in rows], object),
                np.array([f"film {c}" for c in cols], object), vals)  # fmt: skip
    return 10**9 + rows * 7919, 5000 - cols, vals  # sparse integers, not 0-based


def seen_by(users, items, user):
    return set(items[users == user].tolist())


@pytest.mark.parametrize("kind", ["str", "int"])
def test_ids_round_trip_through_fit_recommend_save_load(kind, client, tmp_path):
    users, items, vals = ratings(kind)
    model = ALS(4, 0.1, 3, backend="numpy").fit((users, items, vals), client=client)
    assert model.user_ids_.tolist() == list(dict.fromkeys(users.tolist()))  # first appearance
    assert model.item_ids_.tolist() == list(dict.fromkeys(items.tolist()))
    if kind == "int":
        assert model.user_ids_.dtype == np.int64
    who = users[[0, 5]]
    top, scores = model.recommend(who, k=4)
    assert top.shape == scores.shape == (2, 4)
    assert set(top.ravel().tolist()) <= set(items.tolist())  # the data's own item ids
    assert not set(top[0].tolist()) & seen_by(users, items, who[0])  # seen items excluded
    rows, cols = model.user_indices(who), model.item_indices(top[0])
    dense_top, dense_scores = model.recommend_indices(rows, k=4)
    assert model.item_ids_[dense_top].tolist() == top.tolist()
    np.testing.assert_array_equal(dense_scores, scores)
    np.testing.assert_allclose(
        model.predict([who[0]] * 4, top[0]), model.predict_indices([rows[0]] * 4, cols)
    )
    np.testing.assert_allclose(model.predict([who[0]] * 4, top[0]), scores[0], rtol=1e-5)
    assert model.rmse((users, items, vals)) == pytest.approx(model.metrics_[-1]["train_rmse"])

    model.save(tmp_path / "m.zarr")
    loaded = ALS.load(tmp_path / "m.zarr")
    assert loaded.user_ids_.tolist() == model.user_ids_.tolist()
    assert loaded.item_ids_.tolist() == model.item_ids_.tolist()
    again, _ = loaded.recommend(who, k=4, exclude_seen=False)
    assert again.tolist() == model.recommend(who, k=4, exclude_seen=False)[0].tolist()
    loaded.save(tmp_path / "m2.zarr")  # the maps survive a second save
    assert ALS.load(tmp_path / "m2.zarr").item_ids_.tolist() == model.item_ids_.tolist()
    missing = "nobody" if kind == "str" else 3
    with pytest.raises(ConfigError, match=f"user id {missing!r} is not in the model's user ids"):
        loaded.recommend([missing])
    assert "fitted 60 users x 25 items (own ids)" in repr(model)


def _frames(users, items, vals):
    df = pd.DataFrame({"user": users, "item": items, "rating": vals})
    rows = np.column_stack([users, items, vals]).astype(np.float64)
    return {
        "pandas": df,
        "pandas-3-columns": df.rename(columns={"user": "u", "item": "i", "rating": "r"}),
        "dask-dataframe": dd.from_pandas(df, npartitions=3),
        "numpy-rows": rows,
        "dask-array": dsa.from_array(rows, chunks=(128, 3)),
    }


@pytest.fixture(scope="module")
def reference(clients):
    """A model fitted on (users, items, ratings) arrays, and those arrays."""
    data = ratings("int", seed=2)
    return ALS(3, 0.1, 2, backend="numpy").fit(data, client=clients(2)), data


@pytest.mark.parametrize("kind", ["pandas", "pandas-3-columns", "dask-dataframe", "numpy-rows",
                                  "dask-array"])  # fmt: skip
def test_fit_takes_frames_and_arrays(kind, client, reference):
    """Every input is the same ratings in the same order: the same ids, the same model."""
    reference, (users, items, vals) = reference
    model = ALS(3, 0.1, 2, backend="numpy").fit(_frames(users, items, vals)[kind], client=client)
    assert model.user_ids_.tolist() == reference.user_ids_.tolist()  # float ids read as ints
    assert model.user_ids_.dtype == np.int64 and model.item_ids_.dtype == np.int64
    np.testing.assert_allclose(model.user_factors_, reference.user_factors_, rtol=1e-5, atol=1e-6)


def test_fit_takes_a_scipy_matrix_as_indices(client):
    matrix = sp.random(M, N, density=0.3, format="csr", random_state=3,
                       data_rvs=lambda k: np.arange(1, k + 1) % 5 + 1.0)  # fmt: skip
    model = ALS(3, 0.1, 2, backend="numpy").fit(matrix, client=client)
    assert model.user_ids_ is None and model.shape_ == (M, N)
    coo = matrix.tocoo()
    dense = ALS(3, 0.1, 2, backend="numpy").fit((*coo.coords, coo.data, (M, N)), client=client)
    np.testing.assert_allclose(model.user_factors_, dense.user_factors_, rtol=1e-5, atol=1e-6)
    top, _ = model.recommend([0, M - 1], k=3)  # ids are the indices
    assert top.tolist() == model.recommend_indices([0, M - 1], k=3)[0].tolist()
    with pytest.raises(ConfigError, match=r"user id 60 is not .* \(ids are the indices 0\.\.59\)"):
        model.recommend([M])


def test_fractional_float_ids_are_refused_not_truncated(client):
    users, items, vals = ratings("int", seed=4)
    as_float = users.astype(np.float64)
    as_float[7] += 0.5
    with pytest.raises(IngestError, match=r"record 7: user id 1\d+\.5 is not a whole number"):
        ALS(2, 0.1, 1, backend="numpy").fit((as_float, items, vals), client=client)
    rows = np.column_stack([users, items, vals]).astype(np.float64)
    rows[3, 1] = 0.25
    with pytest.raises(IngestError, match=r"record 3: item id 0\.25 is not a whole number"):
        ALS(2, 0.1, 1, backend="numpy").fit(dsa.from_array(rows, chunks=(100, 3)), client=client)


def test_unknown_inputs_are_refused():
    with pytest.raises(ConfigError, match=r"needs columns user, item, rating .* it has a, b"):
        ALS(2).fit(pd.DataFrame({"a": [1], "b": [2]}))
    with pytest.raises(ConfigError, match=r"shape \(nnz, 3\), got \(4, 2\)"):
        ALS(2).fit(np.ones((4, 2)))
    with pytest.raises(ConfigError, match="fit\\(\\) takes a RatingsStore"):
        ALS(2).fit({"user": [1]})
    with pytest.raises(ConfigError, match=r"^shape must be \(m, n\).* got \(2,\)"):
        ALS(2).fit(([0, 1], [0, 1], [1.0, 2.0], (2,)))
