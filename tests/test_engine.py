"""Every plan (p, q, workers, tiles, reduction) gives the float64 reference's factors."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import BACKENDS, random_ratings, rel_err
from distributed import Client, LocalCluster
from reference import reference_als

from cumf_dask.config import HalfStepPlan, PlanConfig
from cumf_dask.data.spill import build_store
from cumf_dask.factors import init_factor
from cumf_dask.model import ALS

F, LAM, ITERS = 6, 0.05, 3
M, N = 90, 60


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda w: f"{w}workers")
def client(request):
    with (
        LocalCluster(
            n_workers=request.param,
            threads_per_worker=1,
            processes=False,
            dashboard_address=None,
        ) as cluster,
        Client(cluster) as c,
    ):
        yield c


@pytest.fixture(scope="module")
def ratings():
    return random_ratings(M, N, 0.12, seed=11, empty_rows=[0, 41], empty_cols=[7], skew=0.5)


@pytest.fixture(scope="module")
def reference(ratings):
    rows, cols, vals = ratings
    return reference_als(rows, cols, vals, (M, N), init_factor(N, F, 0), LAM, ITERS)


@pytest.fixture(scope="module", params=[(7, 5), (1000, 1000)], ids=lambda t: f"tiles{t}")
def store(request, ratings, tmp_path_factory):
    rows, cols, vals = ratings
    tr, tc = request.param
    path = tmp_path_factory.mktemp("engine") / "r.zarr"
    return build_store(str(path), rows, cols, vals, shape=(M, N), tile_rows=tr, tile_cols=tc)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def _fit(store, client, backend="numpy", **plan):
    model = ALS(F, LAM, ITERS, seed=0, backend=backend, plan=PlanConfig(**plan))
    return model.fit(store, client=client)


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("q", [1, 2, 5])
def test_plans_match_reference(store, client, reference, p, q, backend):
    model = _fit(store, client, backend, p=p, q=q)
    X, Theta = reference
    assert model.plan_.x.p == p and model.plan_.x.q == q
    assert model.plan_.theta.p == p and model.plan_.theta.q == q
    assert rel_err(model.user_factors_, X) < 1e-4
    assert rel_err(model.item_factors_, Theta) < 1e-4
    assert (model.user_factors_[[0, 41]] == 0).all()  # no ratings -> zero factor
    assert (model.item_factors_[7] == 0).all()


@pytest.mark.parametrize("reduction", ["two-phase", "one"])
def test_reductions_match_reference(store, client, reference, reduction, backend):
    workers = len(client.scheduler_info()["workers"])
    groups = [[0], list(range(1, workers))] if workers > 1 else None
    model = _fit(store, client, backend, p=3, q=2, reduction=reduction, groups=groups)
    assert rel_err(model.user_factors_, reference[0]) < 1e-4
    assert rel_err(model.item_factors_, reference[1]) < 1e-4


def test_mixed_half_steps(store, client, reference):
    """Update X data-parallel and update Theta model-parallel in one run."""
    plan = PlanConfig(x=HalfStepPlan(p=2, q=3), theta=HalfStepPlan(p=1, q=2))
    model = ALS(F, LAM, ITERS, seed=0, backend="numpy", plan=plan).fit(store, client=client)
    assert (model.plan_.x.p, model.plan_.theta.p) == (2, 1)
    assert rel_err(model.user_factors_, reference[0]) < 1e-4


def test_single_rating(tmp_path, client):
    store = build_store(
        str(tmp_path / "one.zarr"),
        np.array([2]),
        np.array([1]),
        np.array([4.0], np.float32),
        shape=(3, 2),
    )
    model = ALS(2, 0.1, 2, backend="numpy").fit(store, client=client)
    X, T = reference_als([2], [1], [4.0], (3, 2), init_factor(2, 2, 0), 0.1, 2)
    assert np.isfinite(model.user_factors_).all()
    assert rel_err(model.user_factors_, X) < 1e-4
    assert rel_err(model.item_factors_, T) < 1e-4


def test_planted_model_reaches_noise_level(tmp_path, client, backend):
    """On R = X* Theta*^T + noise, test RMSE approaches the noise sigma."""
    rng = np.random.default_rng(5)
    m, n, rank, sigma = 400, 300, 3, 0.1
    Xs, Ts = rng.normal(0, 1, (m, rank)), rng.normal(0, 1, (n, rank))
    flat = rng.choice(m * n, 24000, replace=False)
    rows, cols = flat // n, flat % n
    vals = np.einsum("ij,ij->i", Xs[rows], Ts[cols]) + rng.normal(0, sigma, rows.size)
    store = build_store(
        str(tmp_path / "planted.zarr"),
        rows,
        cols,
        vals.astype(np.float32),
        shape=(m, n),
        test_fraction=0.1,
        split_seed=1,
    )
    model = ALS(rank, 0.01, 15, backend=backend).fit(store, client=client)
    test_rmse = model.metrics_[-1]["test_rmse"]
    assert model.metrics_[0]["test_rmse"] > test_rmse
    assert test_rmse < 1.3 * sigma
    assert abs(model.rmse(store) - test_rmse) < 1e-4


@pytest.mark.gpu
def test_local_cuda_cluster_end_to_end(ratings, reference, tmp_path):
    """dask-cuda: one worker per GPU, factors and resident blocks on the GPUs."""
    from cumf_dask.config import ClusterConfig
    from cumf_dask.engine.cluster import cluster_client

    rows, cols, vals = ratings
    store = build_store(str(tmp_path / "r.zarr"), rows, cols, vals, shape=(M, N))
    config = ClusterConfig(backend="cupy", dashboard_address=None)
    with cluster_client(config) as client:
        model = ALS(F, LAM, ITERS, backend="cupy").fit(store, client=client)
        assert model.plan_.backend == "cupy"
    assert rel_err(model.user_factors_, reference[0]) < 1e-4
    assert rel_err(model.item_factors_, reference[1]) < 1e-4
