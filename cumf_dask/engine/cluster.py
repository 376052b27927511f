"""Getting a Dask client (an existing scheduler, a LocalCUDACluster or a LocalCluster), and
what the planner needs to know of its workers.

Per-worker setup lives in a WorkerPlugin, not in tasks: BLAS pinned to one thread (Dask
already gives the parallelism; threaded BLAS is much slower on many small products), for
a fit's duration (:func:`blas_pinned`): workers that are threads of the caller's process
share its BLAS.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import dask
from distributed import Client, WorkerPlugin
from distributed.core import Status

from ..backend import resolve_backend_name
from ..backend.numpy_backend import STOPPING
from ..compat import has_module
from ..config import ClusterConfig, parse_size, read_size
from ..devices import (
    child_visible_devices,
    cuda_device_count,
    gpu_memories,
    gpu_total_memory,
    has_cuda,
)
from ..errors import ConfigError, CumfError, DeviceMemoryError, warn
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


def check_client(client: Any, caller: str) -> None:
    """`client` is an open distributed.Client (a cluster, an address or a closed client is
    one ConfigError saying what to pass)."""
    from distributed.deploy import Cluster

    if isinstance(client, Cluster):
        raise ConfigError(f"{caller}(client=...) takes a distributed.Client, got the cluster "
                          f"{type(client).__name__}: pass Client(cluster)")  # fmt: skip
    if not isinstance(client, Client):
        raise ConfigError(f"{caller}(client=...) takes a distributed.Client, got "
                          f"{type(client).__name__} {client!r:.60}: pass Client(address), or "
                          "none to start a local cluster")  # fmt: skip
    if client.status != "running":
        raise ConfigError(f"{caller}(client=...): the client is {client.status}, not running; "
                          "pass an open client, or none to start a local cluster")  # fmt: skip


def has_compute_slots(client: Client) -> bool:
    """Whether every worker declares the COMPUTE resource (local clusters made here do)."""
    info = workers_info(client).values()
    return bool(info) and all(COMPUTE in (w.get("resources") or {}) for w in info)


class CumfWorkerSetup(WorkerPlugin):
    """While registered, BLAS threads pinned and Dask's records of the fit's own errors
    dropped (:class:`_ProcessSetup`; teardown restores both).

    GPU workers share CuPy's kernel cache (``CUPY_CACHE_DIR``, else ``~/.cupy/kernel_cache``):
    CuPy writes its entries atomically, and reads the directory's name once, when it is
    imported, so a directory per worker set here would not take effect anyway.
    """

    name = "cumf-dask-setup"

    def __init__(self, blas_threads: int = 1, name: str | None = None):
        self.blas_threads = blas_threads
        if name is not None:
            self.name = name

    def setup(self, worker: Any) -> None:
        _PROCESS_SETUP.hold(self.blas_threads)

    def teardown(self, worker: Any) -> None:
        _PROCESS_SETUP.release()


class _ProcessSetup:
    """What this process holds while any worker in it holds a CumfWorkerSetup: its BLAS
    limit, and :class:`RaisedByTheFit` on the workers' logger. Workers that are threads of
    one process share both: the first holder sets them and the last restores them. The BLAS
    limit is set and restored on one thread of its own: from threadpoolctl 3.8 only the
    thread that set OpenBLAS's limit may change it again (a restore from another thread
    would be ignored, and the caller's BLAS left on one thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._limits: Any = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="cumf-blas")
        self._filter = RaisedByTheFit()

    def hold(self, threads: int) -> None:
        from threadpoolctl import threadpool_limits

        with self._lock:
            if self._holders == 0:
                self._limits = self._thread.submit(
                    lambda: threadpool_limits(threads).__enter__()
                ).result()
                logging.getLogger("distributed.worker").addFilter(self._filter)
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            if self._holders == 0:  # its setup never ran
                return
            self._holders -= 1
            if self._holders == 0:
                logging.getLogger("distributed.worker").removeFilter(self._filter)
                limits, self._limits = self._limits, None
                self._thread.submit(limits.__exit__, None, None, None).result()


@contextmanager
def blas_pinned(client: Client) -> Iterator[None]:
    """CumfWorkerSetup on `client`'s workers while a fit runs, under a name of the fit's own
    (fits at once, on one client or several clients of one scheduler, each remove only
    theirs): workers that are threads of the caller's process (a LocalCluster with
    processes=False, a user's own too) would else keep the caller's BLAS on one thread,
    and a user's cluster would keep it for their other work. A client closed meanwhile
    (its scheduler still running) is replaced by a short-lived one of the same scheduler
    to remove it; one that lost its scheduler, or whose own cluster was closed too, is not
    asked: it would wait out its reconnect or connect timeout."""
    name = f"{CumfWorkerSetup.name}-{uuid.uuid4().hex[:8]}"
    address, cluster = client.scheduler.address, getattr(client, "cluster", None)
    client.register_plugin(CumfWorkerSetup(name=name))
    try:
        yield
    finally:
        with suppress(Exception):  # the fit's own error, if any, is the one to see
            if client.status == "running":
                client.unregister_worker_plugin(name)
            elif client.status == "closed" and _still_running(cluster):
                with Client(address, timeout=3, set_as_default=False) as other:
                    other.unregister_worker_plugin(name)


def _still_running(cluster: Any) -> bool:
    """Whether a client's own cluster (None: one it joined, not known here) still runs."""
    return cluster is None or cluster.status == Status.running


def _subclasses(cls: type) -> list[type]:
    """Every class derived from `cls`, at any depth (HostMemoryError is a DeviceMemoryError)."""
    return [sub for direct in cls.__subclasses__() for sub in (direct, *_subclasses(direct))]


class RaisedByTheFit(logging.Filter):
    """Drops Dask's "Compute Failed" record (a task, its arguments and a traceback, on the
    worker's stderr) when the task failed with one of cumf-dask's own errors: the fit raises
    that error with its message, which is all a user should see (the CLI's one line)."""

    OWN = tuple(f"{cls.__name__}(" for cls in (*_subclasses(CumfError), NonFiniteFactor))

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        failed = str(record.msg).startswith("Compute Failed") and len(args) > 4
        # ours: named as one of our errors and raised in our code (a user's task raising
        # an error of the same name keeps its record)
        return not (failed and str(args[3]).startswith(self.OWN) and "cumf_dask" in str(args[4]))


_PROCESS_SETUP = _ProcessSetup()


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

# How long joining cluster.address may take: the TCP connect (Dask's retries), and a tenth
# more for the Dask handshake and a registered client
JOIN_S = 20.0

# What a fresh CPU worker process takes before any data, with cumf-dask imported (about 75 MB
# measured): the plan preview's stand-in for the running workers' own (plan_memory)
WORKER_PROCESS_BYTES = 100 << 20

# Dask's per-worker memory manager, off for workers that are threads of this process: each
# would compare the whole process's memory (every worker's data, the client's) with its own
# limit, and all would pause once the process passes 80% of one worker's share (see
# make_client). Their limit stays: it is the planner's per-worker budget.
NO_MEMORY_MANAGER = {f"distributed.worker.memory.{k}": False for k in ("target", "spill", "pause")}


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
        return _join(config.address)
    if resolve_backend_name(config.backend) == "cupy":
        client = Client(_cuda_cluster(config))
    else:
        from distributed import LocalCluster

        workers, threads = cpu_workers(config), in_process(config, nnz)
        limit = _memory_limit(config, workers)
        # threads of this process: the memory manager off while they are made (NO_MEMORY_MANAGER)
        with dask.config.set(NO_MEMORY_MANAGER if threads else {}):
            cluster = LocalCluster(
                n_workers=workers,
                processes=not threads,
                threads_per_worker=config.threads_per_worker + 1,
                resources={COMPUTE: config.threads_per_worker},
                **({"memory_limit": limit} if limit else {}),
                **_dashboard_options(config),
            )
        client = Client(cluster)
    _set_up(client, config)
    return client


class IgnoreCtrlC(WorkerPlugin):
    """Worker processes of a local cluster ignore SIGINT. A terminal's Ctrl-C goes to the
    whole process group, and each worker's KeyboardInterrupt traceback (60-100 lines in
    all) buried the command's one line; this process closes the workers instead. Workers
    that are threads of this process are left alone."""

    name = "cumf-dask-ignore-ctrl-c"

    def __init__(self) -> None:
        self.owner = os.getpid()

    def setup(self, worker: Any) -> None:
        if os.getpid() != self.owner and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _set_up(client: Client, config: ClusterConfig) -> None:
    """CumfWorkerSetup and IgnoreCtrlC on the workers of a local cluster just started.
    Worker processes that cluster.memory_limit is too small for are killed by their nannies
    as they start, and the registration then fails with a closed connection: one
    DeviceMemoryError instead, and the cluster closed."""
    try:
        client.register_plugin(CumfWorkerSetup())
        client.register_plugin(IgnoreCtrlC())
    except Exception:
        killed = _restarted_for_memory(client)
        _close(client)
        if not killed:
            raise
        raise DeviceMemoryError(
            f"cluster.memory_limit {config.memory_limit} is too small for a worker process: "
            f"the workers were killed for memory as they started (one used {killed / 1e6:.0f} "
            "MB, past the limit's terminate threshold); give each 1GB or more, or remove "
            "cluster.memory_limit"
        ) from None


def _restarted_for_memory(client: Client) -> int:
    """The process memory of a worker its nanny restarted for memory, else 0 (asked twice:
    the nanny's event may come just after the failure it caused)."""
    for attempt in range(2):
        with suppress(Exception):
            events = client.sync(client.scheduler.events, topic="worker-restart-memory",
                                 callback_timeout=10)  # fmt: skip
            if events:
                return max(int(event.get("rss") or 1) for _, event in events)
        if attempt == 0:
            time.sleep(0.5)
    return 0


def _close(client: Client) -> None:
    """Close `client` and the local cluster it started, if any."""
    cluster = client.cluster
    client.close()
    if cluster is not None:
        cluster.close()


def _join(address: str) -> Client:
    """A Client of the Dask scheduler at `address` (cluster.address), or one ConfigError
    saying why not, within about JOIN_S seconds whatever answers there.

    Dask's connect timeout covers the TCP connect only: a peer that accepts and then says
    nothing (a web server, such as the Dask dashboard) would hold Client() for ever, and one
    that greets in its own protocol (an SSH server) makes Dask allocate exabytes for a frame
    count (a MemoryError, not this machine's). So the address is first asked who it is, on a
    loop of its own and under a deadline; only a Dask scheduler gets a Client.
    """
    _check_address(address)
    start = time.monotonic()
    with ThreadPoolExecutor(1) as pool:  # a loop of its own even where this thread has one
        try:
            kind = pool.submit(asyncio.run, _identify(address)).result()
        except asyncio.TimeoutError:  # the TCP connect's own timeout is an OSError (below)
            raise ConfigError(
                f"cluster.address {address}: something accepts connections there but does "
                f"not answer as a Dask scheduler within {1.1 * JOIN_S:.0f} s (a web server "
                "does that, such as the Dask dashboard, usually port 8787; the scheduler "
                "is usually port 8786); give the scheduler's address, or remove "
                "cluster.address to run locally"
            ) from None
        except Exception as exc:
            raise _not_joined(address, exc) from None
    if kind != "Scheduler":
        raise ConfigError(
            f"cluster.address {address} is a Dask {kind or 'peer of an unknown kind'}, not a "
            "scheduler; give the scheduler's address (`dask scheduler` prints it; usually "
            "port 8786), or remove cluster.address to run locally"
        )
    client = Client.__new__(Client)  # made in two steps, so that a failed start is closed
    try:
        client.__init__(address, timeout=max(1.1 * JOIN_S - (time.monotonic() - start), 5.0))
    except Exception as exc:
        with suppress(Exception):
            client.close(timeout=1)
        raise _not_joined(address, exc) from None
    return client  # a user's cluster: fits pin its BLAS threads for their duration only


async def _identify(address: str) -> str | None:
    """The kind of Dask server at `address` ("Scheduler", "Worker", "Nanny"), from its
    handshake and its identity, within 1.1 JOIN_S seconds (JOIN_S for the TCP connect)."""
    from distributed.comm import connect
    from distributed.security import Security

    async def ask() -> str | None:
        args = Security().get_connection_args("client")
        comm = await connect(address, timeout=JOIN_S, **args)
        try:
            await comm.write({"op": "identity", "reply": True})
            reply = await comm.read()
        finally:
            comm.abort()
        return str(reply.get("type")) if isinstance(reply, dict) else None

    return await asyncio.wait_for(ask(), 1.1 * JOIN_S)


def _not_joined(address: str, exc: Exception) -> ConfigError:
    """The error for joining `address` failed with `exc`: nothing there (OSError), else
    something that is not a Dask scheduler (a MemoryError: a greeting in another protocol
    read as a Dask frame count)."""
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if address.startswith("inproc://"):
        return ConfigError(
            f"cluster.address {address}: no scheduler of this process is there ({detail}); "
            "an inproc:// address is reachable only from inside the process that runs its "
            "scheduler: give the scheduler's tcp:// address"
        )
    if isinstance(exc, OSError):
        return ConfigError(
            f"cluster.address: no Dask scheduler answers at {address} ({exc}); start one with "
            "`dask scheduler` or remove cluster.address to run locally"
        )
    return ConfigError(
        f"cluster.address {address}: what answers there is not a Dask scheduler (Dask could "
        f"not read its reply: {type(exc).__name__}); give the scheduler's address (`dask "
        "scheduler` prints it; usually port 8786), or remove cluster.address to run locally"
    )


def _check_address(address: str) -> None:
    """A scheduler address Dask can parse and this process can connect to (a known scheme;
    a port for tcp and tls; distributed-ucxx for ucx, a TLS config for tls), else a
    ConfigError: checked before anything connects, as Dask's errors for these are
    tracebacks."""
    from distributed.comm.addressing import parse_address, parse_host_port
    from distributed.comm.registry import get_backend
    from distributed.security import Security

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
    if scheme == "ucx" and not has_module("distributed_ucxx"):
        raise ConfigError(
            f"cluster.address {address} is a UCX address but distributed-ucxx is not "
            "installed: pip install 'cumf-dask[gpu]' (it brings distributed-ucxx-cu13), or "
            "give the scheduler's tcp:// address"
        )
    if scheme in ("tls", "wss") and Security().get_connection_args("client")["ssl_context"] is None:
        raise ConfigError(
            f"cluster.address {address} is a TLS address but Dask has no TLS config: set "
            "distributed.comm.tls.ca-file, distributed.comm.tls.client.cert and .key in Dask's "
            "config (or DASK_DISTRIBUTED__COMM__TLS__... variables), or give a tcp:// address"
        )


@contextmanager
def cluster_client(config: ClusterConfig | None = None, nnz: int | None = None) -> Iterator[Client]:
    """make_client as a context: the client and any cluster it started are closed after;
    after an error or a Ctrl-C, without waiting for the NumPy tasks that workers running as
    threads of this process are in the middle of (numpy_backend.STOPPING)."""
    client = make_client(config, nnz)
    try:
        yield client
    except BaseException:
        STOPPING.set()
        try:
            _close(client)
        finally:
            STOPPING.clear()
        raise
    _close(client)


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
        kwargs["CUDA_VISIBLE_DEVICES"] = child_visible_devices(config.devices)
    elif config.n_workers:
        kwargs["n_workers"] = config.n_workers
    gpus = len(gpu_ids(config))
    limit = _memory_limit(config, gpus)
    if limit:
        kwargs["memory_limit"] = limit
    ucx = cuda_protocol(config.protocol, gpus) == "ucx"
    pool = rmm_pool(config, ucx)
    if pool:  # CuPy allocates from it too: one pool for the kernels and the transfers
        kwargs["rmm_pool_size"] = pool
        kwargs["rmm_allocator_external_lib_list"] = ["cupy"]
    if ucx:
        kwargs.update(protocol="ucx", enable_nvlink=True, enable_tcp_over_ucx=True)
        _log.info("GPU workers talk over UCX (NVLink), RMM pool of %s each", pool or "none")
    return LocalCUDACluster(**kwargs, **_dashboard_options(config))


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


def _dashboard_options(config: ClusterConfig) -> dict[str, Any]:
    """A local cluster's dashboard arguments. null: no dashboard; the scheduler still serves
    Dask's health and metrics routes over HTTP (as ``dask scheduler --no-dashboard`` does),
    on a free port (:func:`_dashboard`)."""
    options: dict[str, Any] = {"dashboard_address": _dashboard(config)}
    if config.dashboard_address is None:
        options["scheduler_kwargs"] = {"dashboard": False}
    return options


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
    of memory per CPU worker, or cluster.memory_limit, up to Dask's pause threshold for
    worker processes (:func:`plan_memory`); each GPU's memory from NVML, with no CUDA
    context). Not for cluster.address: a running cluster is asked through a client."""
    backend = resolve_backend_name(config.backend)
    if backend == "numpy":
        _warn_gpu_keys(config)
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
    workers, threads = cpu_workers(config), in_process(config, nnz)
    limit = _host_limit(config, workers)
    pause = False if threads else dask.config.get("distributed.worker.memory.pause")
    memory = below_pause(limit, pause, WORKER_PROCESS_BYTES)
    return Resources(backend, workers, memory, "inproc" if threads else "tcp")


def _warn_gpu_keys(config: ClusterConfig) -> None:
    """A CumfWarning naming the GPU workers' keys set in `config` when the workers are CPU
    ones, which ignore them."""
    keys = [f"cluster.{key} {value}" for key, value in (
        ("protocol", config.protocol if config.protocol == "ucx" else None),
        ("devices", config.devices), ("rmm_pool_size", config.rmm_pool_size),
    ) if value is not None]  # fmt: skip
    if keys:
        backend = "auto (no GPU is visible here)" if config.backend == "auto" else config.backend
        verb, them = ("is", "it") if len(keys) == 1 else ("are", "them")
        warn(f"{' and '.join(keys)} {verb} for GPU workers, and cluster.backend {backend} "
             f"runs CPU workers, which ignore {them}: set cluster.backend: cupy on a machine "
             f"with a GPU, or remove {them}")


def _memory_limit(config: ClusterConfig, workers: int, warn_capped: bool = False) -> int | None:
    """cluster.memory_limit in bytes for each of `workers` local workers, None when not set:
    at most the machine's memory shared by them (Dask caps each worker alone at all of it,
    which would promise `workers` times the machine). `warn_capped`: a CumfWarning when
    capped."""
    if not config.memory_limit:
        return None
    from distributed.system import MEMORY_LIMIT

    asked, share = parse_size(config.memory_limit), MEMORY_LIMIT // max(workers, 1)
    if asked > share and warn_capped:
        warn(f"cluster.memory_limit {config.memory_limit} for each of {workers} workers is more "
             f"than this machine's {MEMORY_LIMIT / 1e9:.2f} GB of memory: each worker gets "
             f"{share / 1e9:.2f} GB, its share")
    return min(asked, share)


def _host_limit(config: ClusterConfig, workers: int) -> int:
    """The memory limit each of `workers` local workers gets: cluster.memory_limit (capped,
    with a warning: :func:`_memory_limit`), else the system's memory shared by them
    (LocalCluster's and LocalCUDACluster's default)."""
    from distributed.worker_memory import parse_memory_limit

    limit = _memory_limit(config, workers, warn_capped=True) or parse_memory_limit(
        "auto", 1, workers, logger=_log
    )
    if not limit:
        import psutil

        limit = int(psutil.virtual_memory().total / workers)
    return int(limit)


def client_resources(client: Client, backend: str) -> Resources:
    """The Resources of a running cluster's workers (`backend` as the config names it)."""
    backend = backend_on(client, backend)
    return Resources(backend, len(worker_addresses(client)), plan_memory(client, backend),
                     transport(client), host_memory(client, backend))  # fmt: skip


def worker_addresses(client: Client) -> list[str]:
    """Worker addresses in a stable order (by name, then address): the placement index that
    plan.groups and the NVML groups (GPU i) name."""
    info = workers_info(client)
    return [a for a, _ in sorted(info.items(), key=_worker_order)]


def _worker_order(item: tuple[str, dict[str, Any]]) -> tuple[Any, ...]:
    """Sort key of a worker (address, info): integer names by number, before other names
    by text (dask-cuda names the worker on GPU k k; as text, 10 would sort before 2)."""
    address, info = item
    name = info.get("name")
    if isinstance(name, int) and not isinstance(name, bool):
        return (0, name, "", address)
    return (1, 0, str(name), address)


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


def direct_to_workers(client: Client) -> bool:
    """Whether this process fetches results from the workers themselves rather than through
    the scheduler (Dask's default for a client): as the client asks (``direct_to_workers``),
    else when its cluster is a local one, whose workers this machine reaches. A 6.3 GB factor
    came from a GPU worker at 2.2-2.5 GB/s directly, 0.9 GB/s through the scheduler."""
    if client.direct_to_workers is not None:
        return bool(client.direct_to_workers)
    return getattr(client, "cluster", None) is not None


def plan_memory(client: Client, backend: str) -> int:
    """The smallest worker's memory that a plan may fill: GPU memory on GPU workers; on CPU
    workers the memory limit, or where Dask's memory manager pauses a worker past a fraction
    of its limit (worker processes), that fraction less what the process already takes
    (:func:`below_pause`; 0 or less: nothing is left for data). A plan sized to the whole
    limit would pause the worker midway and fail (WorkersPaused)."""
    if backend == "cupy":
        return worker_memory(client, backend)
    rooms = list(client.run(_pause_room, on_error="return").values())
    if not rooms or any(not isinstance(room, int) for room in rooms):  # no limit, or gone
        return worker_memory(client, backend)
    return min(rooms)


def below_pause(limit: int, pause: float | bool | None, taken: int) -> int:
    """Memory a plan may fill under a `limit` that Dask pauses a worker at a `pause` fraction
    of (False or None: it never does), beside the `taken` bytes the process already uses."""
    if pause is False or pause is None:
        return int(limit)
    return int(pause * limit) - int(taken)


def _pause_room(dask_worker: Any) -> int | None:
    """This worker's :func:`below_pause` room; None without a memory limit."""
    manager = dask_worker.memory_manager
    if not manager.memory_limit:
        return None
    return below_pause(manager.memory_limit, manager.memory_pause_fraction,
                       dask_worker.monitor.get_process_memory())  # fmt: skip


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


# why a worker closed, as it logs it, when it was closed on purpose (a cluster scaled down,
# a worker retired or closed): no nanny brings it back (a restart or a kill for memory logs
# "nanny-restart", "nanny-kill" or nothing)
_CLOSED_ON_PURPOSE = {"nanny-close", "nanny-close-gracefully", "worker-close",
                      "worker-close-gracefully"}  # fmt: skip


def retired(client: Client, workers: list[str]) -> bool:
    """Whether each of `workers` was closed on purpose (the scheduler's event log says so),
    so that no replacement is coming."""

    def on_purpose(event: dict[str, Any]) -> bool:
        return event.get("action") == "retired" or (
            event.get("action") == "closing-worker" and event.get("reason") in _CLOSED_ON_PURPOSE)

    try:
        return bool(workers) and all(
            any(on_purpose(event) for _, event in client.get_events(worker)) for worker in workers
        )
    except Exception:  # no event log to ask: wait for a replacement as for any loss
        return False


def process_memory(client: Client) -> int:
    """The largest worker process's memory in bytes as the scheduler last heard it (what
    Python, Dask and the libraries take before any data: a CPU plan must fit beside it)."""
    info = workers_info(client).values()
    return max((int((w.get("metrics") or {}).get("memory") or 0) for w in info), default=0)


def backend_on(client: Client, name: str) -> str:
    """A backend name resolved where the work runs: 'auto' is cupy only if every worker
    sees a GPU (a CPU login node may drive GPU workers, or the reverse); 'cupy' on workers
    without one is a ConfigError (else a ModuleNotFoundError from the first GPU task)."""
    if name not in ("auto", "cupy"):
        return resolve_backend_name(name)
    found = client.run(has_cuda)
    if name == "auto":
        return "cupy" if found and all(found.values()) else "numpy"
    without = [address for address, cuda in found.items() if not cuda]
    if without:
        more = f" and {len(without) - 3} more" if len(without) > 3 else ""
        raise ConfigError(
            f"backend='cupy' (cluster.backend: cupy) but worker(s) {', '.join(without[:3])}"
            f"{more} have no CUDA GPU with CuPy: use backend='numpy' or 'auto', or run on "
            "GPU workers"
        )
    return "cupy"
