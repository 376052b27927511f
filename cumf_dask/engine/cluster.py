"""Getting a Dask client (an existing scheduler, a LocalCUDACluster or a LocalCluster), and
what the planner needs to know of its workers.

Per-worker setup lives in a WorkerPlugin, not in tasks: BLAS pinned to one thread (Dask
already gives the parallelism; threaded BLAS is much slower on many small products).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from distributed import Client, WorkerPlugin

from ..backend import resolve_backend_name
from ..compat import has_module
from ..config import ClusterConfig, parse_size, read_size
from ..devices import cuda_device_count, gpu_memories, gpu_total_memory, has_cuda
from ..errors import ConfigError, CumfError
from . import tasks
from .placement import COMPUTE
from .tasks import NonFiniteFactor

_log = logging.getLogger(__name__)

# Local workers get one thread more than cluster.threads_per_worker and this many units of
# the COMPUTE resource: compute tasks take a unit, loads do not, so a worker reads its next
# block while it computes on this one (never two computations at once).


def workers_info(client: Client) -> dict[str, dict[str, Any]]:
    """The scheduler's record of every worker, by address, asked for now. Not
    ``Client.scheduler_info``: it returns the client's cache, which the client's own periodic
    refresh (without per-worker records) can overwrite between the fetch and the read, so
    all workers would seem gone at once (seen in CI as the loss of every worker mid-fit)."""
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


def has_compute_slots(client: Client) -> bool:
    """Whether every worker declares the COMPUTE resource (local clusters made here do)."""
    info = workers_info(client).values()
    return bool(info) and all(COMPUTE in (w.get("resources") or {}) for w in info)


class CumfWorkerSetup(WorkerPlugin):
    """Pin BLAS threads.

    GPU workers share CuPy's kernel cache (``CUPY_CACHE_DIR``, else ``~/.cupy/kernel_cache``):
    CuPy writes its entries atomically, and reads the directory's name once, when it is
    imported, so a directory per worker set here would not take effect anyway.
    """

    name = "cumf-dask-setup"

    def __init__(self, blas_threads: int = 1):
        self.blas_threads = blas_threads

    def setup(self, worker: Any) -> None:
        from threadpoolctl import threadpool_limits

        self._limits = threadpool_limits(self.blas_threads)
        log = logging.getLogger("distributed.worker")
        if not any(isinstance(f, RaisedByTheFit) for f in log.filters):
            log.addFilter(RaisedByTheFit())


class RaisedByTheFit(logging.Filter):
    """Drops Dask's "Compute Failed" record (a task, its arguments and a traceback, on the
    worker's stderr) when the task failed with one of cumf-dask's own errors: the fit raises
    that error with its message, which is all a user should see (the CLI's one line)."""

    OWN = tuple(f"{cls.__name__}(" for cls in (*CumfError.__subclasses__(), NonFiniteFactor))

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        failed = str(record.msg).startswith("Compute Failed") and len(args) > 3
        return not (failed and str(args[3]).startswith(self.OWN))


# The RMM pool a local GPU cluster over UCX/NVLink starts with when cluster.rmm_pool_size is
# not set (it grows on demand). dask-cuda recommends a pool with NVLink (and warns without
# one); on two H200s it took a Netflix iteration from 0.0566 to 0.0536 s (benchmarks/RESULTS.md,
# session 29; the likely reason, not measured apart: without a pool each piece received is
# a fresh cudaMalloc, and freeing it waits for the whole device).
NVLINK_RMM_POOL = "4GB"

# cluster.processes "auto": a local CPU cluster of at most this many ratings runs its workers
# as threads of this process (measured faster at 0.8M and 5.6M ratings on 2 cores: README
# "Set up and run"); above it, processes, whose nannies restart a worker out of memory
IN_PROCESS_MAX_NNZ = 20_000_000


def in_process(config: ClusterConfig, nnz: int | None = None) -> bool:
    """Whether a local CPU cluster for `nnz` ratings runs its workers as threads of this
    process: cluster.processes false, or "auto" and a known nnz up to IN_PROCESS_MAX_NNZ.

    Threads start in a fraction of a second and move nothing between workers; NumPy's BLAS
    and LAPACK calls release the GIL, so the workers still compute in parallel. Processes
    isolate the workers (a nanny restarts one that runs out of memory) for large problems.
    """
    if config.processes == "auto":
        return nnz is not None and nnz <= IN_PROCESS_MAX_NNZ
    return not config.processes


def cpu_workers(config: ClusterConfig) -> int:
    """Workers of a local CPU cluster: cluster.n_workers, else one per threads_per_worker cores."""
    return config.n_workers or max(1, (os.cpu_count() or 1) // config.threads_per_worker)


def make_client(config: ClusterConfig | None = None, nnz: int | None = None) -> Client:
    """A Client for the config: join `address`, else start a local cluster of the right kind.

    `nnz` (the problem's ratings, when known) decides ``cluster.processes: auto``. The client
    process never touches CUDA before the GPU workers start (dask-cuda pitfall).
    """
    config = config or ClusterConfig()
    if config.address:
        _check_address(config.address)
        try:
            client = Client(config.address, timeout="20s")
        except OSError as exc:
            raise ConfigError(
                f"cluster.address: no Dask scheduler answers at {config.address} ({exc}); start "
                "one with `dask scheduler` or remove cluster.address to run locally"
            ) from None
    elif resolve_backend_name(config.backend) == "cupy":
        client = Client(_cuda_cluster(config))
    else:
        from distributed import LocalCluster

        kwargs: dict[str, Any] = {}
        if config.memory_limit:
            kwargs["memory_limit"] = parse_size(config.memory_limit)
        cluster = LocalCluster(
            n_workers=cpu_workers(config),
            processes=not in_process(config, nnz),
            threads_per_worker=config.threads_per_worker + 1,
            resources={COMPUTE: config.threads_per_worker},
            dashboard_address=_dashboard(config),
            **kwargs,
        )
        client = Client(cluster)
    client.register_plugin(CumfWorkerSetup())
    return client


def _check_address(address: str) -> None:
    """A scheduler address Dask can parse (a known scheme; a port for tcp and tls), else a
    ConfigError: checked before a Client is made, as a Client that fails to parse it is left
    half started (its cleanup waits for the connect timeout, twice)."""
    from distributed.comm.addressing import parse_address, parse_host_port
    from distributed.comm.registry import get_backend

    try:
        scheme, location = parse_address(address)
        get_backend(scheme)
        if scheme in ("tcp", "tls", "ws", "wss"):
            parse_host_port(location)
    except ValueError as exc:
        raise ConfigError(
            f"cluster.address {address!r} is not a scheduler address ({exc}); give one such "
            "as tcp://host:8786, or remove cluster.address to run locally"
        ) from None


@contextmanager
def cluster_client(config: ClusterConfig | None = None, nnz: int | None = None) -> Iterator[Client]:
    """make_client as a context: the client and any cluster it started are closed after."""
    client = make_client(config, nnz)
    try:
        yield client
    finally:
        cluster = client.cluster
        client.close()
        if cluster is not None:
            cluster.close()


def _cuda_cluster(config: ClusterConfig) -> Any:
    if config.processes is False:
        raise ConfigError(
            "cluster.processes is false but the backend is cupy: GPU workers are processes "
            "(one per GPU); remove cluster.processes or set cluster.backend: numpy"
        )
    if not has_module("dask_cuda"):
        raise ConfigError(
            "cluster.backend is cupy but dask-cuda is not installed: pip install 'cumf-dask[gpu]'"
        )
    if config.rmm_pool_size and not has_module("rmm"):
        raise ConfigError(
            "cluster.rmm_pool_size is set but module 'rmm' is not available: install rmm "
            "(e.g. rmm-cu13) or remove cluster.rmm_pool_size"
        )
    from dask_cuda import LocalCUDACluster

    kwargs: dict[str, Any] = {
        "threads_per_worker": config.threads_per_worker + 1,
        "resources": {COMPUTE: config.threads_per_worker},
    }
    if config.devices is not None:
        available = cuda_device_count()
        bad = [d for d in config.devices if d < 0 or d >= max(available, 1)]
        if bad:
            raise ConfigError(
                f"cluster.devices {config.devices}: GPU ids {bad} do not exist "
                f"({available} visible)"
            )
        kwargs["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, config.devices))
    elif config.n_workers:
        kwargs["n_workers"] = config.n_workers
    if config.memory_limit:
        kwargs["memory_limit"] = parse_size(config.memory_limit)
    ucx = cuda_protocol(config.protocol, len(gpu_ids(config))) == "ucx"
    pool = rmm_pool(config, ucx)
    if pool:  # CuPy allocates from it too: one pool for the kernels and the transfers
        kwargs["rmm_pool_size"] = pool
        kwargs["rmm_allocator_external_lib_list"] = ["cupy"]
    if ucx:
        kwargs.update(protocol="ucx", enable_nvlink=True, enable_tcp_over_ucx=True)
        _log.info("GPU workers talk over UCX (NVLink), RMM pool of %s each", pool or "none")
    kwargs["dashboard_address"] = _dashboard(config)
    return LocalCUDACluster(**kwargs)


def rmm_pool(config: ClusterConfig, ucx: bool) -> str | int | float | None:
    """The RMM pool each worker of a local GPU cluster starts with: cluster.rmm_pool_size
    (bytes, or a share of the GPU's memory as dask-cuda takes it: a float in (0, 1]), else
    NVLINK_RMM_POOL when the workers talk over UCX and rmm is installed, else none."""
    if config.rmm_pool_size:
        size, share = read_size(config.rmm_pool_size)
        return size if share else int(size)
    return NVLINK_RMM_POOL if ucx and has_module("rmm") else None


def gpu_ids(config: ClusterConfig) -> list[int]:
    """The visible GPUs (0-based among CUDA_VISIBLE_DEVICES) a local GPU cluster uses: one
    worker each, cluster.devices, else the first cluster.n_workers, else all."""
    if config.devices is not None:
        return list(config.devices)
    count = cuda_device_count()
    return list(range(min(config.n_workers, count) if config.n_workers else count))


def cuda_protocol(protocol: str, gpus: int) -> str:
    """The transport of a local GPU cluster: UCX (NVLink between GPUs) when asked, or for
    "auto" when there are several GPUs and distributed-ucxx is installed; else TCP."""
    ucx = has_module("distributed_ucxx")
    if protocol == "ucx" and not ucx:
        raise ConfigError(
            "cluster.protocol is ucx but distributed-ucxx is not installed: pip install "
            "'cumf-dask[gpu]' (it brings distributed-ucxx-cu13), or set cluster.protocol: tcp"
        )
    if protocol == "ucx" or (protocol == "auto" and ucx and gpus > 1):
        return "ucx"
    return "tcp"


def transport(client: Client) -> str:
    """The scheduler's protocol as a word for logs: "tcp", "ucx", "inproc"."""
    return str(client.scheduler.address).split("://", 1)[0]


def _dashboard(config: ClusterConfig) -> str:
    """The dashboard address; with none configured Dask's HTTP server still runs, so give
    it a free port rather than 8787 (which another cluster may hold).

    An address this machine cannot serve on is a ConfigError here: starting the cluster
    would fail with a bare "Cluster failed to start".
    """
    if config.dashboard_address is None:
        return ":0"
    from distributed.utils import clean_dashboard_address

    address = config.dashboard_address
    try:
        for spec in clean_dashboard_address(address):
            host = spec["address"] or None  # '' (":8787"): every interface
            family, kind, proto, _, where = socket.getaddrinfo(
                host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            with socket.socket(family, kind, proto) as probe:
                probe.bind(where)  # the host only: a port in use is replaced by a free one
    except (ValueError, OSError) as exc:
        raise ConfigError(
            f"cluster.dashboard_address {address!r} cannot be served here ({exc}); give a "
            "port on this machine such as ':8787' or 'localhost:8787', ':0' for a free port, "
            "or null for no dashboard"
        ) from None
    return address


@dataclass(frozen=True)
class Resources:
    """What the planner needs of the workers: backend, how many, the smallest one's memory
    (GPU memory on GPU workers), the transport between them, and on GPU workers the
    smallest host memory limit (room for host-tier blocks)."""

    backend: str
    workers: int
    memory: int
    transport: str
    host_memory: int | None = None


def local_resources(config: ClusterConfig, nnz: int | None = None) -> Resources:
    """The Resources of the local cluster make_client(config, nnz) would start, read from
    this machine without starting it: the same worker count and memory rules (Dask's share
    of memory per CPU worker, or cluster.memory_limit; each GPU's memory from NVML, with no
    CUDA context). Not for cluster.address: a running cluster is asked through a client."""
    backend = resolve_backend_name(config.backend)
    if backend == "cupy":
        ids = gpu_ids(config)
        sizes = gpu_memories()
        if not sizes:
            raise ConfigError(
                "cluster.backend is cupy but no CUDA GPU is visible on this machine: set "
                "cluster.backend: numpy (or auto) to run on the CPU, or run on a machine with "
                "a GPU"
            )
        bad = [d for d in ids if d < 0 or d >= len(sizes)]
        if bad or not ids:
            raise ConfigError(
                f"cluster.devices {config.devices}: GPU ids {bad} do not exist "
                f"({len(sizes)} visible)"
            )
        return Resources(backend, len(ids), min(sizes[d] for d in ids),
                         cuda_protocol(config.protocol, len(ids)),
                         _host_limit(config, len(ids)))  # fmt: skip
    workers = cpu_workers(config)
    return Resources(backend, workers, _host_limit(config, workers),
                     "inproc" if in_process(config, nnz) else "tcp")  # fmt: skip


def _host_limit(config: ClusterConfig, workers: int) -> int:
    """The memory limit each of `workers` local workers gets: cluster.memory_limit as a
    Worker reads it (capped at the system's), else the system's memory shared by them
    (LocalCluster's and LocalCUDACluster's default)."""
    from distributed.worker_memory import parse_memory_limit

    if config.memory_limit:
        limit = parse_memory_limit(parse_size(config.memory_limit), config.threads_per_worker + 1,
                                   logger=_log)  # fmt: skip
    else:
        limit = parse_memory_limit("auto", 1, workers, logger=_log)
    if not limit:
        import psutil

        limit = int(psutil.virtual_memory().total / workers)
    return int(limit)


def client_resources(client: Client, backend: str) -> Resources:
    """The Resources of a running cluster's workers (`backend` as the config names it)."""
    backend = backend_on(client, backend)
    return Resources(backend, len(worker_addresses(client)), worker_memory(client, backend),
                     transport(client), host_memory(client, backend))  # fmt: skip


def worker_addresses(client: Client) -> list[str]:
    """Worker addresses in a stable order (by name, then address)."""
    info = workers_info(client)
    return [a for a, _ in sorted(info.items(), key=lambda kv: (str(kv[1].get("name")), kv[0]))]


def worker_memory(client: Client, backend: str) -> int:
    """The smallest per-worker memory: GPU memory on GPU workers, else the memory limit."""
    if backend == "cupy":
        sizes = client.run(gpu_total_memory)
        return int(min(sizes.values()))
    info = workers_info(client)
    limits = [int(w.get("memory_limit") or 0) for w in info.values()]
    if not limits or min(limits) <= 0:
        import psutil

        return int(psutil.virtual_memory().total / max(len(limits), 1))
    return min(limits)


def host_memory(client: Client, backend: str) -> int | None:
    """GPU workers: the smallest host memory limit (see worker_memory); None on CPU workers,
    whose memory limit is already the plan's budget."""
    return worker_memory(client, "numpy") if backend == "cupy" else None


def measure_link(
    client: Client, workers: list[str], backend: str, nbytes: int = 64 << 20, watch: Any = None
):
    """Bytes/s from the first worker to the second, timed on real transfers of `nbytes` in
    the backend's arrays (device memory on GPU workers), minus a tiny transfer's time; inf
    when the transfer costs nothing measurable or the workers share this process (nothing
    is copied between them, so nothing is timed), None for one worker. With `watch` (a
    :class:`~.watch.Watch`) a lost or memory-paused worker raises instead of hanging. The
    caller keeps `nbytes` small next to the workers' memory."""
    if len(workers) < 2:
        return None
    if transport(client) == "inproc":
        return math.inf
    source, sink = workers[:2]

    def result(fut: Any) -> Any:
        if watch is not None:
            watch.wait([fut])
        return fut.result()

    def transfer_seconds(size: int) -> float:
        arrays = [
            client.submit(tasks.filler, size, backend, workers=[source], pure=False)
            for _ in range(3)
        ]
        for arr in arrays:  # made on the source (waited for there, not moved)
            result(client.submit(tasks.nbytes, arr, workers=[source], pure=False))
        times = []
        for arr in arrays:  # a fresh array each time: a replica would not move again
            t0 = time.perf_counter()
            result(client.submit(tasks.nbytes, arr, workers=[sink], pure=False))
            times.append(time.perf_counter() - t0)
        return min(times)

    moved = transfer_seconds(nbytes) - transfer_seconds(8)
    return nbytes / moved if moved > 1e-4 else math.inf


def read_threads(client: Client, workers: list[str]) -> dict[str, int]:
    """Threads each worker may use to read and assemble blocks: its machine's cores shared
    by the workers on that machine (a GPU worker on a 16-core machine decodes on 16)."""
    cores = client.run(os.cpu_count)
    per_host = Counter(_host(w) for w in workers)
    return {w: max(1, int(cores.get(w) or 1) // per_host[_host(w)]) for w in workers}


def _host(address: str) -> str:
    return address.split("://", 1)[-1].rsplit(":", 1)[0]


def wait_for_workers(client: Client, count: int, timeout: float) -> list[str]:
    """The workers present once there are `count` of them, or after `timeout` seconds (a
    nanny restarts a killed worker under a new address within seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        workers = worker_addresses(client)
        if len(workers) >= count or time.monotonic() > deadline:
            return workers
        time.sleep(0.2)


def process_memory(client: Client) -> int:
    """The largest worker process's memory in bytes as the scheduler last heard it (what
    Python, Dask and the libraries take before any data: a CPU plan must fit beside it)."""
    info = workers_info(client).values()
    return max((int((w.get("metrics") or {}).get("memory") or 0) for w in info), default=0)


def backend_on(client: Client, name: str) -> str:
    """A backend name resolved where the work runs: 'auto' is cupy only if every worker
    sees a GPU (a CPU login node may drive GPU workers, or the reverse)."""
    if name != "auto":
        return resolve_backend_name(name)
    found = client.run(has_cuda)
    return "cupy" if found and all(found.values()) else "numpy"
