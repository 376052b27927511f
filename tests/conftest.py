"""Shared fixtures: in-process Dask clusters shared by the whole session, backends (GPU ones
marked and skipped without CUDA), random rating data."""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from cumf_dask.devices import has_cuda

HAS_CUDA = has_cuda()
BACKENDS = [
    "numpy",
    pytest.param("cupy", marks=[pytest.mark.gpu]),
]


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """A crash (SIGSEGV) dumps the crashing thread's stack only: with every thread (dozens of
    idle Dask ones) the one that crashed fell outside the part of CI's log that is kept."""
    faulthandler.enable(file=os.dup(2), all_threads=False)


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and cupy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def clients():
    """clients(workers): a Client of an in-process LocalCluster with that many single-threaded
    workers, started once for the whole test session (starting clusters dominated test time).
    Tests leave nothing on them: the engine releases what it held after each fit."""
    from distributed import Client, LocalCluster

    from cumf_dask.engine.cluster import worker_addresses

    pool: dict[int, tuple] = {}

    def get(workers: int):
        if workers in pool and len(worker_addresses(pool[workers][1])) < workers:
            # a worker left; start afresh (the case once seen in CI, a 1-worker cluster
            # reporting none, was Client.scheduler_info's race: see cluster.workers_info)
            cluster, client = pool.pop(workers)
            client.close()
            cluster.close()
        if workers not in pool:
            cluster = LocalCluster(
                n_workers=workers, threads_per_worker=1, processes=False, dashboard_address=None
            )
            pool[workers] = (cluster, Client(cluster, set_as_default=False))
        return pool[workers][1]

    yield get
    for cluster, client in pool.values():
        client.close()
        cluster.close()


@pytest.fixture
def client2(clients):
    """The shared two-worker client."""
    return clients(2)


@pytest.fixture(params=BACKENDS)
def backend(request):
    from cumf_dask.backend import get_backend

    return get_backend(request.param)


def random_ratings(m, n, density, seed, empty_rows=(), empty_cols=(), skew=0.0):
    """Fresh random COO ratings in [1, 5] with optional empty rows/columns and degree skew."""
    rng = np.random.default_rng(seed)
    k = max(1, int(m * n * density))
    if skew:
        pr = 1.0 / np.arange(1, m + 1) ** skew
        pc = 1.0 / np.arange(1, n + 1) ** skew
        rows = rng.choice(m, 3 * k, p=pr / pr.sum())
        cols = rng.choice(n, 3 * k, p=pc / pc.sum())
        flat = np.unique(rows * n + cols)  # sorted: shuffled before it is cut to k, else
        rng.shuffle(flat)  # only the first rows would keep their ratings
        flat = flat[:k]
    else:
        flat = rng.choice(m * n, k, replace=False)
    rows, cols = flat // n, flat % n
    keep = ~np.isin(rows, list(empty_rows)) & ~np.isin(cols, list(empty_cols))
    rows, cols = rows[keep], cols[keep]
    vals = rng.uniform(1, 5, rows.size).astype(np.float32)
    return rows.astype(np.int64), cols.astype(np.int64), vals


def rel_err(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def float32_cg_change(A, B, counts, spec, gram0=None, x0=None, draws=8):
    """Largest relative change of spec.cg_steps CG steps on the systems (G0 + A + reg I) x = B
    when done in float32 instead of float64 (NumPy), on A as given and on A moved by a few
    float32 units in the last place (as summing A in float32 moves it): the rounding a
    float32 CG cannot avoid. A few CG steps are chaotic in rounding, so one float32 run
    can understate it 15x (f = 200); the largest of several draws does not."""
    from cumf_dask.backend.objective import batched_cg, regularization, symmetric

    rows = np.flatnonzero(np.asarray(counts) > 0)
    M = symmetric(np, np.asarray(A[rows], np.float64))
    if gram0 is not None:
        M += gram0
    diag = np.arange(M.shape[1])
    M[:, diag, diag] += regularization(np, np.asarray(counts), spec)[rows][:, None]
    b = np.asarray(B[rows], np.float64)
    start = np.zeros(b.shape) if x0 is None else np.asarray(x0[rows], np.float64)
    exact = batched_cg(np, M, b, start, spec.cg_steps)
    rng = np.random.default_rng(0)
    change = 0.0
    for draw in range(draws):
        ulps = rng.standard_normal(M.shape) * (4 * np.finfo(np.float32).eps) * (draw > 0)
        moved = M * (1 + (ulps + ulps.transpose(0, 2, 1)) / 2)
        single = batched_cg(np, moved.astype(np.float32), b.astype(np.float32),
                            start.astype(np.float32), spec.cg_steps)  # fmt: skip
        change = max(change, rel_err(single, exact))
    return change

