"""Planning a local run without a cluster: what this machine's local cluster would have is
what a started one reports; cluster.processes chooses threads or processes."""

from __future__ import annotations

import pytest
from conftest import random_ratings

from cumf_dask.config import ClusterConfig, load_config
from cumf_dask.data.spill import build_store
from cumf_dask.engine import cluster
from cumf_dask.engine.cluster import (
    IN_PROCESS_MAX_NNZ,
    NVLINK_RMM_POOL,
    client_resources,
    cluster_client,
    in_process,
    local_resources,
    rmm_pool,
)
from cumf_dask.errors import ConfigError
from cumf_dask.pipeline import job_plan


def test_processes_auto_uses_threads_for_small_cpu_problems():
    auto = ClusterConfig()
    assert in_process(auto, 800_000) and in_process(auto, IN_PROCESS_MAX_NNZ)
    assert not in_process(auto, IN_PROCESS_MAX_NNZ + 1)
    assert not in_process(auto, None)  # size unknown: processes, the safe choice
    assert in_process(ClusterConfig(processes=False), 10**12)
    assert not in_process(ClusterConfig(processes=True), 10)
    assert local_resources(ClusterConfig(backend="numpy", processes=True)).transport == "tcp"


def test_gpu_workers_over_ucx_start_with_an_rmm_pool(monkeypatch):
    """dask-cuda recommends an RMM pool with NVLink: one unless the config names its own."""
    monkeypatch.setattr(cluster, "has_module", lambda name: True)
    assert rmm_pool(ClusterConfig(), ucx=True) == NVLINK_RMM_POOL
    assert rmm_pool(ClusterConfig(), ucx=False) is None
    assert rmm_pool(ClusterConfig(rmm_pool_size="20GB"), ucx=False) == 20 * 10**9
    assert rmm_pool(ClusterConfig(rmm_pool_size="50%"), ucx=False) == 0.5  # dask-cuda's share
    assert rmm_pool(ClusterConfig(rmm_pool_size=2**30), ucx=False) == 2**30
    monkeypatch.setattr(cluster, "has_module", lambda name: False)  # rmm not installed
    assert rmm_pool(ClusterConfig(), ucx=True) is None


@pytest.mark.parametrize("memory_limit", [None, "1GB"])
def test_local_resources_are_what_the_started_cluster_reports(memory_limit):
    config = ClusterConfig(backend="numpy", n_workers=2, processes=False, dashboard_address=None,
                           memory_limit=memory_limit)  # fmt: skip
    expected = local_resources(config, nnz=1000)
    with cluster_client(config, nnz=1000) as client:
        assert client_resources(client, "numpy") == expected
    assert expected.transport == "inproc" and expected.workers == 2


def test_job_plan_without_a_cluster_matches_the_plan_with_one(tmp_path):
    rows, cols, vals = random_ratings(300, 80, 0.1, seed=5)
    build_store(str(tmp_path / "r.zarr"), rows, cols, vals, shape=(300, 80))
    config = load_config(data={
        "data": {"store": str(tmp_path / "r.zarr")}, "model": {"factors": 6},
        "cluster": {"backend": "numpy", "n_workers": 2, "dashboard_address": None},
    })  # fmt: skip
    local = job_plan(config, None, log=lambda _: None)
    with cluster_client(config.cluster, nnz=local.plan.x.nnz) as client:
        started = job_plan(config, client, log=lambda _: None)
    assert local.plan.to_dict() == started.plan.to_dict()
    assert not local.estimated and local.generate_nnz == 0


def test_gpu_workers_cannot_be_threads():
    with pytest.raises(ConfigError, match=r"cluster\.processes is false but the backend is cupy"):
        from cumf_dask.engine.cluster import make_client

        make_client(ClusterConfig(backend="cupy", processes=False))


@pytest.mark.gpu
def test_local_gpu_resources_are_what_the_started_cluster_reports():
    """NVML's view (no CUDA context in this process) against the GPU workers' own."""
    config = ClusterConfig(backend="cupy", dashboard_address=None)
    expected = local_resources(config)
    with cluster_client(config) as client:
        assert client_resources(client, "cupy") == expected


@pytest.mark.gpu
@pytest.mark.parametrize(("size", "fraction"), [("10%", 0.1), ("2GB", None)])
def test_a_gpu_cluster_starts_with_the_rmm_pool_asked_for(size, fraction):
    """cluster.rmm_pool_size as bytes or as a share of the GPU reaches dask-cuda as such."""
    pytest.importorskip("rmm")
    config = ClusterConfig(backend="cupy", dashboard_address=None, rmm_pool_size=size)

    def pool_and_total() -> tuple[int, int]:
        import cupy
        import rmm

        resource = rmm.mr.get_current_device_resource()
        while not isinstance(resource, rmm.mr.PoolMemoryResource):
            resource = resource.upstream_mr  # dask-cuda may wrap the pool (statistics, ...)
        return resource.pool_size(), cupy.cuda.Device().mem_info[1]

    with cluster_client(config) as client:
        for pool, total in client.run(pool_and_total).values():
            want = fraction * total if fraction else 2e9
            # dask-cuda takes the share of NVML's total and rounds: 8.55 GB for 10% of an H100
            assert pool == pytest.approx(want, rel=0.01)


def test_a_gpu_job_with_more_factors_than_the_kernels_take_stops_before_a_cluster(
    tmp_path, monkeypatch
):
    """model.factors above the GPU kernels' limit: one ConfigError from the plan made on
    this machine, before a cluster starts (it was a task's traceback, exit 1)."""
    from cumf_dask import pipeline

    rows, cols, vals = random_ratings(60, 40, 0.2, seed=2)
    build_store(str(tmp_path / "r.zarr"), rows, cols, vals, shape=(60, 40))
    config = load_config(data={
        "data": {"store": str(tmp_path / "r.zarr")}, "model": {"factors": 2040},
        "cluster": {"backend": "cupy", "devices": [0]}, "output": {"dir": str(tmp_path)},
    })  # fmt: skip
    monkeypatch.setattr(cluster, "gpu_memories", lambda: [80 * 10**9])  # one GPU, by NVML

    def no_cluster(*args, **kwargs):
        raise AssertionError("a cluster was started")

    monkeypatch.setattr(pipeline, "cluster_client", no_cluster)
    with pytest.raises(ConfigError, match=r"model\.factors 2040: the GPU backend supports up to "
                                          r"2032"):  # fmt: skip
        pipeline.train(config, log=lambda _: None)


class _FakeNVML:
    """pynvml over three GPUs, the last with one MIG device: NVML's handles by whole UUID
    only (an abbreviated one is NVMLError_NotFound, as the real NVML)."""

    class NVMLError(Exception):
        pass

    UUIDS = ("GPU-059a0bdd-1111-2222-3333-444455556666", "GPU-059a1234-aaaa-bbbb-cccc-dddd",
             "GPU-7f00aaaa-eeee-ffff-0000-111122223333", "MIG-abcd0123-4444-5555-6666-7777")
    TOTALS = (80, 40, 20, 10)  # GB

    def __init__(self):
        self.nvmlInit = self.nvmlShutdown = lambda: None

    def nvmlDeviceGetCount(self):
        return 3

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid not in self.UUIDS:
            raise self.NVMLError("Not Found")
        return self.UUIDS.index(uuid)

    def nvmlDeviceGetUUID(self, handle):
        return self.UUIDS[handle].encode()  # bytes, as older pynvml releases give

    def nvmlDeviceGetMaxMigDeviceCount(self, handle):
        if handle != 2:
            raise self.NVMLError("Not Supported")
        return 2

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle, j):
        if j:
            raise self.NVMLError("Not Found")  # an empty slot
        return 3

    def nvmlDeviceGetMemoryInfo(self, handle):
        return type("Memory", (), {"total": self.TOTALS[handle] * 10**9})


@pytest.mark.parametrize(("visible", "totals"), [
    ("GPU-059a0bdd", [80]),  # CUDA accepts the UUID's first characters; NVML does not
    ("GPU-059a0bdd-1111-2222-3333-444455556666", [80]),
    ("GPU-7f,1", [20, 40]),
    ("MIG-abcd", [10]),
    ("GPU-059a", "2 GPUs' UUIDs start"),
    ("GPU-ffff", "no GPU's UUID starts"),
])  # fmt: skip
def test_abbreviated_gpu_uuids_are_found_by_prefix(monkeypatch, visible, totals):
    """An abbreviated UUID in CUDA_VISIBLE_DEVICES crashed plan and train with an NVML
    traceback; it names the GPU whose UUID starts so, else a ConfigError names it."""
    import sys

    from cumf_dask import devices

    monkeypatch.setitem(sys.modules, "pynvml", _FakeNVML())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(devices, "cuda_device_count", lambda: len(visible.split(",")))
    if isinstance(totals, str):
        with pytest.raises(ConfigError, match=f"entry '{visible}': {totals} with it"):
            devices.gpu_memories()
    else:
        assert devices.gpu_memories() == [t * 10**9 for t in totals]
