"""Local clusters as cumf-dask starts them (memory limits, GPUs, the dashboard, the keys the
CPU workers ignore), and a real multi-process cluster started the way users start one, which
runs a fit end to end."""

from __future__ import annotations

import subprocess
import sys
import time
import types
import urllib.error
import urllib.request
from pathlib import Path

import dask
import numpy as np
import pytest
from conftest import random_ratings, rel_err
from distributed import Client
from distributed.comm.core import CommClosedError
from distributed.system import MEMORY_LIMIT
from reference import reference_als

from cumf_dask.config import ClusterConfig, PlanConfig, load_config
from cumf_dask.data.spill import build_store
from cumf_dask.engine import cluster
from cumf_dask.errors import ConfigError, CumfWarning, DeviceMemoryError
from cumf_dask.factors import init_factor
from cumf_dask.model import ALS

# The `dask` command installed next to this Python (what users type: `dask scheduler`).
DASK = str(Path(sys.executable).with_name("dask"))


def test_threaded_workers_share_the_process_without_dask_pausing_them():
    """Each in-process worker's memory monitor read the whole process's memory against its
    own share, so all paused once the process passed 80% of one share (a false "ran out of
    memory" on many-core machines). Their limit stays the planner's budget; no dashboard
    is served for dashboard_address null."""
    config = ClusterConfig(backend="numpy", n_workers=2, processes=False, memory_limit="400MB",
                           dashboard_address=None)  # fmt: skip
    with cluster.cluster_client(config, nnz=10) as client:
        for worker in client.cluster.workers.values():
            manager = worker.memory_manager
            assert manager.memory_limit == 400_000_000
            assert manager.memory_pause_fraction is False and "memory_monitor" not in (
                worker.periodic_callbacks
            )
        assert cluster.worker_memory(client, "numpy") == 400_000_000
        assert cluster.plan_memory(client, "numpy") == 400_000_000  # nothing pauses them
        port = client.cluster.scheduler.http_server.port
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5)
    assert dask.config.get("distributed.worker.memory.pause") == 0.8  # only while starting


def test_results_come_from_a_local_clusters_workers_directly(clients):
    """Through the scheduler a 6.3 GB factor moved at 0.9 GB/s, directly at 2.2-2.5: a local
    cluster's workers are fetched from directly; a joined one's as the client says."""
    assert cluster.direct_to_workers(clients(1))
    joined = types.SimpleNamespace(direct_to_workers=None, cluster=None)
    assert not cluster.direct_to_workers(joined)
    assert cluster.direct_to_workers(types.SimpleNamespace(direct_to_workers=True, cluster=None))


def test_a_memory_limit_above_the_machine_is_its_share(monkeypatch):
    """Dask caps each worker alone at the machine's memory: 2 workers were promised 2x it."""
    config = ClusterConfig(backend="numpy", n_workers=2, memory_limit="100TB")
    with pytest.warns(CumfWarning, match=r"cluster\.memory_limit 100TB for each of 2 workers is "
                      r"more than this machine's .* each worker gets"):  # fmt: skip
        memory = cluster.local_resources(config).memory
    # worker processes: planned below Dask's pause threshold, less a process's own memory
    assert memory == int(0.8 * (MEMORY_LIMIT // 2)) - cluster.WORKER_PROCESS_BYTES
    assert cluster._memory_limit(ClusterConfig(memory_limit="1GB"), 2) == 10**9


def test_worker_processes_killed_as_they_start_are_one_memory_error():
    """A memory_limit below a worker process's own size: the nannies kill the workers as
    they start and the first call to them fails with a closed connection."""

    class Started:  # what _set_up asks of a client whose workers were just killed
        cluster, closed = None, False
        scheduler = types.SimpleNamespace(events=None)

        def register_plugin(self, plugin):
            raise CommClosedError("in <TCP (closed) ConnectionPool.register_worker_plugin>")

        def sync(self, func, topic, callback_timeout):
            return [(time.time(), {"worker": "tcp://127.0.0.1:1", "rss": 73e6})]

        def close(self):
            self.closed = True

    client = Started()
    with pytest.raises(DeviceMemoryError, match=r"^cluster\.memory_limit 50MB is too small for "
                       r"a worker process: the workers were killed for memory as they started "
                       r"\(one used 73 MB"):  # fmt: skip
        cluster._set_up(client, ClusterConfig(memory_limit="50MB"))
    assert client.closed


@pytest.mark.parametrize(
    ("visible", "devices", "passed"),
    [(None, [1, 0], "1,0"), ("2,3", [0, 1], "2,3"), ("GPU-a, GPU-b,GPU-c", [2, 0], "GPU-c,GPU-a")],
)
def test_devices_are_positions_among_the_visible_gpus(monkeypatch, visible, devices, passed):
    """cluster.devices as the planner reads them (0-based among CUDA_VISIBLE_DEVICES) reach
    dask-cuda as the GPUs they name, not as other GPUs the parent process hides."""
    got = {}
    fake = types.ModuleType("dask_cuda")
    fake.LocalCUDACluster = lambda **kwargs: got.update(kwargs)
    monkeypatch.setitem(sys.modules, "dask_cuda", fake)
    monkeypatch.setattr(cluster, "has_module", lambda name: name == "dask_cuda")
    monkeypatch.setattr(cluster, "cuda_device_count", lambda: 3)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    config = ClusterConfig(backend="cupy", devices=devices, memory_limit="100TB",
                           dashboard_address=None)  # fmt: skip
    cluster._cuda_cluster(config)
    assert got["CUDA_VISIBLE_DEVICES"] == passed
    assert got["memory_limit"] == MEMORY_LIMIT // len(devices)  # the machine shared
    assert got["dashboard_address"] == ":0" and got["scheduler_kwargs"] == {"dashboard": False}


def test_gpu_keys_with_cpu_workers_are_a_warning_and_bad_devices_an_error():
    config = ClusterConfig(backend="numpy", protocol="ucx", devices=[0], rmm_pool_size="2GB")
    with pytest.warns(CumfWarning, match=r"^cluster\.protocol ucx and cluster\.devices \[0\] "
                      r"and cluster\.rmm_pool_size 2GB are for GPU workers, and cluster\.backend "
                      r"numpy runs CPU workers, which ignore them"):  # fmt: skip
        cluster.local_resources(config)
    for devices in ("[-1]", "[0,0]", "[]"):
        with pytest.raises(ConfigError, match=r"'cluster\.devices' is .*: give the GPUs to use "
                           r"once each, 0-based among the visible ones"):  # fmt: skip
            load_config(overrides=[f"cluster.devices={devices}"])


def test_cupy_on_workers_without_a_gpu_is_one_config_error(clients, monkeypatch):
    """backend="cupy" with a client whose workers have no GPU: one ConfigError naming the
    setting, the workers and the fix (was a ModuleNotFoundError from the first GPU task)."""
    monkeypatch.setattr(cluster, "has_cuda", lambda: False)  # CPU workers, even on a GPU host
    client = clients(2)
    rows, cols, vals = random_ratings(20, 10, 0.3, seed=1)
    with pytest.raises(ConfigError, match=r"^backend='cupy' .* worker\(s\) inproc://.* have no "
                       r"CUDA GPU .*: use backend='numpy' or 'auto'"):  # fmt: skip
        ALS(2, backend="cupy").fit((rows, cols, vals), client=client)
    assert cluster.backend_on(client, "auto") == "numpy"


def test_workers_named_by_integers_are_in_numeric_order(monkeypatch):
    """dask-cuda names its workers 0..N-1 (worker k on GPU k), and plan.groups and the NVML
    groups name them by position: 10 and 11 come after 9, not after 1."""
    names = [7, 11, 0, 3, 10, 1, 9, 4, 2, 8, 6, 5]
    info = {f"tcp://10.0.0.{k}:4000": {"name": name} for k, name in enumerate(names)}
    monkeypatch.setattr(cluster, "workers_info", lambda client: info)
    order = [info[address]["name"] for address in cluster.worker_addresses(None)]
    assert order == list(range(12))


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


@pytest.mark.cluster
@pytest.mark.slow
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


def test_workers_do_not_log_the_tracebacks_of_the_fits_own_errors():
    """A task failing with one of cumf-dask's errors, at any depth of the hierarchy
    (HostMemoryError is a DeviceMemoryError), is reported by the fit in one line: Dask's
    "Compute Failed" record of it is dropped; any other failure is kept."""
    import logging

    from cumf_dask.engine.cluster import RaisedByTheFit
    from cumf_dask.errors import HostMemoryError, StoreError

    def record(exc: Exception, where: str = "cumf_dask/engine/tasks.py") -> logging.LogRecord:
        return logging.LogRecord(
            "distributed.worker", logging.ERROR, __file__, 0,
            "Compute Failed\nKey: %s\nState: %s\nTask: %s\nException: %r\nTraceback: %r\n",
            ("key", "executing", "task", repr(exc), f'  File "{where}", line 1'), None,
        )  # fmt: skip

    kept = RaisedByTheFit().filter
    assert not kept(record(HostMemoryError("locking 8 bytes")))
    assert not kept(record(StoreError("damaged store")))
    assert kept(record(ValueError("a bug")))
    assert kept(record(StoreError("a user's own, by that name"), "/home/me/job.py"))
