"""Implicit feedback and the CG solver against the float64 reference (tests/reference.py):
every backend's row update, every plan through the engine (a few cases by default, the whole
product under ``-m exhaustive``), the objective falling every iteration, resume, and the
explicit model's CG."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import BACKENDS, random_ratings, rel_err
from reference import cg_half_step, half_step, implicit_half_step, reference_implicit_als
from test_engine import BIG, SMALL, _ids

from cumf_dask.backend.objective import UpdateSpec
from cumf_dask.blocks import coo_to_block
from cumf_dask.config import HalfStepConfig, PlanConfig
from cumf_dask.data.spill import build_store
from cumf_dask.factors import init_factor
from cumf_dask.implicit import ImplicitALS
from cumf_dask.model import ALS

M, N, F = 90, 60, 6
SOLVERS = ("cholesky", "cg")
LAM, ALPHA, ITERS = 0.1, 2.0, 3
EMPTY_ROWS, EMPTY_COLS = [0, 41], [7]


def counts_data(m, n, density, seed, **kw):
    """Skewed integer counts 1..5 (a few zeros: stored entries that add nothing)."""
    rows, cols, vals = random_ratings(m, n, density, seed, **kw)
    vals = np.round(vals) - 1
    return rows, cols, vals.astype(np.float32)


@pytest.fixture(scope="module")
def data():
    return counts_data(M, N, 0.12, 31, empty_rows=EMPTY_ROWS, empty_cols=EMPTY_COLS, skew=0.6)


# ----------------------------------------------------------------------------- backends


@pytest.mark.parametrize("f", [5, 33])
@pytest.mark.parametrize("solver", ["cholesky", "cg"])
@pytest.mark.parametrize(("form", "weighted"), [("linear", False), ("log", True)])
def test_update_matches_reference(backend, f, solver, form, weighted):
    m, n = 200, 120
    rows, cols, vals = counts_data(m, n, 0.06, f, empty_rows=[3], skew=0.7)
    block = coo_to_block(rows, cols, vals, 0, 0, m, n)
    fixed = init_factor(n, f, 1)
    previous = init_factor(m, f, 1, stream=2)
    spec = UpdateSpec(LAM, weighted=weighted, implicit=True, alpha=ALPHA, confidence=form,
                      eps=2.0, solver=solver, cg_steps=3)  # fmt: skip
    X = backend.to_host(backend.update(
        backend.block_to_device(block), backend.asarray(fixed),
        backend.asarray(np.bincount(rows, minlength=m)), spec, x0=backend.asarray(previous),
    ))  # fmt: skip
    ref = implicit_half_step(rows, cols, vals, m, fixed, LAM, ALPHA, weighted=weighted,
                             solver=solver, previous=previous, form=form, eps=2.0)  # fmt: skip
    assert np.isfinite(X).all() and (X[3] == 0).all()
    assert rel_err(X, ref) < 1e-4


def test_alpha_zero_gives_confidence_one(backend):
    """c = 1 on every positive (no sqrt(c - 1) to split: the weight is floored)."""
    m, n, f = 80, 50, 8
    rows, cols, vals = counts_data(m, n, 0.1, 5)
    block = coo_to_block(rows, cols, vals, 0, 0, m, n)
    fixed = init_factor(n, f, 2)
    spec = UpdateSpec(LAM, weighted=False, implicit=True, alpha=0.0)
    counts = backend.asarray(np.bincount(rows, minlength=m))
    X = backend.to_host(
        backend.update(backend.block_to_device(block), backend.asarray(fixed), counts, spec)
    )
    ref = implicit_half_step(rows, cols, vals, m, fixed, LAM, 0.0)
    assert rel_err(X, ref) < 1e-4


def test_partials_exclude_gram0_and_add_up(backend):
    """p > 1: partial Hermitians over column parts, summed, then solved with G0 once."""
    m, n, f = 150, 90, 12
    rows, cols, vals = counts_data(m, n, 0.08, 7)
    fixed = init_factor(n, f, 3)
    counts = np.bincount(rows, minlength=m)
    spec = UpdateSpec(LAM, weighted=False, implicit=True, alpha=ALPHA, solver="cg", cg_steps=4)
    previous = init_factor(m, f, 3, stream=2)
    parts = []
    for c0, c1 in ((0, 40), (40, n)):
        keep = (cols >= c0) & (cols < c1)
        blk = coo_to_block(rows[keep], cols[keep] - c0, vals[keep], 0, c0, m, c1 - c0)
        parts.append(backend.hermitian(backend.block_to_device(blk),
                                       backend.asarray(fixed[c0:c1]), spec))  # fmt: skip
    A = sum(backend.to_host(p[0]) for p in parts)
    B = sum(backend.to_host(p[1]) for p in parts)
    G0 = fixed.astype(np.float64).T @ fixed
    X = backend.to_host(backend.solve(backend.asarray(A), backend.asarray(B),
                                      backend.asarray(counts), spec, gram0=backend.asarray(G0),
                                      x0=backend.asarray(previous)))  # fmt: skip
    ref = implicit_half_step(rows, cols, vals, m, fixed, LAM, ALPHA, solver="cg",
                             previous=previous, cg_steps=4)  # fmt: skip
    assert rel_err(X, ref) < 1e-4


def test_explicit_cg_matches_reference(backend):
    m, n, f = 150, 90, 10
    rows, cols, vals = random_ratings(m, n, 0.08, 9, empty_rows=[2])
    block = coo_to_block(rows, cols, vals, 0, 0, m, n)
    fixed, previous = init_factor(n, f, 4), init_factor(m, f, 4, stream=2)
    spec = UpdateSpec(0.05, solver="cg", cg_steps=2)
    X = backend.to_host(backend.update(
        backend.block_to_device(block), backend.asarray(fixed),
        backend.asarray(np.bincount(rows, minlength=m)), spec, x0=backend.asarray(previous),
    ))  # fmt: skip
    assert rel_err(X, cg_half_step(rows, cols, vals, m, fixed, 0.05, previous, 2)) < 1e-4
    exact = half_step(rows, cols, vals.astype(np.float64), m, fixed.astype(np.float64), 0.05)
    assert rel_err(X, exact) > 1e-4  # two steps are not the exact solve


@pytest.mark.parametrize("path", ["update", "solve"])
def test_cg_rows_whose_system_is_not_finite_are_nan(backend, path):
    """alpha beyond float32 (c = inf: s inf, t NaN): the CPU's CG kept x0 and the GPU's wrote
    0, both finite, and the fit exited 0 having learned nothing. Now both give NaN to every
    row with a positive count (the fit's finite check stops it: NumericalError) and 0 to a
    row without ratings, the same on each backend (the fused kernel and A in memory)."""
    m, n, f = 40, 30, 8
    rows, cols, vals = counts_data(m, n, 0.2, 7, empty_rows=[2])
    block = backend.block_to_device(coo_to_block(rows, cols, vals, 0, 0, m, n))
    fixed, previous = init_factor(n, f, 3), init_factor(m, f, 3, stream=2)
    counts = np.bincount(rows, minlength=m)
    spec = UpdateSpec(LAM, weighted=False, implicit=True, alpha=1e39, solver="cg")
    G0 = fixed.astype(np.float64).T @ fixed
    with np.errstate(all="ignore"):
        if path == "update":
            X = backend.update(block, backend.asarray(fixed), backend.asarray(counts), spec,
                               x0=backend.asarray(previous))  # fmt: skip
        else:
            A, B = backend.hermitian(block, backend.asarray(fixed), spec)
            X = backend.solve(A, B, backend.asarray(counts), spec, gram0=backend.asarray(G0),
                              x0=backend.asarray(previous))  # fmt: skip
    X = backend.to_host(X)
    positive = np.bincount(rows[vals > 0], minlength=m) > 0
    assert np.isnan(X[positive]).all()
    assert (X[counts == 0] == 0).all() and counts[2] == 0
    assert np.isfinite(X[~positive]).all()


def test_an_alpha_beyond_float32_is_refused_before_the_fit():
    """alpha times the largest count overflowing float32 is one ConfigError naming
    model.alpha and an alpha that fits, from the store's stats, before any cluster starts."""
    from cumf_dask.backend.objective import check_confidence
    from cumf_dask.errors import ConfigError

    rows, cols, vals = counts_data(M, N, 0.1, 3)
    top = float(vals.max())
    with pytest.raises(ConfigError, match=r"alpha 1e\+39 \(model\.alpha\).*use alpha below"):
        ImplicitALS(F, alpha=1e39, solver="cg", backend="numpy").fit((rows, cols, vals, (M, N)))
    check_confidence(UpdateSpec(LAM, implicit=True, alpha=1e37), top)  # 4e37: fits
    with pytest.raises(ConfigError, match=r"model\.eps"):
        check_confidence(UpdateSpec(LAM, implicit=True, confidence="log", eps=1e-45), top)
    check_confidence(UpdateSpec(LAM, alpha=1e39), top)  # explicit ratings: alpha unused


# ----------------------------------------------------------------------------- engine

# (workers, tiles, p, q, solver): as tests/test_engine.py's CASES, the paths that differ here
CASES = [
    (1, SMALL, 1, 1, "cholesky"),  # one worker, one batch: G0 and the fused solve
    (2, BIG, 1, 5, "cg"),  # batches wrap around the workers, each with its warm-start rows
    (2, SMALL, 2, 1, "cholesky"),  # reduce-scatter: G0 added after the reduction
    (2, SMALL, 2, 1, "cg"),  # ... and CG from A in memory, warm-started per slice
    (4, SMALL, 3, 5, "cg"),  # p < workers, many batches and slices
]
FULL = [
    case
    for case in itertools.product([1, 2, 4], [SMALL, BIG], [1, 2, 3], [1, 2, 5], SOLVERS)
    if case not in CASES
]


@pytest.fixture(scope="module")
def stores(data, tmp_path_factory):
    rows, cols, vals = data
    out = {}
    for tiles in (SMALL, BIG):
        path = tmp_path_factory.mktemp("implicit") / "c.zarr"
        out[tiles] = build_store(str(path), rows, cols, vals, shape=(M, N), tile_rows=tiles[0],
                                 tile_cols=tiles[1])  # fmt: skip
    return out


@pytest.fixture(scope="module")
def references(data):
    rows, cols, vals = data
    x0, theta0 = init_factor(M, F, 0, stream=2, scale=0.01), init_factor(N, F, 0, scale=0.01)

    def run(x_start, theta_start, **options):
        return reference_implicit_als(rows, cols, vals, (M, N), x_start, theta_start, LAM,
                                      ALPHA, ITERS, **options)  # fmt: skip

    out = {solver: run(x0, theta0, solver=solver) for solver in SOLVERS}
    rng = np.random.default_rng(0)
    out["cg-float32"] = [
        run(_ulp_apart(x0, rng, k), _ulp_apart(theta0, rng, k), solver="cg", dtype=np.float32)
        for k in range(4)
    ]
    return out


def _ulp_apart(a, rng, k):
    """`a` in float32; for k > 0 each value one float32 step up or down at random."""
    a = np.asarray(a, np.float32)
    if k == 0:
        return a
    return np.where(rng.random(a.shape) < 0.5, np.nextafter(a, -np.inf), np.nextafter(a, np.inf))


def _tolerances(references, solver, backend):
    """(X, Theta, objective) tolerances against the float64 reference: 1e-4, except for CG on
    the GPU, which runs in float32. Three CG steps on this small problem amplify rounding
    about 10^4-fold: the same reference in float32, from initial factors one float32 step
    apart, lands up to about 1e-2 (X), 3e-2 (Theta) and 4e-3 (objective) from the float64
    one, as far as any GPU plan does (session 33, H100: 1.0e-2, 2.6e-2, 3.1e-3). So the
    bound is 4x the farthest of four such float32 runs (the GPU's sums are added in another
    order than NumPy's)."""
    if solver != "cg" or backend != "cupy":
        return 1e-4, 1e-4, 1e-4
    exact, singles = references["cg"], references["cg-float32"]
    moved = [max(rel_err(single[k], exact[k]) for single in singles) for k in range(2)]
    moved.append(max(float(np.max(np.abs(np.subtract(single[2], exact[2])) / np.abs(exact[2])))
                     for single in singles))  # fmt: skip
    return tuple(max(1e-4, 4 * m) for m in moved)


def _check(stores, clients, references, case, backend):
    workers, tiles, p, q, solver = case
    model = ImplicitALS(F, LAM, ALPHA, ITERS, solver=solver, backend=backend,
                        plan=PlanConfig(p=p, q=q))  # fmt: skip
    model.fit(stores[tiles], client=clients(workers))
    X, Theta, objective = references[solver]
    tol_x, tol_theta, tol_objective = _tolerances(references, solver, backend)
    assert (model.plan_.x.p, model.plan_.x.q) == (p, q)
    assert rel_err(model.user_factors_, X) < tol_x
    assert rel_err(model.item_factors_, Theta) < tol_theta
    assert (model.user_factors_[EMPTY_ROWS] == 0).all() and (model.item_factors_[7] == 0).all()
    got = [r["objective"] for r in model.metrics_]
    np.testing.assert_allclose(got, objective, rtol=tol_objective)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_plans_match_reference(stores, clients, references, case, backend):
    _check(stores, clients, references, case, backend)


@pytest.mark.exhaustive
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", FULL, ids=_ids)
def test_every_plan_matches_reference(stores, clients, references, case, backend):
    _check(stores, clients, references, case, backend)


@pytest.mark.gpu
def test_factor_in_host_memory(stores, clients, references):
    """X in pinned host memory (``plan.factors: host``): CG warm-starts from it, G0 and the
    objective read it from there, update Theta copies each part in once; the same factors.
    (CG in float32 is sensitive to the order of sums: with 3 parts on 2 workers the GPU's
    objective moved 0.2 %, past the bound, while the CPU's matched to 1e-7; test_engine
    covers a worker summing two parts.)"""
    plan = PlanConfig(x=HalfStepConfig(q=3), theta=HalfStepConfig(p=2, q=1), factors="host")
    model = ImplicitALS(F, LAM, ALPHA, ITERS, solver="cg", backend="cupy", plan=plan)
    model.fit(stores[SMALL], client=clients(2))
    X, Theta, objective = references["cg"]
    tol_x, tol_theta, tol_objective = _tolerances(references, "cg", "cupy")
    assert model.plan_.host_factor == "x"
    assert rel_err(model.user_factors_, X) < tol_x
    assert rel_err(model.item_factors_, Theta) < tol_theta
    got = [r["objective"] for r in model.metrics_]
    np.testing.assert_allclose(got, objective, rtol=tol_objective)


def test_streamed_blocks(stores, client2, references):
    """R read from the store every half-step (not resident): the same factors."""
    model = ImplicitALS(F, LAM, ALPHA, ITERS, backend="numpy",
                        plan=PlanConfig(p=2, q=2, blocks="store"))  # fmt: skip
    model.fit(stores[SMALL], client=client2)
    assert model.plan_.blocks == "store"
    assert rel_err(model.user_factors_, references["cg"][0]) < 1e-4
    assert rel_err(model.item_factors_, references["cg"][1]) < 1e-4


def test_objective_falls_every_iteration(stores, client2, data):
    """The exact solver never raises the objective, here with weighted lambda and the log
    form; the loss is the objective over the total confidence (implicit's calculate_loss)."""
    rows, cols, vals = data
    model = ImplicitALS(F, LAM, ALPHA, 6, solver="cholesky", regularization_mode="weighted",
                        confidence="log", backend="numpy", plan=PlanConfig(p=2, q=2))  # fmt: skip
    model.fit(stores[SMALL], client=client2)
    objective = [r["objective"] for r in model.metrics_]
    assert all(b < a for a, b in itertools.pairwise(objective))
    _, _, ref = reference_implicit_als(
        rows, cols, vals, (M, N), init_factor(M, F, 0, stream=2, scale=0.01),
        init_factor(N, F, 0, scale=0.01), LAM, ALPHA, 6, weighted=True, form="log",
    )  # fmt: skip
    np.testing.assert_allclose(objective, ref, rtol=1e-4)
    total = M * N - len(vals) + (1 + ALPHA * np.log1p(np.maximum(vals, 0))).sum()
    assert model.metrics_[-1]["loss"] == pytest.approx(objective[-1] / total, rel=1e-6)


class Interrupt(Exception):
    pass


def test_cg_resume_restores_both_factors(stores, client2, tmp_path):
    full = ImplicitALS(F, LAM, ALPHA, 4, backend="numpy").fit(stores[BIG], client=client2)

    def stop(record):
        if record["iteration"] == 2:
            raise Interrupt

    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(Interrupt):
        ImplicitALS(F, LAM, ALPHA, 4, backend="numpy", checkpoint_dir=ckpt,
                    callbacks=[stop]).fit(stores[BIG], client=client2)  # fmt: skip
    resumed = ImplicitALS(F, LAM, ALPHA, 4, backend="numpy", checkpoint_dir=ckpt)
    resumed.fit(stores[BIG], client=client2, resume=True)
    np.testing.assert_allclose(resumed.user_factors_, full.user_factors_, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(resumed.item_factors_, full.item_factors_, rtol=1e-5, atol=1e-6)
    with pytest.raises(Exception, match=r"another fit .*kind: 'implicit' there, 'explicit' here"):
        ALS(F, LAM, 5, backend="numpy", checkpoint_dir=ckpt).fit(
            stores[BIG], client=client2, resume=True
        )


@pytest.mark.parametrize("p", [1, 2])
def test_explicit_cg_through_the_engine(tmp_path, client2, p):
    rows, cols, vals = random_ratings(M, N, 0.12, 11, empty_rows=[0])
    store = build_store(str(tmp_path / "r.zarr"), rows, cols, vals, shape=(M, N))
    model = ALS(F, 0.05, ITERS, solver="cg", cg_steps=2, backend="numpy",
                plan=PlanConfig(p=p, q=2)).fit(store, client=client2)  # fmt: skip
    x, theta = init_factor(M, F, 0, stream=2), init_factor(N, F, 0)
    for _ in range(ITERS):
        x = cg_half_step(rows, cols, vals, M, theta, 0.05, x, 2)
        theta = cg_half_step(cols, rows, vals, N, x, 0.05, theta, 2)
    assert rel_err(model.user_factors_, x) < 1e-4 and rel_err(model.item_factors_, theta) < 1e-4
    assert model.metrics_[-1]["train_rmse"] > 0
