"""Every plan (p, q, workers, tiles, reduction) gives the float64 reference's factors.

The default run checks the cases that exercise different code paths (listed in CASES with
what each covers); ``-m exhaustive`` runs the whole product of workers x tiles x p x q and
every reduction on every cluster size (``.ci/run`` runs both).
"""

from __future__ import annotations

import gc
import itertools
import os
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from conftest import BACKENDS, random_ratings, rel_err
from distributed import get_task_stream
from distributed.diagnostics.plugin import WorkerPlugin
from reference import reference_als
from threadpoolctl import threadpool_info, threadpool_limits

from cumf_dask.config import HalfStepConfig, PlanConfig
from cumf_dask.data.spill import build_store
from cumf_dask.engine import fit as fit_module
from cumf_dask.engine import plan as plan_module
from cumf_dask.errors import ConfigError, CumfWarning, StoreError
from cumf_dask.factors import init_factor
from cumf_dask.model import ALS

F, LAM, ITERS = 6, 0.05, 3
M, N = 90, 60
SMALL, BIG = (7, 5), (1000, 1000)  # tiles: blocks span many tiles / one tile per band

# (workers, tiles, p, q): one line per path through the engine
CASES = [
    (1, SMALL, 1, 1),  # one worker, one batch; blocks cut out of many tiles
    (2, BIG, 1, 5),  # p = 1, more batches than workers: batches wrap around the workers
    (4, SMALL, 1, 2),  # p = 1, fewer batches than workers: some workers idle
    (2, SMALL, 2, 1),  # data parallel, p = workers: reduce-scatter, one batch
    (2, BIG, 3, 2),  # p > workers: parts wrap around the workers
    (4, SMALL, 3, 5),  # p < workers, many batches and slices
]
FULL = [
    case
    for case in itertools.product([1, 2, 4], [SMALL, BIG], [1, 2, 3], [1, 2, 5])
    if case not in CASES
]
REDUCTIONS = [(4, SMALL, "two-phase"), (2, BIG, "one")]
ALL_REDUCTIONS = [
    case
    for case in itertools.product([1, 2, 4], [SMALL, BIG], ["two-phase", "one"])
    if case not in REDUCTIONS
]


def _ids(case) -> str:
    workers, tiles, *rest = case
    return f"{workers}w-tiles{tiles[0]}x{tiles[1]}-" + "-".join(map(str, rest))


@pytest.fixture(scope="module")
def ratings():
    return random_ratings(M, N, 0.12, seed=11, empty_rows=[0, 41], empty_cols=[7], skew=0.5)


@pytest.fixture(scope="module")
def reference(ratings):
    rows, cols, vals = ratings
    return reference_als(rows, cols, vals, (M, N), init_factor(N, F, 0), LAM, ITERS)


@pytest.fixture(scope="module")
def stores(ratings, tmp_path_factory):
    rows, cols, vals = ratings
    out = {}
    for tr, tc in (SMALL, BIG):
        path = tmp_path_factory.mktemp("engine") / "r.zarr"
        out[(tr, tc)] = build_store(
            str(path), rows, cols, vals, shape=(M, N), tile_rows=tr, tile_cols=tc
        )
    return out


def _fit(store, client, backend="numpy", **plan):
    model = ALS(F, LAM, ITERS, seed=0, backend=backend, plan=PlanConfig(**plan))
    return model.fit(store, client=client)


def _check_plan(stores, clients, reference, case, backend):
    workers, tiles, p, q = case
    model = _fit(stores[tiles], clients(workers), backend, p=p, q=q)
    X, Theta = reference
    assert model.plan_.x.p == p and model.plan_.x.q == q
    assert model.plan_.theta.p == p and model.plan_.theta.q == q
    assert rel_err(model.user_factors_, X) < 1e-4
    assert rel_err(model.item_factors_, Theta) < 1e-4
    assert (model.user_factors_[[0, 41]] == 0).all()  # no ratings -> zero factor
    assert (model.item_factors_[7] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_plans_match_reference(stores, clients, reference, case, backend):
    _check_plan(stores, clients, reference, case, backend)


@pytest.mark.exhaustive
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", FULL, ids=_ids)
def test_every_plan_matches_reference(stores, clients, reference, case, backend):
    _check_plan(stores, clients, reference, case, backend)


def _check_reduction(stores, clients, reference, case, backend):
    workers, tiles, reduction = case
    groups = [[0], list(range(1, workers))] if workers > 1 else None
    model = _fit(
        stores[tiles], clients(workers), backend, p=3, q=2, reduction=reduction, groups=groups
    )
    assert rel_err(model.user_factors_, reference[0]) < 1e-4
    assert rel_err(model.item_factors_, reference[1]) < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", REDUCTIONS, ids=_ids)
def test_reductions_match_reference(stores, clients, reference, case, backend):
    _check_reduction(stores, clients, reference, case, backend)


@pytest.mark.exhaustive
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ALL_REDUCTIONS, ids=_ids)
def test_every_reduction_matches_reference(stores, clients, reference, case, backend):
    _check_reduction(stores, clients, reference, case, backend)


class HeldBlocks(WorkerPlugin):
    """A worker plugin: the most rating blocks ("load-" keys) a worker had read and not yet
    computed on (Dask frees a block a moment later, when the scheduler says so)."""

    name = "held-blocks"

    def setup(self, worker):
        self.worker = worker
        self.now = self.most = 0
        worker.held_blocks = self

    def transition(self, key, start, finish, **kwargs):
        if finish != "memory":
            return
        if str(key).startswith("load-"):
            self.now += 1
            self.most = max(self.most, self.now)
        elif key in self.worker.state.tasks:
            deps = self.worker.state.tasks[key].dependencies
            self.now -= sum(str(d.key).startswith("load-") for d in deps)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("blocks", ["host", "store"])
def test_block_tiers_match_reference(stores, clients, reference, blocks, backend, monkeypatch):
    """Blocks in (pinned) host memory, or read from the store by every half-step, give the
    reference's factors; streamed blocks are read one ahead of the computation, so a worker
    never holds more than two (here 6 batches and 2 parts per worker and half-step). Host
    blocks are copied ahead by tasks of their own (made so at this size)."""
    monkeypatch.setattr(plan_module, "STAGED_BLOCK_BYTES", 0)
    client = clients(1)
    client.register_plugin(HeldBlocks())
    try:
        model = _fit(stores[SMALL], client, backend, p=2, q=6, blocks=blocks)
        [most] = client.run(lambda dask_worker: dask_worker.held_blocks.most).values()
    finally:
        client.unregister_worker_plugin(HeldBlocks.name)
    assert model.plan_.blocks == ("device" if (blocks, backend) == ("host", "numpy") else blocks)
    assert rel_err(model.user_factors_, reference[0]) < 1e-4
    assert rel_err(model.item_factors_, reference[1]) < 1e-4
    if blocks == "store":
        assert 1 <= most <= 2


@pytest.mark.gpu
def test_factor_in_host_memory_matches_reference(stores, clients, reference, tmp_path):
    """X in pinned host memory (``plan.factors: host``): update X copies its batches out,
    update Theta copies X in part by part, each once (data parallel, p = 3 on 2 workers: one
    worker sums two parts' partials); resumed from a checkpoint
    for the last iteration, the reference's factors."""
    plan = PlanConfig(x=HalfStepConfig(q=3), theta=HalfStepConfig(p=3, q=2), factors="host")
    first = ALS(F, LAM, ITERS - 1, seed=0, backend="cupy", plan=plan, checkpoint_dir=str(tmp_path))
    first.fit(stores[SMALL], client=clients(2))
    assert first.plan_.host_factor == "x" and first.plan_.theta.parts_outer
    assert "X in pinned host memory (copied in once per half-step)" in first.plan_.table()
    model = ALS(F, LAM, ITERS, seed=0, backend="cupy", plan=plan, checkpoint_dir=str(tmp_path))
    model.fit(stores[SMALL], client=clients(2), resume=True)
    assert [r["iteration"] for r in model.metrics_] == list(range(1, ITERS + 1))
    assert rel_err(model.user_factors_, reference[0]) < 1e-4
    assert rel_err(model.item_factors_, reference[1]) < 1e-4


def test_parts_outer_schedule_matches_reference(stores, clients, reference, monkeypatch):
    """The schedule of a fixed factor in pinned host memory (``plan.factors: host`` on GPU
    workers), run on CPU workers: update Theta (p = 3 on 2 workers) assembles each part of X
    once and sums every batch's partials part by part, update X (p = 1) assembles Theta once
    per worker; the same factors."""
    make_plan = fit_module.make_plan

    def parts_outer(*args, **kwargs):
        plan = make_plan(*args, **kwargs)
        plan.x.parts_outer = plan.theta.parts_outer = True
        return plan

    monkeypatch.setattr(fit_module, "make_plan", parts_outer)
    model = _fit(stores[BIG], clients(2), x=HalfStepConfig(p=1, q=3),
                 theta=HalfStepConfig(p=3, q=2))  # fmt: skip
    assert model.plan_.theta.parts_outer and model.plan_.theta.p == 3
    assert rel_err(model.user_factors_, reference[0]) < 1e-4
    assert rel_err(model.item_factors_, reference[1]) < 1e-4


def test_staged_host_blocks_match_reference(stores, clients, reference, monkeypatch):
    """The schedule of blocks in host memory copied to the device ahead of their use
    (``plan.blocks: host`` on GPU workers, big blocks), run on CPU workers: a copy task per
    use, each bounded to one block ahead; the same factors."""
    make_plan = fit_module.make_plan

    def host_blocks(*args, **kwargs):
        plan = make_plan(*args, **kwargs)
        plan.x.staged = plan.theta.staged = True
        return replace(plan, blocks="host")

    monkeypatch.setattr(fit_module, "make_plan", host_blocks)
    client = clients(2)
    with get_task_stream(client) as stream:
        model = _fit(stores[BIG], client, x=HalfStepConfig(p=1, q=3),
                     theta=HalfStepConfig(p=3, q=2))  # fmt: skip
    staged = [t for t in stream.data if str(t["key"]).startswith("stage-")]
    assert model.plan_.blocks == "host" and len(staged) == ITERS * (3 + 3 * 2)
    assert rel_err(model.user_factors_, reference[0]) < 1e-4
    assert rel_err(model.item_factors_, reference[1]) < 1e-4


def test_partial_sums_wait_for_the_batch_two_before(stores, client2, reference):
    """p > 1: every batch's partial Hermitians are ready at once; a worker's sums of batch j
    start only once batch j - 2 is solved, so it holds about two batches' sums, not q.
    (Compared on one worker's clock: each worker shifts its times by its own estimate of
    the scheduler's, and under load two estimates differ by tens of milliseconds.)"""
    with get_task_stream(client2) as stream:
        model = _fit(stores[BIG], client2, p=2, q=6)
    assert rel_err(model.user_factors_, reference[0]) < 1e-4
    computed = {  # key prefix (the run's id cut off): (worker, start, stop)
        str(t["key"]).rsplit("-", 1)[0]: (t["worker"], s[0]["start"], s[-1]["stop"])
        for t in stream.data
        if (s := [s for s in t["startstops"] if s["action"] == "compute"])
    }
    compared = 0
    for it, j, part in itertools.product(range(1, ITERS + 1), range(2, 6), range(2)):
        worker, start, _ = computed[f"hermitian-X-batch{j}-part{part}-it{it}"]
        before = f"reduce-solve-X-batch{j - 2}-"
        solved = [stop for key, (where, _, stop) in computed.items()
                  if key.startswith(before) and key.endswith(f"-it{it}") and where == worker]
        assert all(start >= stop for stop in solved)
        compared += len(solved)
    assert compared >= ITERS * 4 * 2  # a solve of batch j - 2 on the worker of each sum


def test_mixed_half_steps(stores, client2, reference):
    """Update X data-parallel and update Theta model-parallel in one run."""
    plan = PlanConfig(x=HalfStepConfig(p=2, q=3), theta=HalfStepConfig(p=1, q=2))
    model = ALS(F, LAM, ITERS, seed=0, backend="numpy", plan=plan)
    model.fit(stores[SMALL], client=client2)
    assert (model.plan_.x.p, model.plan_.theta.p) == (2, 1)
    assert rel_err(model.user_factors_, reference[0]) < 1e-4


def test_single_rating(tmp_path, client2):
    store = build_store(
        str(tmp_path / "one.zarr"),
        np.array([2]),
        np.array([1]),
        np.array([4.0], np.float32),
        shape=(3, 2),
    )
    with pytest.warns(CumfWarning, match="^2 of 3 users and 1 of 2 items have no training "
                                         "rating: their factors stay zero"):
        model = ALS(2, 0.1, 2, backend="numpy").fit(store, client=client2)
    X, T = reference_als([2], [1], [4.0], (3, 2), init_factor(2, 2, 0), 0.1, 2)
    assert np.isfinite(model.user_factors_).all()
    assert rel_err(model.user_factors_, X) < 1e-4
    assert rel_err(model.item_factors_, T) < 1e-4
    with pytest.warns(CumfWarning, match=r"^2 of the 3 users have zero factors \(no training "
                      r"rating, or only ratings of 0\): every item scores 0"):  # fmt: skip
        model.recommend([0, 1, 2], k=1, exclude_seen=False)
    model.recommend_indices([0, 1, 2], k=1, exclude_seen=False)  # evaluate's: no warning
    with pytest.raises(ConfigError, match=r"rmse takes a store, or \(users, items, ratings\) "
                       "arrays: got a tuple of 2"):  # fmt: skip
        model.rmse(([2], [1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_planted_model_reaches_noise_level(tmp_path, client2, backend):
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
    model = ALS(rank, 0.01, 15, backend=backend).fit(store, client=client2)
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


def _incoming_keys(dask_worker) -> list[str]:
    return [str(key) for entry in dask_worker.transfer_incoming_log for key in entry["keys"]]


@pytest.mark.parametrize("p", [1, 2])
def test_rating_blocks_never_move_between_workers(stores, clients, reference, p):
    """Blocks are loaded where they are used and stay there: only factor pieces and partial
    Hermitians cross between workers, never R."""
    client = clients(2)
    client.run(lambda dask_worker: dask_worker.transfer_incoming_log.clear())
    model = _fit(stores[SMALL], client, p=p, q=2, blocks="device")
    assert rel_err(model.user_factors_, reference[0]) < 1e-4
    moved = [k for keys in client.run(_incoming_keys).values() for k in keys]
    assert any(k.startswith(("gather-", "slice-", "update-")) for k in moved)
    assert not [k for k in moved if k.startswith(("load-", "counts-"))]


def test_half_steps_are_timed_on_the_workers(stores, client2):
    """Iteration 2 is queued before iteration 1 is reported, so it computes while a slow
    callback runs; its seconds are its half-steps' (workers' clocks), not the callback's."""
    calls = []

    def slow(record: dict) -> None:
        calls.append(record)
        time.sleep(0.5)

    model = ALS(F, LAM, 2, seed=0, backend="numpy", callbacks=[slow])
    model.fit(stores[SMALL], client=client2)
    first, second = model.metrics_
    assert [r["iteration"] for r in calls] == [1, 2]
    assert second["seconds"] < 0.5 <= second["elapsed"] - first["elapsed"]
    for r in model.metrics_:
        assert r["seconds"] == pytest.approx(r["x_seconds"] + r["theta_seconds"])
        assert min(r["x_seconds"], r["theta_seconds"]) >= 0


def _results_on(client) -> set[str]:
    """The keys of the results the client's workers hold."""
    held = client.run(lambda dask_worker: [str(key) for key in dask_worker.data])
    return {key for keys in held.values() for key in keys}


def test_a_failed_fit_leaves_nothing_on_the_workers(ratings, tmp_path, client2):
    """A fit failing mid-run (a chunk of the store gone after iteration 2) lets go of the
    factors it held, while its error is kept (a notebook keeps it) and without a GC pass
    (Dask's record of the failed task refers back to the fit's frames: a cycle)."""
    store = build_store(str(tmp_path / "r.zarr"), *ratings, shape=(M, N), tile_rows=7,
                        tile_cols=5)  # fmt: skip

    def lose_a_chunk(record: dict) -> None:
        if record["iteration"] == 2:
            os.remove(os.path.join(store.url, "by_row", "3", "minor", "c", "0"))

    gc.collect()
    before = _results_on(client2)
    model = ALS(F, LAM, 5, backend="numpy", plan=PlanConfig(p=2, q=3, blocks="store"),
                callbacks=[lose_a_chunk])  # fmt: skip
    gc.disable()
    try:
        with pytest.raises(StoreError) as kept:  # kept: the error and its traceback
            model.fit(store, client=client2)
        deadline = time.monotonic() + 5
        while (left := _results_on(client2) - before) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"{len(left)} results left while {kept.type.__name__} is kept: " + (
            ", ".join(sorted(left)[:4]))
    finally:
        gc.enable()


def _blas_threads() -> list[int]:
    return [pool["num_threads"] for pool in threadpool_info()]


def _in_a_thread(call) -> None:
    """Run `call` in a thread that then ends: threadpoolctl (3.8) lets the living thread
    that set OpenBLAS's threads keep control of them, and a user's process has none."""
    thread = threading.Thread(target=call)
    thread.start()
    thread.join()


def test_blas_runs_one_thread_during_a_fit_only(stores, client2):
    """The workers, threads of this process here, pin BLAS to one thread while they fit;
    this process's own BLAS threads, and the workers' logger, are as they were afterwards."""
    import logging

    filters = list(logging.getLogger("distributed.worker").filters)
    seen, limits = [], []

    def during(record: dict) -> None:
        seen.extend(client2.submit(_blas_threads, pure=False).result())

    _in_a_thread(lambda: limits.append(threadpool_limits(2)))  # as on a larger machine
    try:
        before = _blas_threads()
        ALS(F, LAM, 1, backend="numpy", callbacks=[during]).fit(stores[SMALL], client=client2)
        after = _blas_threads()
    finally:
        _in_a_thread(limits[0].restore_original_limits)
    assert max(before) == 2 and after == before
    assert seen and set(seen) == {1}
    assert logging.getLogger("distributed.worker").filters == filters


def test_blas_pin_is_restored_whichever_thread_lets_it_go():
    """In-process workers pin and unpin from their own threads (two clusters' fits can end
    in either order): the limit comes off however the holders go, and the caller's own
    threadpoolctl limits work afterwards (threadpoolctl 3.8 lets only the thread that set
    OpenBLAS's limit change it)."""
    from cumf_dask.engine.cluster import _ProcessSetup

    pin, limits = _ProcessSetup(), []
    pinned, done = threading.Event(), threading.Event()

    def first_holder() -> None:  # a worker's thread: it lives on after its pin
        pin.hold(1)
        pinned.set()
        done.wait()

    _in_a_thread(lambda: limits.append(threadpool_limits(2)))  # as on a larger machine
    holder = threading.Thread(target=first_holder)
    try:
        before = _blas_threads()
        holder.start()
        pinned.wait()
        _in_a_thread(lambda: pin.hold(1))  # a second holder, from another thread
        assert set(_blas_threads()) == {1}
        _in_a_thread(pin.release)
        assert set(_blas_threads()) == {1}
        _in_a_thread(pin.release)  # the last, from neither of the threads that pinned
        assert max(before) == 2 and _blas_threads() == before
    finally:
        done.set()
        holder.join()
        _in_a_thread(limits[0].restore_original_limits)


def test_zero_cg_iterations_solve_x_from_the_initial_theta(stores, client2):
    """With 0 iterations, X is one update from the initial Theta for the CG solver too (not
    its seeded starting X): users without ratings get zero factors, as with Cholesky."""
    models = {solver: ALS(F, LAM, 0, seed=0, backend="numpy", solver=solver).fit(
        stores[SMALL], client=client2) for solver in ("cholesky", "cg")}  # fmt: skip
    assert (models["cg"].user_factors_[[0, 41]] == 0).all()
    np.testing.assert_array_equal(models["cg"].item_factors_, models["cholesky"].item_factors_)
