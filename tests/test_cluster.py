"""A real multi-process cluster started the way users start one runs a fit end to end."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import random_ratings, rel_err
from distributed import Client
from reference import reference_als

from cumf_dask.config import PlanConfig
from cumf_dask.data.spill import build_store
from cumf_dask.factors import init_factor
from cumf_dask.model import ALS

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
# The `dask` command installed next to this Python (what users type: `dask scheduler`).
DASK = str(Path(sys.executable).with_name("dask"))


@pytest.fixture
def scheduler_file(tmp_path):
    path = tmp_path / "scheduler.json"
    procs = [
        subprocess.Popen(
            [
                DASK,
                "scheduler",
                "--scheduler-file",
                str(path),
                "--port",
                "0",
                "--dashboard-address",
                ":0",
                "--no-show",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    try:
        deadline = time.time() + 30
        while not path.exists() and time.time() < deadline:
            time.sleep(0.2)
        procs.append(
            subprocess.Popen(
                [
                    DASK,
                    "worker",
                    "--scheduler-file",
                    str(path),
                    "--nworkers",
                    "2",
                    "--nthreads",
                    "1",
                    "--memory-limit",
                    "2GB",
                    "--no-dashboard",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        yield str(path)
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)


def test_fit_on_scheduler_and_worker_processes(scheduler_file, tmp_path):
    rows, cols, vals = random_ratings(80, 50, 0.15, seed=8)
    store = build_store(str(tmp_path / "r.zarr"), rows, cols, vals, shape=(80, 50))
    with Client(scheduler_file=scheduler_file, timeout="30s", set_as_default=False) as client:
        client.wait_for_workers(2, timeout=60)
        model = ALS(4, 0.05, 3, backend="numpy", plan=PlanConfig(p=2, q=2)).fit(
            store, client=client
        )
        client.shutdown()  # scheduler and workers close at once (SIGTERM waits on the nannies)
    X, T = reference_als(rows, cols, vals, (80, 50), init_factor(50, 4, 0), 0.05, 3)
    assert rel_err(model.user_factors_, X) < 1e-4
    assert rel_err(model.item_factors_, T) < 1e-4
    assert np.isfinite(model.metrics_[-1]["train_rmse"])
