"""Faults that must never give a wrong model, a hang or a traceback (issue 12), in process:
damaged checkpoints and models, non-finite factors, rating scales, writer locks, k, a full
disk, unwritable outputs, binary input and leftovers. Each asserts the exact outcome: the
same model as an uninterrupted run, or the exact error and exit code.

Worker loss and memory limits need real worker processes: tests/test_worker_loss.py.
"""

from __future__ import annotations

import errno
import gzip
import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from contextlib import nullcontext, suppress
from pathlib import Path

import numpy as np
import psutil
import pytest
import zarr
from conftest import BACKENDS, random_ratings

from cumf_dask import checkpoint as ck
from cumf_dask import locks, paths
from cumf_dask.backend.numpy_backend import NumpyBackend
from cumf_dask.cli import main
from cumf_dask.config import ClusterConfig, HalfStepConfig, PlanConfig, load_config
from cumf_dask.data import spill, synthetic
from cumf_dask.data.bands import init_store
from cumf_dask.data.ingest import ingest_arrays
from cumf_dask.data.planted import PlantedModel
from cumf_dask.data.spill import build_store
from cumf_dask.data.store import RatingsStore
from cumf_dask.data.synthetic import generate
from cumf_dask.data.target import work_url
from cumf_dask.engine import cluster
from cumf_dask.engine.tasks import NonFiniteFactor, check_finite
from cumf_dask.errors import (
    ConfigError,
    CumfWarning,
    IngestError,
    NumericalError,
    StoreError,
    WorkerLostError,
)
from cumf_dask.evaluate import ranking_metrics
from cumf_dask.locks import OWNER, clear_dead_folders, owned_folder
from cumf_dask.model import ALS
from cumf_dask.pipeline import train

M, N = 60, 30


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """`cumf-dask ARGS` in this process: (exit code, stdout, stderr)."""
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, " ".join(err.split())  # rich wraps long lines: compare unwrapped


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rows, cols, vals = random_ratings(M, N, 0.25, seed=5)
    path = tmp_path_factory.mktemp("faults") / "r.zarr"
    return build_store(str(path), rows, cols, vals, shape=(M, N), test_fraction=0.2, split_seed=1)


@pytest.fixture(scope="module")
def reference(store, clients):
    """An uninterrupted 3-iteration fit: (X, Theta)."""
    model = ALS(3, 0.05, 3, backend="numpy", plan=PlanConfig(p=1, q=1))
    model.fit(store, client=clients(2))
    return model.user_factors_, model.item_factors_


def same(model, reference) -> None:
    np.testing.assert_allclose(model.user_factors_, reference[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.item_factors_, reference[1], rtol=1e-5, atol=1e-6)


def fitted(store, f=3, seed=0) -> ALS:
    """A model with random factors (no cluster needed to test files and recommend)."""
    rng = np.random.default_rng(seed)
    model = ALS(f, 0.05, 1, backend="numpy")
    model.user_factors_ = rng.standard_normal((store.m, f)).astype(np.float32)
    model.item_factors_ = rng.standard_normal((store.n, f)).astype(np.float32)
    model.shape_, model.metrics_, model._store = (store.m, store.n), [], store
    model.user_ids_ = model.item_ids_ = None  # the store's ids are indices
    model.store_url_ = store.url
    return model


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def owner(pid: int, host: str | None = None) -> dict:
    started = psutil.Process(pid).create_time() if psutil.pid_exists(pid) else None
    return {"pid": pid, "host": host or socket.gethostname(), "started": started,
            "command": "cumf-dask ingest x.csv", "token": "other", "time": time.time()}  # fmt: skip


# ----------------------------------------------------------------------------- models


def damage(path: Path, how: str) -> None:
    """Break a saved model or checkpoint the ways disks and people do."""
    chunk = path / "user_factors" / "c" / "0" / "0"
    if how == "deleted chunk":
        chunk.unlink()
    elif how == "truncated chunk":
        chunk.write_bytes(chunk.read_bytes()[:20])
    elif how == "flipped bytes":
        data = bytearray(chunk.read_bytes())
        for i in range(len(data) // 2, len(data) // 2 + 4):
            data[i] ^= 0xFF
        chunk.write_bytes(bytes(data))
    elif how == "deleted array metadata":
        (path / "item_factors" / "zarr.json").unlink()
    elif how == "deleted group metadata":
        (path / "zarr.json").unlink()


DAMAGE = {
    "deleted chunk": "chunk file user_factors/c/0/0 is missing (Zarr would read it as zeros)",
    "truncated chunk": "chunk user_factors/c/0/0 cannot be decoded",
    "flipped bytes": "chunk user_factors/c/0/0",  # ... does not match its checksum, or undecodable
    "deleted array metadata": "array 'item_factors' is missing (item_factors/zarr.json deleted?)",
    "deleted group metadata": "its zarr.json (the group's metadata) is missing",
}


@pytest.mark.parametrize("how", list(DAMAGE))
def test_damaged_model_is_one_clear_error(store, tmp_path, capsys, how):
    path = tmp_path / "m.zarr"
    fitted(store).save(path)
    damage(path, how)
    with pytest.raises(StoreError, match="damaged model") as err:
        ALS.load(path)
    assert DAMAGE[how] in str(err.value) and str(err.value).endswith("; train it again")
    code, out, text = cli(capsys, "recommend", path, "--user", "1", "--json")
    assert code == 3 and json.loads(out)["exit_code"] == 3
    assert f"error: {path}: damaged model: {DAMAGE[how]}" in text


def test_digests_are_written_and_checked(store, tmp_path):
    model = fitted(store)
    model.save(tmp_path / "m.zarr")
    attrs = dict(zarr.open_group(str(tmp_path / "m.zarr"), mode="r").attrs)
    assert attrs["digest"] == "crc32" and attrs["version"] == ck.MODEL_VERSION
    assert attrs["digests"]["user_factors"] == ck.digests(model.user_factors_)
    np.testing.assert_array_equal(ALS.load(tmp_path / "m.zarr").user_factors_,
                                  model.user_factors_)  # fmt: skip


def test_damaged_newest_checkpoint_falls_back_and_resume_matches(store, client2, tmp_path,
                                                                 reference):  # fmt: skip
    ckpt = tmp_path / "ckpt"
    ALS(3, 0.05, 2, backend="numpy", plan=PlanConfig(p=1, q=1), checkpoint_dir=str(ckpt)).fit(
        store, client=client2
    )
    damage(ckpt / "iter-00002", "deleted chunk")
    resumed = ALS(3, 0.05, 3, backend="numpy", plan=PlanConfig(p=1, q=1), checkpoint_dir=str(ckpt))
    with pytest.warns(CumfWarning, match=r"skipped 1 damaged checkpoint\(s\), resuming from "
                      r"iter-00001: .*iter-00002: damaged checkpoint: chunk file"):  # fmt: skip
        resumed.fit(store, client=client2, resume=True)
    assert [r["iteration"] for r in resumed.metrics_] == [1, 2, 3]
    same(resumed, reference)
    damage(ckpt / "iter-00003", "truncated chunk")
    damage(ckpt / "iter-00002", "deleted group metadata")
    with pytest.raises(StoreError, match="no intact checkpoint to resume from"):
        ck.Checkpointer(ckpt).latest()


def two_checkpoints(folder: Path) -> ck.Checkpointer:
    """A checkpoint folder holding iterations 1 and 2 of a 3 x 2 fit (no cluster needed)."""
    ckpt = ck.Checkpointer(folder)
    attrs = {"factors": 2, "m": 3, "n": 3, "regularization": 0.1, "iterations": 2, "seed": 0,
             "ratings": {"nnz": 5, "mean": 3.0}, "ids": {"rows": None, "cols": 7}}  # fmt: skip
    for it in (1, 2):
        factors = np.full((3, 2), it, np.float32)
        metrics = [{"iteration": k} for k in range(1, it + 1)]
        ckpt.save(it, {"user_factors": factors, "item_factors": factors},
                  {**attrs, "metrics": metrics})  # fmt: skip
    return ckpt


@pytest.mark.parametrize("backend", BACKENDS)
def test_factor_pieces_are_written_where_they_are(clients, backend, tmp_path, monkeypatch):
    """Each worker writes the chunks within its pieces, and a chunk across pieces is put
    together from their rows: the checkpoint reads back as the whole factor, each chunk's
    CRC in place; arrays in this process are written by threads, chunk by chunk."""
    from cumf_dask.engine import tasks
    from cumf_dask.engine.placement import Factor
    from cumf_dask.engine.session import FactorWrites

    monkeypatch.setattr(ck, "ROW_CHUNK", 7)
    client = clients(2)
    workers = sorted(client.scheduler_info()["workers"])
    X = np.random.default_rng(5).standard_normal((60, 3)).astype(np.float32)
    theta = np.random.default_rng(6).standard_normal((20, 3)).astype(np.float32)
    bounds = [0, 10, 14, 15, 41, 60]  # pieces within a chunk, across two and three chunks
    pieces = [(a, b, client.submit(tasks.to_backend, X[a:b], backend, workers=[workers[k % 2]]))
              for k, (a, b) in enumerate(itertools.pairwise(bounds))]  # fmt: skip
    owners = [workers[k % 2] for k in range(len(pieces))]
    writes = FactorWrites(Factor(60, 3, pieces, owners=owners), backend, dict.fromkeys(workers, 2))
    attrs = {"factors": 3, "m": 60, "n": 20, "regularization": 0.1, "iterations": 1, "seed": 0,
             "metrics": [{"iteration": 1}]}  # fmt: skip
    ckpt = ck.Checkpointer(tmp_path / "ckpt")
    ckpt.save(1, {"user_factors": writes, "item_factors": theta}, attrs,
              lambda collections: client.gather(client.compute(collections)))  # fmt: skip
    _, arrays = ckpt.load(1)
    np.testing.assert_array_equal(arrays["user_factors"], X)
    np.testing.assert_array_equal(arrays["item_factors"], theta)
    sums = zarr.open_group(str(tmp_path / "ckpt" / "iter-00001"), mode="r").attrs["digests"]
    assert sums["user_factors"] == ck.digests(X, 7) and len(sums["item_factors"]) == 3


def test_a_garbled_latest_pointer_falls_back_to_the_newest_checkpoint(tmp_path):
    ckpt = two_checkpoints(tmp_path / "ckpt")
    for garbled in (b"iter-0000", b"\0\0\0", b"iter-00007", b"\xff\xfeiter"):
        (tmp_path / "ckpt" / "LATEST").write_bytes(garbled)
        with pytest.warns(CumfWarning, match="LATEST names .*, not a checkpoint there"):
            assert ckpt.latest()[0] == 2


DROP = object()  # an attr to remove


def edit_json(path: Path, key: str, changes: dict) -> None:
    """Edit a zarr.json by hand: set entries of its `key` ("": the top), DROP removes one."""
    meta = json.loads(path.read_text())
    target = meta[key] if key else meta
    for name, value in changes.items():
        if value is DROP:
            target.pop(name)
        else:
            target[name] = value
    path.write_text(json.dumps(meta))


TAMPERED = {  # attrs edited by hand -> what the damage says
    "iteration": ({"iteration": 7}, "its attrs say iteration 7, 2 iterations' metrics"),
    "metrics": ({"metrics": [{"iteration": 1}]}, "its attrs say iteration 2, 1 iterations'"),
    "metrics 5": ({"metrics": 5}, "its attr 'metrics' is '5', not list"),
    "iteration null": ({"iteration": None}, "its attr 'iteration' is 'None', not int"),
    "ratings null": ({"ratings": None}, "its attr 'ratings' is 'None', not dict"),
    "ratings text": ({"ratings": {"nnz": "5"}}, "its attr 'ratings' is"),
    "ids null": ({"ids": None}, "its attr 'ids' is 'None', not dict"),
    "store_ratings": ({"store_ratings": 3}, "its attr 'store_ratings' is '3', not dict or"),
    "factors true": ({"factors": True}, "its attr 'factors' is 'True', not int"),
    "no factors": ({"factors": DROP, "seed": DROP}, "its attrs lack factors, seed"),
    "dtype": (None, "'user_factors' holds int32, not float32"),
}


@pytest.mark.parametrize("how", list(TAMPERED))
def test_a_tampered_checkpoint_or_model_is_damaged(store, tmp_path, capsys, how):
    """Attrs or an array's dtype edited by hand: the checkpoint is skipped for the one
    before it, the model is one error (never a traceback, never a wrong model)."""
    changes, says = TAMPERED[how]
    ckpt = two_checkpoints(tmp_path / "ckpt")
    model = tmp_path / "m.zarr"
    fitted(store).save(model)
    for path in (tmp_path / "ckpt" / "iter-00002", model):
        if changes is None:
            edit_json(path / "user_factors" / "zarr.json", "", {"data_type": "int32"})
        elif path == model and how in ("iteration", "metrics"):
            continue  # a model has no iteration to disagree with
        else:
            edit_json(path / "zarr.json", "attributes", changes)
    with pytest.warns(CumfWarning, match=r"skipped 1 damaged checkpoint\(s\), resuming from "
                      rf"iter-00001: .*iter-00002: damaged checkpoint: {re.escape(says)}"):
        assert ckpt.latest()[0] == 1
    if how in ("iteration", "metrics"):
        return
    with pytest.raises(StoreError, match=f"damaged model: {re.escape(says)}"):
        ALS.load(model)
    code, out, _ = cli(capsys, "evaluate", model, store.url, "--json")
    assert code == 3 and "damaged model" in json.loads(out)["error"]


def test_a_save_killed_between_its_renames_is_put_back(store, tmp_path):
    """Killed after the old model was renamed aside and before the new one was renamed in:
    loading names both copies; the next save puts the new one back first and says so."""
    path = tmp_path / "m.zarr"
    old, new = fitted(store), fitted(store, seed=1)
    old.save(path)
    new.save(tmp_path / "new.zarr")
    path.rename(tmp_path / ".old-m.zarr-00000001")
    (tmp_path / "new.zarr").rename(tmp_path / ".tmp-m.zarr-00000002")
    (tmp_path / ".tmp-m.zarr-b-00000003").mkdir()  # model m.zarr-b's save, under way: kept
    with pytest.raises(StoreError, match=r"interrupted save left complete copies beside it "
                       r"\(\.old-m\.zarr-00000001, \.tmp-m\.zarr-00000002\)"):  # fmt: skip
        ALS.load(path)
    with pytest.warns(CumfWarning, match=r"put \.tmp-m\.zarr-00000002 back in its place; "
                      r"removed \.old-m\.zarr-00000001 \([\d.]+ MB\)"):  # fmt: skip
        ck._settle_leftovers(path)
    np.testing.assert_array_equal(ALS.load(path).user_factors_, new.user_factors_)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-m.zarr-b-00000003", "m.zarr"]


def test_a_client_closed_during_the_fit_is_one_error(store):
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as client:  # fmt: skip

        def close_it(record):
            client.close()

        with pytest.raises(WorkerLostError, match=r"client was closed during the fit; then "
                           r"fit again \(with checkpoint_dir"):  # fmt: skip
            ALS(3, 0.05, 5, backend="numpy", callbacks=[close_it]).fit(store, client=client)
        with Client(cluster, set_as_default=False) as other:  # the fit's setup went with it
            plugins = other.run(lambda dask_worker: list(dask_worker.plugins))
            assert not [p for names in plugins.values() for p in names if "cumf" in p]


def test_tasks_cancelled_by_a_restart_are_one_error(client2):
    """client.restart() mid-fit cancels the fit's futures: one WorkerLostError saying how
    to go on, never Dask's FutureCancelledError."""
    from distributed.client import FutureCancelledError

    from cumf_dask.engine.fit import _cluster_kept

    for resumable, again in ((False, "with checkpoint_dir"), (True, "resume=True")):
        cancelled = rf"cancelled \(scheduler-restart: .*{again}"
        with pytest.raises(WorkerLostError, match=cancelled), _cluster_kept(client2, resumable):
            raise FutureCancelledError("update-X-it3", "scheduler-restart")


# ----------------------------------------------------------------------------- numbers


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy says so, on the workers
def test_extreme_rating_stops_with_non_finite_factors(tmp_path, client2, monkeypatch):
    rows, cols, vals = random_ratings(40, 20, 0.3, seed=2)
    vals[3] = 1e30
    with pytest.raises(IngestError, match=r"rating at record 3 is 1e\+30: .* within \+-1e\+09"):
        build_store(str(tmp_path / "a.zarr"), rows, cols, vals, shape=(40, 20))
    monkeypatch.setattr(spill, "MAX_RATING", float("inf"))  # a store made some other way
    bad = build_store(str(tmp_path / "b.zarr"), rows, cols, vals, shape=(40, 20))
    with pytest.raises(NumericalError, match=r"iteration 1: factor (X|Theta) became non-finite in "
                       r"update (X|Theta) \(NaN or inf: [\d,]+ values in one batch, the first in "
                       r"row \d+ of the (users|items)\); the ratings reach 1e\+30, far beyond a "
                       "usual scale: rescale them"):  # fmt: skip
        ALS(3, 0.05, 2, backend="numpy", checkpoint_dir=str(tmp_path / "c")).fit(
            bad, client=client2
        )
    assert not (tmp_path / "c" / "LATEST").exists()  # no checkpoint of NaN factors


_UPDATES = {"calls": 0, "real": NumpyBackend.update}


def _update_nan_third(self, *args, **kwargs):
    """NumpyBackend.update, NaN in row 7 on its third call (iteration 2's update X with p = q =
    1). In-process workers run it (tasks are pickled by reference: one shared counter), so
    tests start it only once the workers are quiet (`_count_updates_from_now`)."""
    _UPDATES["calls"] += 1
    out = _UPDATES["real"](self, *args, **kwargs)
    if _UPDATES["calls"] == 3:
        out[7:9, 1] = np.nan
    return out


def _count_updates_from_now(client, monkeypatch) -> None:
    """Patch in `_update_nan_third` once no worker runs a task: a fit that failed just before
    (an earlier test's) may still run tasks it had started, and those would count."""
    deadline = time.monotonic() + 10.0

    def busy(dask_worker) -> int:
        return len(dask_worker.state.executing)

    while any(client.processing().values()) or any(client.run(busy).values()):
        assert time.monotonic() < deadline, "the workers still run tasks of an earlier fit"
        time.sleep(0.05)
    monkeypatch.setitem(_UPDATES, "calls", 0)
    monkeypatch.setattr(NumpyBackend, "update", _update_nan_third)


def _held_keys(client) -> set[str]:
    """The keys of the tasks the scheduler holds now (an earlier test's model may still hold
    its factors, keys of the same shape, until it is collected)."""
    return set(client.run_on_scheduler(lambda dask_scheduler: list(map(str, dask_scheduler.tasks))))


def _forgotten(client, part: str, before: set[str], timeout: float = 20.0,
               state: str | None = None) -> bool:  # fmt: skip
    """Whether the scheduler holds no task with `part` in its key (`state`: in that state)
    but those it held `before` the fit, within `timeout` s."""
    deadline = time.monotonic() + timeout

    def held(dask_scheduler) -> bool:
        return any(part in str(key) and str(key) not in before and state in (None, ts.state)
                   for key, ts in dask_scheduler.tasks.items())  # fmt: skip

    while client.run_on_scheduler(held):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_non_finite_factors_keep_the_last_good_checkpoint(store, client2, tmp_path, monkeypatch,
                                                          reference):  # fmt: skip
    _count_updates_from_now(client2, monkeypatch)
    ckpt = str(tmp_path / "ckpt")
    als = ALS(3, 0.05, 3, backend="numpy", plan=PlanConfig(p=1, q=1), checkpoint_dir=ckpt)
    before = _held_keys(client2)
    with pytest.raises(NumericalError) as err:
        als.fit(store, client=client2)
    assert str(err.value) == (
        "iteration 2: factor X became non-finite in update X (NaN or inf: 2 values in one batch, "
        "the first in row 7 of the users); try a larger regularization (model.regularization), "
        "or check the input for extreme ratings; the last good checkpoint (iteration 1) is kept"
    )
    assert (tmp_path / "ckpt" / "LATEST").read_text().strip() == "iter-00001"
    # iteration 3, submitted before iteration 2 was checked, was dropped; the blocks the
    # fit kept on the workers were let go, though the error (its frames) is still held
    assert _forgotten(client2, "-it3-", before), "the scheduler still holds tasks of iteration 3"
    assert _forgotten(client2, "load-", before, state="memory"), (
        "the workers hold the failed fit's blocks"
    )
    monkeypatch.setattr(NumpyBackend, "update", _UPDATES["real"])
    als.fit(store, client=client2, resume=True)
    same(als, reference)


def test_failed_streamed_fit_leaves_no_queued_tasks(store, client2, monkeypatch):
    """Blocks read from the store, update Theta data parallel (its reads wait on the queued
    iteration's computations): a NaN in iteration 3 leaves nothing of iteration 4 behind."""
    _count_updates_from_now(client2, monkeypatch)  # update X runs once per iteration
    plan = PlanConfig(x=HalfStepConfig(p=1, q=1), theta=HalfStepConfig(p=2, q=1), blocks="store")
    before = _held_keys(client2)
    with pytest.raises(NumericalError, match="iteration 3: factor X") as err:
        ALS(3, 0.05, 4, backend="numpy", plan=plan, evaluate=False).fit(store, client=client2)
    # while the error (its traceback: the fit's frames) is still held
    assert _forgotten(client2, "-it4-", before), "the scheduler still holds tasks of iteration 4"
    del err


def test_finite_check_names_the_first_bad_piece_and_row():
    """One check per worker and half-step covers all its pieces: the first bad one counts."""
    rng = np.random.default_rng()
    pieces = [rng.standard_normal((n, 4)).astype(np.float32) for n in (10, 6, 8)]
    check_finite([0, 10, 16], "numpy", False, *pieces)
    pieces[1][3, 2], pieces[2][0, :] = np.inf, np.nan
    with pytest.raises(NonFiniteFactor) as err:
        check_finite([0, 10, 16], "numpy", False, *pieces)
    assert (err.value.count, err.value.row) == (1, 13)


def test_rating_scale(tmp_path, capsys):
    (tmp_path / "r.csv").write_text("u,i,r\na,x,1\nb,y,5\nc,z,7\n")
    code, _, err = cli(capsys, "ingest", tmp_path / "r.csv", "-o", tmp_path / "s.zarr",
                       "--rating-min", "1", "--rating-max", "5")  # fmt: skip
    assert code == 3
    assert (
        f"error: {tmp_path}/r.csv, line 4: rating '7' is outside the declared scale [1, 5]; "
        "fix or remove it, or declare a wider scale (--rating-min/--rating-max)"
    ) in err
    assert not (tmp_path / "s.zarr").exists() and not (tmp_path / "s.zarr.lock").exists()
    code, _, _ = cli(capsys, "ingest", tmp_path / "r.csv", "-o", tmp_path / "s.zarr",
                     "--rating-min", "1", "--rating-max", "10")  # fmt: skip
    assert code == 0 and RatingsStore.open(tmp_path / "s.zarr").source["rating_max"] == 10
    (tmp_path / "big.csv").write_text("a,x,1\nb,y,1e30\n")
    code, _, err = cli(capsys, "ingest", tmp_path / "big.csv", "-o", tmp_path / "t.zarr")
    assert code == 3 and (f"{tmp_path}/big.csv, line 2: rating '1e30' is beyond +-1e+09, the "
                          "largest magnitude cumf-dask accepts") in err  # fmt: skip
    with pytest.raises(IngestError, match="record 1: rating 0.5 is outside the declared scale "
                       r"\[1, inf\]"):  # fmt: skip
        ingest_arrays(tmp_path / "u.zarr", [1, 2], [1, 2], [3.0, 0.5], rating_min=1)
    with pytest.raises(ConfigError, match=r"'rating_min' \(5.0\) must be below 'rating_max' \(1\)"):
        ingest_arrays(tmp_path / "u.zarr", [1], [1], [3.0], rating_min=5.0, rating_max=1)
    with pytest.raises(ConfigError, match=r"data\.ingest\.rating_min"):
        load_config(overrides=["data.ingest.rating_min=5", "data.ingest.rating_max=1"])


# ----------------------------------------------------------------------------- k


@pytest.fixture(scope="module")
def greedy(tmp_path_factory):
    """A store where user 0 rated all but 2 of the 6 items."""
    rows = np.array([0, 0, 0, 0, 1, 2, 3, 3])
    cols = np.array([0, 1, 2, 3, 4, 5, 0, 4])
    vals = np.array([1, 2, 3, 4, 5, 1, 2, 3], np.float32)
    path = tmp_path_factory.mktemp("greedy") / "g.zarr"
    return build_store(str(path), rows, cols, vals, shape=(4, 6), test_fraction=0.3, split_seed=7)


def test_k_in_the_api(greedy):
    model = fitted(greedy, seed=3)
    for bad in (0, -1, 2.5):
        with pytest.raises(ConfigError, match="'k' must be"):
            model.recommend([0], k=bad)
    with pytest.warns(CumfWarning, match="k=10 is more than the 6 items: returning 6 per user"):
        top, scores = model.recommend([0, 2], k=10)
    assert top.shape == scores.shape == (2, 6)
    seen = set(greedy.read_coo("row", (0, 1))[1].tolist())
    left = 6 - len(seen)
    assert set(top[0, :left].tolist()) == set(range(6)) - seen
    assert (top[0, left:] == -1).all() and np.isneginf(scores[0, left:]).all()
    assert np.isfinite(scores[0, :left]).all()
    metrics = ranking_metrics(model, greedy, k=50)
    assert metrics["k"] == 6 and "precision@6" in metrics
    assert all(np.isfinite(v) for v in metrics.values())
    with pytest.raises(ConfigError, match="'k' must be >= 1"):
        ranking_metrics(model, greedy, k=0)
    top_held_out = greedy.read_coo("row", split="test")[2].max()
    with pytest.raises(ConfigError, match=f"the highest is {top_held_out:g}"):
        ranking_metrics(model, greedy, threshold=top_held_out + 1)


def test_k_in_the_cli(greedy, tmp_path, capsys):
    model = tmp_path / "g-model.zarr"
    fitted(greedy, seed=3).save(model)
    code, _, err = cli(capsys, "recommend", model, "--user", "0", "-k", "0")
    assert code == 2 and "error: -k must be at least 1, got 0" in err
    code, out, err = cli(capsys, "recommend", model, "--user", "0", "-k", "100", "--json")
    seen = len(greedy.read_coo("row", (0, 1))[1])
    assert code == 0 and "Infinity" not in out and "NaN" not in out
    assert len(json.loads(out)["items"]) == 6 - seen
    assert f"k=100: only {6 - seen} of the 6 items are ones the user has not rated" in err
    code, out, err = cli(capsys, "evaluate", model, greedy.url, "-k", "100", "--json")
    result = json.loads(out)
    assert code == 0 and "NaN" not in out and result["k"] == 6 and "ndcg@6" in result
    assert "k=100 is more than the 6 items: ranking metrics at k=6" in err
    assert cli(capsys, "evaluate", model, greedy.url, "-k", "-3")[0] == 2


# ----------------------------------------------------------------------------- writers


def test_a_second_writer_of_a_store_fails_at_once(tmp_path, capsys):
    (tmp_path / "r.csv").write_text("a,x,1\nb,y,2\n")
    target = tmp_path / "s.zarr"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from cumf_dask.locks import WriterLock; "
         "WriterLock(sys.argv[1], 'the rating store').acquire(); print('held', flush=True); "
         "time.sleep(60)", str(target)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.perf_counter()
        code, _, err = cli(capsys, "ingest", tmp_path / "r.csv", "-o", target)
        assert code == 3 and time.perf_counter() - started < 5
        assert (f"error: {target}: the rating store is being written by another cumf-dask "
                f"process (pid {holder.pid} on {socket.gethostname()}") in err  # fmt: skip
        assert f"the lock is stale: delete {target}.lock and run again" in err
        with pytest.raises(StoreError, match="being written by another cumf-dask process"):
            generate(target, PlantedModel.create(m=20, n=10, nnz=60))
    finally:
        holder.kill()
        holder.wait()
    # the holder died with its lock on disk: the next writer takes it over
    code, _, err = cli(capsys, "ingest", tmp_path / "r.csv", "-o", target)
    assert code == 0 and f"took over the lock left by pid {holder.pid}" in err
    assert not Path(f"{target}.lock").exists()


def test_locks_of_other_hosts_and_of_models_and_checkpoints(store, client2, tmp_path):
    target = tmp_path / "s.zarr"
    Path(f"{target}.lock").write_text(json.dumps(owner(12345, host="elsewhere")))
    with pytest.raises(StoreError, match=r"pid 12345 on elsewhere.*if no cumf-dask process runs "
                       rf"on elsewhere, the lock is stale: delete {target}.lock"):  # fmt: skip
        ingest_arrays(target, [1], [2], [3.0])
    live = owner(os.getppid())  # another live process on this host
    Path(tmp_path / "m.zarr.lock").write_text(json.dumps(live))
    with pytest.raises(StoreError, match="the model is being written by another"):
        fitted(store).save(tmp_path / "m.zarr")
    Path(tmp_path / "ckpt.lock").write_text(json.dumps(live))
    started = time.perf_counter()
    with pytest.raises(StoreError, match="the checkpoint folder is being written by another"):
        ALS(3, 0.05, 2, backend="numpy", checkpoint_dir=str(tmp_path / "ckpt")).fit(
            store, client=client2
        )
    assert time.perf_counter() - started < 2 and not (tmp_path / "ckpt").exists()
    Path(f"{target}.lock").write_text(json.dumps(owner(dead_pid())))
    Path(f"{target}.lock.takeover").touch()  # another writer's take-over, under way
    taking_over = rf"no longer running, and another process is taking its lock over \({target}"
    with pytest.raises(StoreError, match=taking_over):
        ingest_arrays(target, [1], [2], [3.0])


@pytest.mark.parametrize(
    ("what", "says"),
    [("store", "a rating store"), ("model", "a saved model"),
     ("notes", "other files: .tmp-notes, notes.txt")],
)
def test_a_checkpoint_folder_that_holds_something_else_is_refused(store, tmp_path, what, says):
    folder = tmp_path / "ckpt"
    if what == "store":
        folder = Path(store.url)
    elif what == "model":
        fitted(store).save(folder)
    else:
        folder.mkdir()
        (folder / "notes.txt").write_text("keep me")
        (folder / ".tmp-notes").mkdir()
    before = sorted(folder.rglob("*"))
    with pytest.raises(StoreError, match=rf"{folder}: not a checkpoint folder \({says}\); give "
                       "checkpoints a folder of their own"), ck.Checkpointer(folder).locked():
        pass
    assert sorted(folder.rglob("*")) == before


def test_a_checkpoint_folder_has_one_writer_thread_and_recovers_from_a_killed_one(tmp_path):
    """A killed writer's empty lock file (killed before naming itself) and LATEST pointer
    are cleared; another thread of the process is refused, the holding thread re-enters."""
    ckpt = two_checkpoints(tmp_path / "ckpt")
    (tmp_path / "ckpt" / ".LATEST-0123abcd").write_text("iter-00003\n")
    lock = tmp_path / "ckpt.lock"
    lock.write_text("")
    os.utime(lock, (time.time() - 60, time.time() - 60))
    errors: list[str] = []

    def second() -> None:
        try:
            with ckpt.locked():
                errors.append("entered")
        except StoreError as exc:
            errors.append(str(exc))

    with pytest.warns(CumfWarning) as warned, ckpt.locked(), ckpt.locked():
        thread = threading.Thread(target=second)
        thread.start()
        thread.join()
    text = " ".join(str(w.message) for w in warned)
    assert "took over the lock left by a writer killed before it named itself" in text
    assert "removed .LATEST-0123abcd" in text
    assert errors == [f"{tmp_path / 'ckpt'}: the checkpoint folder is being written by another "
                      "thread of this process; wait for it to finish or write elsewhere"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "LATEST", "iter-00001", "iter-00002"]  # fmt: skip
    assert not lock.exists()


# ----------------------------------------------------------------------------- disk and files


def test_disk_full_while_checkpointing(store, client2, tmp_path, monkeypatch, reference):
    real = zarr.storage.LocalStore.set

    async def full(self, key, value):
        if "iter-00002" in str(self.root):
            raise OSError(errno.ENOSPC, "No space left on device")
        return await real(self, key, value)

    monkeypatch.setattr(zarr.storage.LocalStore, "set", full)
    ckpt = tmp_path / "ckpt"
    # the last iteration's checkpoint is always written (an earlier one may be skipped)
    als = ALS(3, 0.05, 2, backend="numpy", plan=PlanConfig(p=1, q=1), checkpoint_dir=str(ckpt))
    with pytest.raises(StoreError) as err:
        als.fit(store, client=client2)
    assert str(err.value).startswith(
        f"{ckpt}: disk full while writing checkpoint iter-00002 (it needs about 0.0 MB, "
    )
    assert str(err.value).endswith(
        "free); free some space there, then run again with --resume (resume=True): checkpoint "
        "iter-00001 is intact"
    )
    assert sorted(p.name for p in ckpt.iterdir()) == ["LATEST", "iter-00001"]
    monkeypatch.setattr(zarr.storage.LocalStore, "set", real)
    als.iterations = 3
    als.fit(store, client=client2, resume=True)
    same(als, reference)


def test_unwritable_outputs_are_refused_before_reading(tmp_path, capsys, store, monkeypatch):
    (tmp_path / "file").write_text("not a folder")
    (tmp_path / "garbage.csv").write_bytes(os.urandom(4096))  # would fail if it were read
    code, _, err = cli(capsys, "ingest", tmp_path / "garbage.csv", "-o", tmp_path / "file/s.zarr")
    assert (
        code == 3
        and (
            f"error: cannot write the rating store at {tmp_path}/file/s.zarr: "
            f"{tmp_path}/file is a file, not a folder; choose another path"
        )
        in err
    )
    readonly = tmp_path / "ro"
    readonly.mkdir()
    readonly.chmod(0o555)  # root writes anyway: make the check see it as read-only
    real = paths._can_create
    monkeypatch.setattr(paths, "_can_create", lambda p: p != readonly and real(p))
    code, _, err = cli(capsys, "generate", "--m", "20", "--n", "10", "--nnz", "50", "-o",
                       readonly / "g.zarr")  # fmt: skip
    assert code == 3 and (f"the folder {readonly} is not writable (read-only or no permission)"
                          in err)  # fmt: skip
    with pytest.raises(StoreError, match=r"cannot write the model at .*file/m\.zarr"):
        fitted(store).save(tmp_path / "file" / "m.zarr")
    config = load_config(data={"data": {"source": "ingest", "store": str(tmp_path / "n.zarr"),
                                        "ingest": {"path": str(tmp_path / "garbage.csv")}},
                               "output": {"dir": str(tmp_path / "file" / "runs")}})  # fmt: skip
    started = time.perf_counter()
    with pytest.raises(StoreError, match=r"cannot write the run folder at .*file/runs: .*file is "
                       "a file, not a folder"):  # fmt: skip
        train(config, log=lambda _: None)  # no cluster is started, nothing is read
    assert time.perf_counter() - started < 1 and not (tmp_path / "n.zarr").exists()


@pytest.mark.parametrize(
    ("data", "looks"),
    [
        (gzip.compress(b"1,2,3\n" * 50), "it looks like gzip-compressed data; name it .gz"),
        (os.urandom(3000), "it holds binary data (NUL or control bytes)"),
        (b"PAR1" + os.urandom(100), "it looks like a Parquet file; use --format parquet"),
        ("zip", "it looks like a zip archive"),
    ],
    ids=["gzip", "random-bytes", "parquet", "zip"],
)
def test_binary_input_is_not_a_text_file(tmp_path, capsys, data, looks):
    path = tmp_path / "ratings.dat"
    if data == "zip":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("ratings.csv", "1,2,3\n")
    else:
        path.write_bytes(data)
    code, _, err = cli(capsys, "ingest", path, "--format", "movielens-1m", "-o", tmp_path / "s")
    assert code == 3 and f"error: {path}: not a text file: {looks}" in err
    assert "delimiter" not in err


@pytest.mark.parametrize("where", ["spill files", "store", "generated store"])
def test_a_full_disk_while_building_a_store_is_one_error(tmp_path, monkeypatch, where):
    def full(*args, **kwargs):
        if where == "spill files":  # how NumPy's tofile reports it
            raise OSError("898809 requested and 523776 written")
        raise OSError(errno.ENOSPC, "No space left on device")

    url = str(tmp_path / "out" / "s.zarr")
    if where == "generated store":
        monkeypatch.setattr(synthetic, "_row_band", full)
        with pytest.raises(StoreError, match=rf"{tmp_path}/out: disk full while writing the "
                           r"store s\.zarr \([\d,.]+ MB free\); free space there"):  # fmt: skip
            generate(url, PlantedModel(m=40, n=20, nnz=200, rank=2))
    else:
        monkeypatch.setattr(*((spill.StoreBuilder, "_spill_chunk") if where == "spill files"
                              else (spill, "write_band")), full)  # fmt: skip
        folder = tempfile.gettempdir() if where == "spill files" else f"{tmp_path}/out"
        with pytest.raises(StoreError, match=rf"{folder}: disk full while writing the "
                           rf"{'ingest.s spill files' if where == 'spill files' else 'store'}"):
            build_store(url, [0, 1], [1, 0], [1.0, 2.0])
    assert not list((tmp_path / "out").iterdir())


@pytest.mark.parametrize("when", ["before", "while"])
def test_a_dead_spill_folder_another_ingest_removes_meanwhile_is_skipped(tmp_path, monkeypatch,
                                                                         when):  # fmt: skip
    """Two ingests starting together may both clear a killed ingest's spill folder: what the
    other removes first, the folder (`before` this one measures it) or its files (`while`
    it does), is skipped, never an error that fails a valid ingest."""
    dead = owned_folder(spill.SPILL_PREFIX, str(tmp_path))
    (dead / OWNER).write_text(json.dumps(owner(dead_pid())))
    (dead / "row-0").write_bytes(b"x" * 1000)
    read, stat = locks.read_owner, os.stat

    def remove_after(function):  # the other ingest removes the folder after this call
        def racing(path, *args, **kwargs):
            result = function(path, *args, **kwargs)
            if when == "before" or str(path) == str(dead / "row-0"):
                shutil.rmtree(dead, ignore_errors=True)
            return result

        return racing

    monkeypatch.setattr(*((locks, "read_owner", remove_after(read)) if when == "before" else
                          (os, "stat", remove_after(stat))))  # fmt: skip
    with pytest.warns(CumfWarning, match=rf"removed 1 spill folder\(s\) .*: {dead.name}"):
        clear_dead_folders(spill.SPILL_PREFIX, "spill folder(s) of interrupted ingests",
                           str(tmp_path))
    assert not dead.exists()


def test_leftovers_of_killed_runs_are_removed(tmp_path, capsys):
    spills = tmp_path / "tmp"
    spills.mkdir()
    dead = owned_folder(spill.SPILL_PREFIX, str(spills))
    (dead / OWNER).write_text(json.dumps(owner(dead_pid())))
    (dead / "row-0.val").write_bytes(b"x" * 2_000_000)
    alive = owned_folder(spill.SPILL_PREFIX, str(spills))  # this process's: must stay
    with pytest.warns(CumfWarning, match=rf"removed 1 spill folder\(s\) of interrupted ingests "
                      rf"in {spills} \(2.0 MB\): {dead.name}"):  # fmt: skip
        build_store(str(tmp_path / "a.zarr"), [0, 1], [1, 0], [1.0, 2.0], spill_dir=str(spills))
    assert not dead.exists() and alive.exists()
    # a killed generate: its work folder, the store it had set aside, its stale lock; a
    # folder of the user's that only looks like one is kept
    target = tmp_path / "g.zarr"
    work = work_url(str(target))
    init_store(work, 20, 10, 8, 8, overwrite=True)
    init_store(str(tmp_path / ".old-g.zarr-00000001"), 20, 10, 8, 8, overwrite=True)
    (tmp_path / "g.zarr.old").mkdir()
    Path(f"{target}.lock").write_text(json.dumps(owner(dead_pid())))
    code, _, err = cli(capsys, "generate", "--m", "20", "--n", "10", "--nnz", "50", "-o", target)
    assert code == 0 and f"warning: removed what an interrupted build of {target} left: " in err
    assert Path(work).name in err and ".old-g.zarr-00000001 (" in err
    assert "took over the lock" in err and RatingsStore.open(target).m == 20
    assert sorted(p.name for p in tmp_path.glob("*g.zarr*")) == ["g.zarr", "g.zarr.old"]
    (tmp_path / "g.zarr.old" / "notes.txt").write_text("keep me")
    cli(capsys, "generate", "--m", "20", "--n", "10", "--nnz", "50", "-o", target, "--overwrite")
    assert (tmp_path / "g.zarr.old" / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.glob("*g.zarr*")) == ["g.zarr", "g.zarr.old"]


@pytest.mark.parametrize("interrupt", ["signal", "error"])
def test_a_folder_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch, interrupt):
    """A Ctrl-C between the two renames that replace a store (or a model) waited until both
    are done; an error in the second puts the old one back. It lost both versions."""
    import signal

    old = build_store(str(tmp_path / "s.zarr"), [0, 1], [1, 0], [1.0, 2.0])
    rename = Path.rename

    def cut_in_two(self, target):
        if interrupt == "error" and self.name.startswith(".partial-s.zarr-"):  # the second
            raise OSError(errno.EIO, "the disk went away")
        out = rename(self, target)
        if interrupt == "signal" and Path(target).name.startswith(".old-s.zarr-"):  # the first
            signal.raise_signal(signal.SIGINT)  # Python runs the handler after this call
        return out

    monkeypatch.setattr(Path, "rename", cut_in_two)
    expected = KeyboardInterrupt if interrupt == "signal" else OSError
    with pytest.raises(expected):
        build_store(str(tmp_path / "s.zarr"), [0, 1, 2], [1, 0, 1], [1.0, 2.0, 3.0],
                    overwrite=True)  # fmt: skip
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]
    store = RatingsStore.open(str(tmp_path / "s.zarr"))
    assert store.nnz == (3 if interrupt == "signal" else old.nnz)


def test_the_store_folder_of_a_killed_fit_on_arrays_is_removed(tmp_path, monkeypatch):
    """A fit on in-memory data keeps its store in a temporary folder while the model lives;
    a killed process leaves it, and the next such fit removes it (not a live one's)."""
    from cumf_dask.model import _TempFolder

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = owned_folder(_TempFolder.PREFIX)
    (dead / OWNER).write_text(json.dumps(owner(dead_pid())))
    (dead / "ratings.zarr").write_bytes(b"x" * 3_000_000)
    alive = owned_folder(_TempFolder.PREFIX)
    with pytest.warns(CumfWarning, match=r"removed 1 store folder\(s\) of killed fits on "
                      rf"in-memory data in {tmp_path} \(3.0 MB\): {dead.name}"):  # fmt: skip
        ALS(2, 0.1, 1, backend="numpy").fit(random_ratings(20, 10, 0.5, seed=1))
    assert not dead.exists() and alive.exists()


# ----------------------------------------------------------------------------- the final model


def test_resume_restores_a_final_model_cut_short(store, client2, tmp_path, monkeypatch):
    config = load_config(data={
        "data": {"source": "store", "store": store.url},
        "model": {"factors": 3, "iterations": 2},
        "plan": {"p": 1, "q": 1},
        "output": {"dir": str(tmp_path / "runs"), "name": "cut"},
    })  # fmt: skip
    first = train(config, client=client2, log=lambda _: None)
    reference = ALS.load(first.run.path)  # a run folder is taken for its model
    damage(first.run.model, "flipped bytes")
    with pytest.raises(StoreError, match=r"damaged model: .*train it again, or restore it from "
                       r"its run's checkpoints: `cumf-dask train \S+/config\.yaml --resume`"):
        ALS.load(first.run.path)
    with pytest.raises(StoreError, match=r"damaged model: .*; train it again$"):
        ALS.load(shutil.copytree(first.run.model, tmp_path / "elsewhere.zarr"))
    for cut in ("missing", "no metadata"):
        if cut == "missing":  # killed between the rename of the old model and the new one
            shutil.rmtree(first.run.model)
            (first.run.path / ".tmp-model.zarr-0badf00d").mkdir()
        else:  # killed while a partial model.zarr was being written in place
            (first.run.model / "zarr.json").unlink()
        logs: list[str] = []
        with pytest.warns(CumfWarning, match=r"removed \.tmp-model\.zarr-0badf00d") if (
            cut == "missing"
        ) else nullcontext():
            again = train(config, resume=True, client=client2, log=logs.append)
        assert again.run.path == first.run.path
        restored = ALS.load(first.run.model)
        np.testing.assert_array_equal(restored.user_factors_, reference.user_factors_)
        np.testing.assert_array_equal(restored.item_factors_, reference.item_factors_)
        assert not list(first.run.path.glob(".tmp-*"))
        assert (cut == "no metadata") == any("removed the incomplete or damaged" in x for x in logs)
    lines = (first.run.path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["iteration"] for x in lines] == [1, 2]
    real = zarr.storage.LocalStore.set

    async def full(self, key, value):
        if "model.zarr" in str(self.root):
            raise OSError(errno.ENOSPC, "No space left on device")
        return await real(self, key, value)

    with monkeypatch.context() as patch:
        patch.setattr(zarr.storage.LocalStore, "set", full)
        with pytest.raises(StoreError, match=r"disk full while writing the model .*free some "
                           r"space there, then run train\(config, resume=True\)"):  # fmt: skip
            train(config, resume=True, client=client2, log=lambda _: None)
    np.testing.assert_array_equal(ALS.load(first.run.path).user_factors_,
                                  reference.user_factors_)  # fmt: skip
    recorded = (first.run.path / "config.yaml").read_text()
    config.model.factors = 4
    with pytest.raises(StoreError, match=r"another fit \(factors: 3 there, 4 here\); run "
                       "without --resume"):  # fmt: skip
        train(config, resume=True, client=client2, log=lambda _: None)
    assert (first.run.path / "config.yaml").read_text() == recorded  # the run's record stays


# ----------------------------------------------------------------------------- cluster.address


@pytest.fixture
def peer():
    """peer(greeting): a TCP server thread on a free port of localhost that accepts, sends
    `greeting` (b"": nothing) and then stays silent, as a web server or an SSH server does
    for a Dask client; its tcp:// address."""
    servers = []

    def start(greeting: bytes) -> str:
        server = socket.create_server(("127.0.0.1", 0))
        servers.append(server)

        def serve():
            with suppress(OSError):  # closed at the end of the test
                while True:
                    conn, _ = server.accept()
                    servers.append(conn)
                    conn.sendall(greeting)

        threading.Thread(target=serve, daemon=True).start()
        return f"tcp://127.0.0.1:{server.getsockname()[1]}"

    yield start
    for sock in servers:
        sock.close()


def test_an_address_that_accepts_but_never_answers_fails_in_bounded_time(peer, monkeypatch):
    """The dashboard's port (a web server waits for a request) held Client() for ever."""
    monkeypatch.setattr(cluster, "JOIN_S", 0.5)
    address = peer(b"")
    began = time.monotonic()
    says = (rf"cluster\.address {address}: something accepts connections there but does not "
            r"answer as a Dask scheduler .*dashboard, usually port 8787; the scheduler is usually "
            r"port 8786")  # fmt: skip
    with pytest.raises(ConfigError, match=says):
        cluster.make_client(ClusterConfig(address=address))
    assert time.monotonic() - began < 5


def test_an_address_that_greets_in_another_protocol_is_not_a_memory_error(peer, store, capsys):
    """An SSH banner's first 8 bytes, read as Dask's frame count, asked for exabytes: the
    CLI then said that this machine ran out of memory (exit 4)."""
    address = peer(b"SSH-2.0-OpenSSH_9.6p1 Ubuntu-3ubuntu13\r\n")
    code, _, err = cli(capsys, "plan", "--store", store.url, "--set", f"cluster.address={address}")
    assert code == 2 and err.count("error:") == 1, err
    assert f"cluster.address {address}: what answers there is not a Dask scheduler" in err
    assert "ran out of memory" not in err


@pytest.mark.parametrize(
    ("address", "says"),
    [
        ("ucx://127.0.0.1:18796", "is a UCX address but distributed-ucxx is not installed"),
        ("tls://127.0.0.1:18796", "is a TLS address but Dask has no TLS config"),
        ("inproc://127.0.0.1/1/1", "no scheduler of this process is there"),
    ],
)
def test_addresses_this_process_cannot_join_are_one_config_error(address, says):
    if address.startswith("ucx") and cluster.has_module("distributed_ucxx"):
        pytest.skip("distributed-ucxx is installed")
    with pytest.raises(ConfigError, match=rf"cluster\.address {re.escape(address)}:? {says}"):
        cluster.make_client(ClusterConfig(address=address))


def test_a_workers_address_is_not_a_schedulers(clients):
    shared = clients(1)
    with cluster.cluster_client(ClusterConfig(address=shared.scheduler.address)) as joined:
        assert joined.status == "running" and cluster.worker_addresses(joined)
    worker = cluster.worker_addresses(shared)[0]
    with pytest.raises(ConfigError, match=rf"cluster\.address {worker} is a Dask Worker, not "
                       r"a scheduler; give the scheduler's address"):  # fmt: skip
        cluster.make_client(ClusterConfig(address=worker))
