"""Worker loss and memory limits on real worker processes (issue 12): a SIGKILLed worker is
replaced by its nanny under a new address and the fit goes on, giving the same model (a
configured job, as `cumf-dask train` runs it, and ALS.fit given the client); a worker
restarted or paused for memory ends the fit with DeviceMemoryError (CLI exit 4) in bounded
time, never a hang.

The cluster is the one `cumf-dask train` starts (cumf_dask.engine.cluster.make_client: a
LocalCluster of worker processes under nannies, with the compute resource), shared by the
module's tests (starting one takes seconds); each test leaves it as it found it. GPU
versions at the end (skipped without CUDA).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import numpy as np
import pytest
from conftest import HAS_CUDA, random_ratings, rel_err
from reference import reference_als

from cumf_dask.checkpoint import BackgroundSaves
from cumf_dask.config import ClusterConfig, load_config
from cumf_dask.data.spill import build_store
from cumf_dask.engine import watch
from cumf_dask.engine.cluster import (
    cluster_client,
    plan_memory,
    wait_for_workers,
    worker_addresses,
    workers_info,
)
from cumf_dask.errors import CumfWarning, DeviceMemoryError, HostMemoryError
from cumf_dask.factors import init_factor
from cumf_dask.model import ALS
from cumf_dask.pipeline import train

pytestmark = [pytest.mark.cluster]
M, N, F, LAM = 80, 50, 4, 0.05


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rows, cols, vals = random_ratings(M, N, 0.15, seed=8)
    store = build_store(str(tmp_path_factory.mktemp("loss") / "r.zarr"), rows, cols, vals,
                        shape=(M, N))  # fmt: skip
    return store, (rows, cols, vals)


def reference(data, iterations):
    rows, cols, vals = data[1]
    return reference_als(rows, cols, vals, (M, N), init_factor(N, F, 0), LAM, iterations)


@pytest.fixture(scope="module")
def procs():
    """cumf-dask's own cluster: two worker processes, each under a nanny (in this process)."""
    config = ClusterConfig(backend="numpy", n_workers=2, memory_limit="1GB",
                           dashboard_address=None)  # fmt: skip
    with cluster_client(config) as client:
        yield client



def test_workers_are_asked_of_the_scheduler_not_the_client_cache(client2, monkeypatch):
    """The client's periodic refresh caches no per-worker records. Read between a fetch and
    the read, that cache made every worker seem lost at once (a CI failure). Here the cache
    is left without them: the engine's view of the workers still has both."""

    async def stale(**_):
        client2._scheduler_identity = {"workers": {}}

    monkeypatch.setattr(client2, "_update_scheduler_info", stale)
    assert client2.scheduler_info(n_workers=-1)["workers"] == {}
    assert len(workers_info(client2)) == 2 and len(worker_addresses(client2)) == 2

def _ignores_ctrl_c() -> bool:
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN


# (a shell starts a background job ignoring SIGINT: then so did this process, before any test)
IGNORED_AT_START = _ignores_ctrl_c()


def test_worker_processes_leave_ctrl_c_to_this_process(procs):
    """A terminal's Ctrl-C reaches every process of the group: the workers ignore it (their
    tracebacks buried the command's one line), and this process, which closes them, not."""
    assert all(procs.run(_ignores_ctrl_c).values())
    assert _ignores_ctrl_c() is IGNORED_AT_START


def test_worker_processes_are_planned_below_their_pause_threshold(procs):
    """A plan sized to the memory limit paused its worker at Dask's 80% and failed midway:
    a plan gets 80% of the limit less what the worker process already takes."""
    taken = procs.run(lambda dask_worker: dask_worker.monitor.get_process_memory())
    room = plan_memory(procs, "numpy")
    assert 0.5e9 < room < 0.8e9 - 20e6
    assert abs(room - (0.8e9 - max(taken.values()))) < 50e6  # its memory drifts between reads


def test_worker_processes_with_no_room_below_the_pause_are_refused(procs, data, monkeypatch):
    """Processes already at Dask's pause threshold: one memory error at once, not a plan."""
    from cumf_dask.engine import fit

    monkeypatch.setattr(fit, "plan_memory", lambda client, backend: 0)
    with pytest.raises(DeviceMemoryError, match=r"almost\) no memory left for data: Dask "
                       r"pauses a worker at 80% of its memory limit \(1000 MB\)"):  # fmt: skip
        ALS(F, LAM, 1, backend="numpy").fit(data[0], client=procs)


def test_killed_worker_is_replaced_and_the_fit_goes_on(procs, data):
    pids = procs.run(os.getpid)
    victim = sorted(pids)[0]
    killed: list[str] = []

    def kill_after_first_iteration(record):
        if not killed:
            killed.append(victim)
            os.kill(pids[victim], signal.SIGKILL)

    started = time.perf_counter()
    with pytest.warns(CumfWarning, match=rf"worker {victim} was lost during iteration 2"
                      r"( \([^)]+\))?; going on on 2 worker\(s\) from the first "
                      "iteration"):  # fmt: skip
        model = ALS(F, LAM, 3, backend="numpy", callbacks=[kill_after_first_iteration]).fit(
            data[0], client=procs
        )
    assert time.perf_counter() - started < 60
    X, T = reference(data, 3)
    assert rel_err(model.user_factors_, X) < 1e-4 and rel_err(model.item_factors_, T) < 1e-4
    assert [r["iteration"] for r in model.metrics_] == [1, 2, 3]
    assert len(wait_for_workers(procs, 2, 30)) == 2


def test_killed_worker_in_a_configured_job_goes_on_from_its_checkpoint(data, tmp_path, procs,
                                                                       monkeypatch):  # fmt: skip
    """pipeline.train, as `cumf-dask train` runs it: the fit goes on from a checkpoint.
    Every iteration is saved here (none skipped while the one before is written): when
    iteration 2's callback runs, checkpoint 1 is written and checkpoint 2 is being written
    (on a thread); the fit goes back to 2 if that save ended before the loss, else to 1."""
    monkeypatch.setattr(BackgroundSaves, "busy", lambda self: False)
    config = load_config(data={
        "data": {"source": "store", "store": data[0].url},
        "model": {"factors": F, "regularization": LAM, "iterations": 4},
        "output": {"dir": str(tmp_path / "runs"), "name": "loss"},
    })  # fmt: skip
    pids = procs.run(os.getpid)
    killed: list[int] = []

    def kill_a_worker(record):
        if record["iteration"] == 2 and not killed:  # (a recovery from 1 reports 2 again)
            killed.append(pids[sorted(pids)[1]])
            os.kill(killed[0], signal.SIGKILL)

    with pytest.warns(CumfWarning, match=r"was lost during iteration 3( \([^)]+\))?; going on on "
                      r"2 worker\(s\) from checkpoint [12]"):  # fmt: skip
        result = train(config, client=procs, on_iteration=kill_a_worker, log=lambda _: None)
    X, T = reference(data, 4)
    model = result.model
    assert rel_err(model.user_factors_, X) < 1e-4 and rel_err(model.item_factors_, T) < 1e-4
    lines = (result.run.path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [1, 2, 3, 4]
    assert len(wait_for_workers(procs, 2, 30)) == 2


def test_a_fit_recovering_on_other_workers_plans_again(data):
    """The two-phase reduction's groups name workers by their place in the list: on more
    workers the new one's partial sums were in no group and left out (a wrong model, exit 0),
    on fewer a group could point past the list's end. The fit plans again for the workers
    present. Here 2 workers become 4, then one is lost: the fit goes on on 3."""
    from distributed import Client, LocalCluster

    from cumf_dask.config import PlanConfig

    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                           dashboard_address=None)  # fmt: skip
    lost: list[str] = []

    def grow_then_lose_one(record):
        if not lost:
            cluster.scale(4)
            client.wait_for_workers(4, timeout=30)
            lost.append(sorted(cluster.workers)[0])
            cluster.sync(cluster.workers[lost[0]].close)

    plan = PlanConfig(p=3, q=2, reduction="two-phase", groups=[[0], [1]])
    fit = ALS(F, LAM, 3, backend="numpy", plan=plan, callbacks=[grow_then_lose_one]).fit
    client = Client(cluster, set_as_default=False)
    with cluster, client, pytest.warns(CumfWarning) as warned:
        model = fit(data[0], client=client)
    said = " ".join(str(w.message) for w in warned)
    assert "was lost during iteration 2; going on on 3 worker(s)" in said
    assert "plan.groups [[0], [1]] named 2 workers and 3 are left" in said
    X, T = reference(data, 3)
    assert rel_err(model.user_factors_, X) < 1e-4 and rel_err(model.item_factors_, T) < 1e-4
    assert model.plan_.workers == 3


def test_a_cluster_scaled_down_mid_fit_goes_on_at_once(data):
    """A worker closed on purpose (the cluster scaled down) is not waited for: the fit goes
    on on the workers left at once, not after REPLACE_S seconds."""
    from distributed import Client, LocalCluster

    from cumf_dask.engine.fit import REPLACE_S

    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                           dashboard_address=None)  # fmt: skip

    def scale_down(record):
        if len(cluster.workers) == 2:
            cluster.scale(1)

    client = Client(cluster, set_as_default=False)
    with cluster, client, pytest.warns(CumfWarning, match="going on on 1 worker"):
        began = time.monotonic()
        model = ALS(F, LAM, 3, backend="numpy", callbacks=[scale_down]).fit(data[0], client=client)
        assert time.monotonic() - began < REPLACE_S / 2
    X, _ = reference(data, 3)
    assert rel_err(model.user_factors_, X) < 1e-4 and model.plan_.workers == 1


def test_worker_restarted_for_memory_fails_with_a_plan(procs, data):
    """What a memory limit too small for the plan does: the nanny restarts the worker past
    its limit, again and again. DeviceMemoryError (exit 4) in bounded time, not a hang."""
    victim = sorted(procs.run(os.getpid))[0]
    # LocalCluster's nannies live in this process: set the victim's nanny limit directly
    [nanny] = [w for w in procs.cluster.workers.values() if w.worker_address == victim]

    def squeeze(record):  # from now on the victim's nanny restarts it at once, again and again
        nanny.memory_manager.memory_limit = 10_000_000
        deadline = time.time() + 10  # until it does once: the queued iterations 2 and 3 of
        while time.time() < deadline and victim in workers_info(procs):  # tiny data could
            time.sleep(0.02)  # end before the nanny's next memory check

    started = time.perf_counter()
    try:
        with pytest.raises(DeviceMemoryError, match=rf"^worker {victim} was killed for memory: "
                           "its nanny restarted it when its process used \\d+ MB, past the "
                           "memory limit's terminate threshold; "):  # fmt: skip
            ALS(F, LAM, 3, backend="numpy", callbacks=[squeeze]).fit(data[0], client=procs)
        assert time.perf_counter() - started < 30
    finally:
        nanny.memory_manager.memory_limit = 1_000_000_000
        assert len(wait_for_workers(procs, 2, 30)) == 2


def test_worker_paused_for_memory_fails_with_a_plan(procs, data, monkeypatch):
    """A worker past Dask's pause threshold runs nothing: DeviceMemoryError, not a hang."""
    monkeypatch.setattr(watch, "PAUSED_S", 1.0)
    victim = sorted(procs.run(os.getpid))[1]

    def pause_at(dask_worker, fraction):
        dask_worker.memory_manager.memory_pause_fraction = fraction

    def squeeze(record):  # paused before this returns: the queued iteration 2 may be done,
        # and iteration 3 (queued next) must find the worker paused
        procs.run(pause_at, fraction=0.001, workers=[victim])
        deadline = time.time() + 10
        while time.time() < deadline and (
            workers_info(procs)[victim]["status"] != "paused"
        ):
            time.sleep(0.05)

    started = time.perf_counter()
    try:
        with pytest.raises(DeviceMemoryError, match=rf"^worker {victim} ran out of memory \(its "
                           r"process uses \d+ MB of its 1000 MB memory limit and it has run "
                           r"nothing for \d s\); "):  # fmt: skip
            ALS(F, LAM, 3, backend="numpy", callbacks=[squeeze]).fit(data[0], client=procs)
        assert time.perf_counter() - started < 20
    finally:
        procs.run(pause_at, fraction=0.8)
    deadline = time.time() + 10
    while time.time() < deadline and any(
        w["status"] != "running" for w in workers_info(procs).values()
    ):
        time.sleep(0.2)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and cupy")
def test_gpu_worker_killed_on_a_local_cuda_cluster(data):
    from dask_cuda import LocalCUDACluster
    from distributed import Client

    with LocalCUDACluster(n_workers=1, dashboard_address=None) as cluster, Client(cluster) as c:
        pids = c.run(os.getpid)
        killed: list[int] = []

        def kill(record):
            if not killed:
                killed.append(1)
                os.kill(next(iter(pids.values())), signal.SIGKILL)

        with pytest.warns(CumfWarning, match=r"was lost during iteration 2( \([^)]+\))?; going on"):
            model = ALS(F, LAM, 3, backend="cupy", callbacks=[kill]).fit(data[0], client=c)
    X, T = reference(data, 3)
    assert rel_err(model.user_factors_, X) < 1e-3 and rel_err(model.item_factors_, T) < 1e-3


class OutOfMemoryError(MemoryError):
    """Like CuPy's: a constructor that its pickled args cannot call."""

    def __init__(self, size, total, limit):
        super().__init__(f"allocating {size} bytes ({total} so far, limit {limit})")


def _allocate() -> None:
    from cumf_dask.errors import out_of_memory_as

    with out_of_memory_as("building a block", "plan smaller"):
        raise OutOfMemoryError(12, 24, 32)


def test_out_of_memory_in_a_task_reaches_the_client_as_device_memory_error(client2):
    """Dask pickles a task's error to the client: it must arrive as DeviceMemoryError (what
    fit() turns into a plan that fits), not as a bare Exception carrying its text."""
    error = client2.submit(_allocate, pure=False).exception()
    assert type(error) is DeviceMemoryError
    assert "allocating 12 bytes" in str(error) and error.__context__ is None


def test_the_plan_that_fits_changes_a_forced_q_too(tmp_path):
    """Out of memory with plan.q forced: the advice sets each half-step's q (they override
    plan.q), so doing what it says plans; it used to name the budget alone, and the forced
    q then failed to fit it."""
    from types import SimpleNamespace

    from cumf_dask.config import HalfStepConfig, PlanConfig
    from cumf_dask.engine.fit import suggest_plan
    from cumf_dask.engine.plan import make_plan

    rows, cols, vals = random_ratings(200, 50, 0.3, seed=4)
    store = build_store(str(tmp_path / "r.zarr"), rows, cols, vals, shape=(200, 50))
    counts = store.counts("row"), store.counts("col")
    user = PlanConfig(q=2)
    plan = make_plan(200, 50, store.nnz, 128, 2, 10**10, *counts, user)
    advice = suggest_plan(SimpleNamespace(store=store, plan=plan, client=None), 10**10,
                          2_000_000, user)  # fmt: skip
    told = dict(re.findall(r"--set plan\.(\S+)=(\S+)", advice))
    assert set(told) == {"memory_budget", "x.q", "theta.q"}, advice
    sides = {s: HalfStepConfig(q=int(told[f"{s}.q"])) for s in ("x", "theta")}
    rerun = make_plan(200, 50, store.nnz, 128, 2, 10**10, *counts,
                      PlanConfig(q=2, memory_budget=told["memory_budget"], **sides))  # fmt: skip
    assert (rerun.x.q, rerun.theta.q) == (sides["x"].q, sides["theta"].q)


def test_host_memory_that_cannot_be_locked_gets_a_plan_off_host(tmp_path, monkeypatch):
    """Page-locked host memory running out (R or a factor in pinned host memory): the plan
    suggested keeps R in the store and both factors on the GPUs, in the same GPU budget; a
    smaller GPU budget would only put more in host memory."""
    from types import SimpleNamespace

    from cumf_dask.config import PlanConfig
    from cumf_dask.engine import fit
    from cumf_dask.engine.plan import make_plan

    monkeypatch.setattr(fit, "host_memory", lambda client, backend: 10**9)  # no cluster here
    rows, cols, vals = random_ratings(2000, 300, 0.05, seed=4)
    store = build_store(str(tmp_path / "r.zarr"), rows, cols, vals, shape=(2000, 300))
    counts = store.counts("row"), store.counts("col")
    user = PlanConfig(blocks="host", factors="host")
    plan = make_plan(2000, 300, store.nnz, 16, 1, 10**8, *counts, user, "cupy",
                     host_memory=10**9)  # fmt: skip
    assert plan.blocks == "host" and plan.host_factor is not None
    advice = fit.suggest_plan(SimpleNamespace(store=store, plan=plan, client=None), 10**8,
                              plan.budget, user, off_host=True)  # fmt: skip
    told = dict(re.findall(r"--set plan\.(\S+)=(\S+)", advice))
    assert told == {"blocks": "store", "factors": "device"}, advice
    rerun = make_plan(2000, 300, store.nnz, 16, 1, 10**8, *counts,
                      PlanConfig(blocks="store", factors="device"), "cupy")  # fmt: skip
    assert rerun.blocks == "store" and rerun.host_factor is None
    failed = HostMemoryError("a worker ran out of memory locking 8,388,608 bytes")
    said = str(fit._out_of_memory(failed, SimpleNamespace(plan=rerun), 10**8, 0, None))
    assert said.endswith("this plan keeps R and the factors off host memory already: what "
                         "could not be locked is the decoding threads' staging buffers (raise "
                         "the locked-memory limit)")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and cupy")
def test_gpu_out_of_memory_mid_run_gives_a_plan_that_fits(clients, tmp_path):
    """A GPU allocation failing mid-run: DeviceMemoryError (CLI exit 4) whose suggested
    memory budget then runs. A 32 MB limit on CuPy's pool stands in for a small GPU; the
    forced plan (blocks on the GPU, one batch) believes it has 8 GB, but the blocks of both
    orientations alone take 72 MB. The suggested plan keeps them in host memory."""
    import gc

    import cupy

    from cumf_dask.config import PlanConfig

    rows, cols, vals = random_ratings(50_000, 500, 0.12, seed=3)
    store = build_store(str(tmp_path / "big.zarr"), rows, cols, vals, shape=(50_000, 500))
    client = clients(1)  # in-process: the worker's pool is this process's
    limit = cupy.get_default_memory_pool().get_limit()
    gc.collect()  # the limit bounds what the pool takes from the GPU: what earlier tests left
    cupy.get_default_memory_pool().free_all_blocks()  # cached would be handed out beyond it
    cupy.get_default_memory_pool().set_limit(size=32 << 20)
    try:
        fits = r"a worker ran out of memory .* a plan that fits [\d.]+MB per worker is .*--set "
        forced = PlanConfig(memory_budget="8GB", q=1, blocks="device")
        with pytest.raises(DeviceMemoryError, match=fits + "plan.memory_budget=") as err:
            ALS(8, 0.05, 2, backend="cupy", plan=forced).fit(store, client=client)
        budget = str(err.value).split("plan.memory_budget=")[1].split(" ")[0]
        assert "--set plan.blocks=host" in str(err.value)  # the forced tier must change too
        del err  # its traceback holds the failed fit's device arrays
        gc.collect()
        model = ALS(8, 0.05, 2, backend="cupy",
                    plan=PlanConfig(memory_budget=budget, blocks="host"))  # fmt: skip
        assert np.isfinite(model.fit(store, client=client).user_factors_).all()
        assert model.plan_.blocks == "host"
    finally:
        cupy.get_default_memory_pool().set_limit(size=limit)


def test_fetching_results_from_a_lost_worker_raises_instead_of_waiting(client2):
    """Results whose worker is gone after they finished: WorkerLost within a poll or two,
    not a gather that waits forever on keys Dask would recompute on a vanished address."""
    slow = client2.submit(time.sleep, 3, pure=False)  # stands in for a result being fetched
    gone = watch.Watch(client2, ["tcp://192.0.2.1:1"])  # a placement worker no longer there
    started = time.perf_counter()
    values, lost = client2.sync(gone._fetch, [slow])
    assert (values, lost) == ([], ["tcp://192.0.2.1:1"])
    assert time.perf_counter() - started < 2.5
    client2.cancel(slow)
