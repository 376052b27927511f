"""The estimator's API: resume, predict, rmse, recommend, save/load, Dask arrays, bad input."""

from __future__ import annotations

import gc
import inspect
import pickle
import shutil
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import random_ratings

from cumf_dask.checkpoint import BackgroundSaves, Checkpointer
from cumf_dask.data.ingest import ingest_arrays
from cumf_dask.data.inputs import ingest_input
from cumf_dask.data.spill import build_store
from cumf_dask.engine.session import Session
from cumf_dask.errors import ConfigError, CumfWarning, IngestError, NotFittedError, StoreError
from cumf_dask.implicit.model import ImplicitALS
from cumf_dask.model import ALS

M, N = 70, 40


@pytest.fixture
def client(client2):
    return client2


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rows, cols, vals = random_ratings(M, N, 0.2, seed=21)
    path = tmp_path_factory.mktemp("model") / "r.zarr"
    return build_store(str(path), rows, cols, vals, shape=(M, N), test_fraction=0.2, split_seed=3)


class Interrupt(Exception):
    pass


def test_resume_after_interruption_matches_uninterrupted(store, client, tmp_path):
    full = ALS(5, 0.05, 4, backend="numpy").fit(store, client=client)

    def stop_after_two(record):
        if record["iteration"] == 2:
            raise Interrupt

    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(Interrupt):
        ALS(5, 0.05, 4, backend="numpy", checkpoint_dir=ckpt, callbacks=[stop_after_two]).fit(
            store, client=client
        )
    resumed = ALS(5, 0.05, 4, backend="numpy", checkpoint_dir=ckpt)
    resumed.fit(store, client=client, resume=True)
    assert [r["iteration"] for r in resumed.metrics_] == [1, 2, 3, 4]

    def stop_at_once(record):
        raise Interrupt

    stopped = str(tmp_path / "stopped")  # the save under way when the fit stops completes
    with pytest.raises(Interrupt):
        ALS(5, 0.05, 4, backend="numpy", checkpoint_dir=stopped, callbacks=[stop_at_once]).fit(
            store, client=client
        )
    assert Checkpointer(stopped).latest()[0] == 1
    np.testing.assert_allclose(resumed.user_factors_, full.user_factors_, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(resumed.item_factors_, full.item_factors_, rtol=1e-5, atol=1e-6)


def test_checkpoints_are_written_while_the_fit_goes_on(store, client, tmp_path, monkeypatch):
    """Checkpoint 1 is written until iteration 3 is reported: iterations 2 and 3 end while
    it is written and are not saved; the last one always is."""
    reported = {it: threading.Event() for it in (1, 2, 3, 4)}
    saved: list[int] = []
    real = Checkpointer.save

    def save(self, iteration, *args):
        if iteration == 1 and not reported[3].wait(30):
            raise AssertionError("the fit waited for checkpoint 1")
        saved.append(iteration)
        real(self, iteration, *args)

    monkeypatch.setattr(Checkpointer, "save", save)
    ckpt = tmp_path / "ckpt"
    callbacks = [lambda record: reported[record["iteration"]].set()]
    ALS(4, 0.05, 4, backend="numpy", checkpoint_dir=str(ckpt), callbacks=callbacks).fit(
        store, client=client
    )
    assert saved == [1, 4]
    assert Checkpointer(ckpt).names() == ["iter-00004", "iter-00001"]
    assert Checkpointer(ckpt).latest()[0] == 4


def test_a_save_that_would_outlast_the_fit_is_not_started(tmp_path):
    """The last iteration waits for the save under way, then writes its own: a save that
    would still run when the fit ends only delays it."""
    saves = BackgroundSaves(Checkpointer(tmp_path), lambda collections: [], None)
    assert saves.worth_starting(0.0)  # nothing known of a save yet
    saves.seconds = 2.0
    assert not saves.worth_starting(1.9) and saves.worth_starting(2.0)
    saves.close()


def test_a_stopped_fit_waits_for_the_save_under_way_through_more_ctrl_cs(tmp_path,
                                                                         monkeypatch):  # fmt: skip
    """The folder's lock is let go only once no save writes in it: another writer would
    remove the save still being written as a killed one's. A long wait says why."""
    import _thread

    written = threading.Event()

    def slow_save(self, iteration, arrays, attrs, compute):
        time.sleep(1.5)
        written.set()

    monkeypatch.setattr(Checkpointer, "save", slow_save)
    saves = BackgroundSaves(Checkpointer(tmp_path), lambda collections: [], None)
    saves.start(3, {}, {})
    for delay in (0.2, 1.2):  # one Ctrl-C in the first second, one after the warning
        threading.Timer(delay, _thread.interrupt_main).start()
    with pytest.warns(CumfWarning, match="finishing the checkpoint of iteration 3 before"):
        assert saves.settle() == 3
    assert written.is_set()
    saves.close()


def test_gathered_factors_are_the_models_own(store, clients):
    """A single piece on a worker that is a thread of this process comes as a copy: the
    model's factors never share memory with the pieces the session keeps on the cluster."""
    model = ALS(4, 0.05, 2, backend="numpy").fit(store, client=clients(1))
    pieces = [fut.result() for factor in (model._session.X, model._session.theta)
              for _, _, fut in factor.pieces]  # fmt: skip
    for piece in pieces:
        for own in (model.user_factors_, model.item_factors_):
            assert not np.shares_memory(piece, own)


def test_final_factors_come_from_the_last_checkpoint(store, client, tmp_path, monkeypatch):
    """With the last iteration's checkpoint written, the factors are read back from it (not
    gathered through Dask): the same numbers as a fit without checkpoints."""
    plain = ALS(4, 0.05, 3, backend="numpy").fit(store, client=client)
    monkeypatch.setattr(Session, "gather", lambda self: pytest.fail("gathered"))
    saved = ALS(4, 0.05, 3, backend="numpy", checkpoint_dir=str(tmp_path / "ckpt"))
    saved.fit(store, client=client)
    np.testing.assert_array_equal(saved.user_factors_, plain.user_factors_)
    np.testing.assert_array_equal(saved.item_factors_, plain.item_factors_)


def test_factor_chunks_are_read_from_their_files_as_zarr_reads_them(tmp_path, monkeypatch):
    """Chunks of plain bytes are read from their files: the same arrays as zarr gives,
    an all-zero chunk that Zarr left out included (and its CRC checked)."""
    import cumf_dask.checkpoint as ck

    monkeypatch.setattr(ck, "ROW_CHUNK", 8)
    X = np.random.default_rng(5).normal(size=(37, 3)).astype(np.float32)
    X[8:16] = 0  # chunk 1: no file
    ids = np.arange(100, 137)
    attrs = {"factors": 3, "regularization": 0.1, "iterations": 1, "seed": 0, "m": 37,
             "n": 2, "format": ck.MODEL_FORMAT, "version": ck.MODEL_VERSION}  # fmt: skip
    ck.write_factors(tmp_path / "m.zarr", {"user_factors": X, "item_factors": X[:2],
                                           "user_ids": ids}, attrs)  # fmt: skip
    assert not (tmp_path / "m.zarr/user_factors/c/1/0").exists()
    _, arrays = ck.read_factors(tmp_path / "m.zarr")
    np.testing.assert_array_equal(arrays["user_factors"], X)
    np.testing.assert_array_equal(arrays["user_ids"], ids)
    (tmp_path / "m.zarr/user_factors/c/3/0").write_bytes(b"\0" * 40)  # cut short
    with pytest.raises(StoreError, match=r"chunk user_factors/c/3/0 cannot be decoded"):
        ck.read_factors(tmp_path / "m.zarr")


def test_interrupted_checkpoint_write_keeps_previous(store, client, tmp_path):
    ckpt = tmp_path / "ckpt"
    ALS(4, 0.05, 2, backend="numpy", checkpoint_dir=str(ckpt)).fit(store, client=client)
    (ckpt / ".tmp-iter-00003-deadbeef").mkdir()  # what a crash mid-write leaves behind
    model = ALS(4, 0.05, 2, backend="numpy", checkpoint_dir=str(ckpt))
    with pytest.warns(CumfWarning, match=r"killed checkpoint write .* \.tmp-iter-00003-dead"):
        model.fit(store, client=client, resume=True)
    assert not list(ckpt.glob(".tmp-*"))
    assert [r["iteration"] for r in model.metrics_] == [1, 2]


def test_resume_of_another_fit_is_refused(store, client, tmp_path):
    """Another f, another lambda, or other ratings of the same shape: refused, each named;
    more iterations, another seed or solver: resumed."""
    ckpt = str(tmp_path / "ckpt")
    ALS(4, 0.05, 1, backend="numpy", checkpoint_dir=ckpt).fit(store, client=client)
    with pytest.raises(StoreError, match=r"another fit .*factors: 4 there, 6 here"):
        ALS(6, 0.05, 2, backend="numpy", checkpoint_dir=ckpt).fit(store, client=client, resume=True)
    with pytest.raises(StoreError, match=r"regularization: 0\.05 there, 0\.5 here"):
        ALS(4, 0.5, 2, backend="numpy", checkpoint_dir=ckpt).fit(store, client=client, resume=True)
    rows, cols, vals = store.read_coo("row")
    other = (rows, cols, 6 - vals, (store.m, store.n))
    with pytest.raises(StoreError, match="ratings: "):
        ALS(4, 0.05, 2, backend="numpy", checkpoint_dir=ckpt).fit(other, client=client, resume=True)
    again = ALS(4, 0.05, 2, seed=7, solver="cg", precision="bfloat16", backend="numpy",
                checkpoint_dir=ckpt)  # fmt: skip
    with pytest.warns(CumfWarning, match="resuming a float32 fit in bfloat16 "
                      r"\(model\.precision\): iterations after 1 store"):  # fmt: skip
        again.fit(store, client=client, resume=True)
    assert [r["iteration"] for r in again.metrics_] == [1, 2]
    with pytest.raises(ConfigError, match="checkpoint is at iteration 2, past the 1 asked for"):
        ALS(4, 0.05, 1, backend="numpy", checkpoint_dir=ckpt).fit(store, client=client, resume=True)


def test_numpy_scalars_as_parameters(store, client, tmp_path):
    """np.int64 / np.float32 arguments (from a grid search, say) are taken as the numbers
    they are, and recorded as such in checkpoints and saved models."""
    model = ALS(np.int64(3), np.float32(0.1), np.int64(1), seed=np.uint8(2), backend="numpy",
                checkpoint_dir=str(tmp_path / "ckpt"))  # fmt: skip
    model.fit(store, client=client).save(tmp_path / "m.zarr")
    loaded = ALS.load(tmp_path / "m.zarr")
    assert (loaded.factors, loaded.seed) == (3, 2) and type(loaded.factors) is int
    np.testing.assert_array_equal(loaded.user_factors_, model.user_factors_)
    small = build_store(str(tmp_path / "s.zarr"), [0, 1, 2], [1, 0, 2], [1.0, 2.0, 3.0],
                        tile_rows=np.int64(2), tile_cols=np.int32(2))  # fmt: skip
    assert (small.tile_rows, small.tile_cols) == (2, 2)


def test_resume_on_ids_numbered_otherwise_is_refused(client, tmp_path):
    """The same ratings ingested in another order: counts and statistics agree, the ids'
    numbering does not, so the checkpoint's rows would belong to other users. A store
    rebuilt in place since the checkpoint (other ratings, same counts and statistics) is
    refused too."""
    rng = np.random.default_rng(5)
    pairs = rng.choice(40 * 25, 300, replace=False)  # distinct (user, item) pairs
    users = np.array([f"u{p // 25}" for p in pairs])
    items = np.array([f"i{p % 25}" for p in pairs])
    ratings = rng.uniform(1, 5, 300)
    order = rng.permutation(users.size)
    first = ingest_arrays(tmp_path / "a.zarr", users, items, ratings, test_fraction=0)
    again = ingest_arrays(tmp_path / "b.zarr", users[order], items[order], ratings[order],
                          test_fraction=0)  # fmt: skip
    assert (first.nnz, first.stats) == (again.nnz, pytest.approx(again.stats))
    ckpt = str(tmp_path / "ckpt")
    ALS(3, 0.1, 1, backend="numpy", checkpoint_dir=ckpt).fit(first, client=client)
    with pytest.raises(StoreError, match="user ids: numbered otherwise"):
        ALS(3, 0.1, 2, backend="numpy", checkpoint_dir=ckpt).fit(again, client=client, resume=True)
    swapped = ratings.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # two ratings trade places: the same statistics
    rebuilt = ingest_arrays(tmp_path / "a.zarr", users, items, swapped, test_fraction=0,
                            overwrite=True)  # fmt: skip
    with pytest.raises(StoreError, match=r"store: .*a\.zarr was rebuilt since the checkpoint "
                       r"\(build \w+ there, \w+ here\); to resume, give the store the checkpoint "
                       r"was made on\); run without --resume"):  # fmt: skip
        ALS(3, 0.1, 2, backend="numpy", checkpoint_dir=ckpt).fit(rebuilt, client=client,
                                                                 resume=True)  # fmt: skip


def test_predict_rmse_recommend_save_load(store, client, tmp_path):
    model = ALS(5, 0.05, 3, backend="numpy").fit(store, client=client)
    X, T = model.factors_as_dask()
    np.testing.assert_allclose(X.compute(scheduler=client), model.user_factors_)
    np.testing.assert_allclose(T.compute(scheduler=client), model.item_factors_)
    users, items = np.array([1, 2, 3]), np.array([4, 5, 6])
    expected = (model.user_factors_[users] * model.item_factors_[items]).sum(1)
    np.testing.assert_allclose(model.predict(users, items), expected, rtol=1e-6)
    assert model.rmse(store) == pytest.approx(model.metrics_[-1]["test_rmse"], rel=1e-5)
    assert model.rmse(store, kind="train") == pytest.approx(
        model.metrics_[-1]["train_rmse"], rel=1e-5
    )
    top, scores = model.recommend([0, 5], k=5)
    _, seen, _ = store.read_coo("row", (0, 1))
    assert not set(top[0]) & set(seen.tolist())
    assert (np.diff(scores, axis=1) <= 0).all()
    model.save(tmp_path / "model.zarr")
    loaded = ALS.load(tmp_path / "model.zarr")
    np.testing.assert_array_equal(loaded.user_factors_, model.user_factors_)
    np.testing.assert_array_equal(loaded.predict(users, items), model.predict(users, items))
    assert loaded.metrics_ == model.metrics_


def test_fitted_model_pickles_without_its_cluster(store, client):
    model = ALS(4, 0.05, 2, backend="numpy").fit(store, client=client)
    model.factors_as_dask()  # the live cluster state exists ...
    copy = pickle.loads(pickle.dumps(model))  # ... and is not pickled
    np.testing.assert_array_equal(copy.user_factors_, model.user_factors_)
    np.testing.assert_array_equal(copy.predict([1, 2], [3, 4]), model.predict([1, 2], [3, 4]))
    assert copy.metrics_ == model.metrics_ and copy.plan_.x.q == model.plan_.x.q
    with pytest.raises(NotFittedError, match="while that client is open"):
        copy.factors_as_dask()
    from_arrays = ALS(3, 0.1, 1, backend="numpy").fit(store.read_coo("row"), client=client)
    alone = pickle.loads(pickle.dumps(from_arrays))  # its temporary store stays behind
    with pytest.raises(ConfigError, match=r"names none \(it was fitted on in-memory ratings\): "
                       "pass store="):  # fmt: skip
        alone.recommend([0], k=2)
    assert "fitted 70 users x 40 items, test RMSE " in repr(copy)
    assert repr(ALS(3)).startswith("ALS(factors=3")


def test_a_model_whose_cluster_lost_its_workers_works_on_the_host(store):
    """Scaled to no workers (or restarted), the cluster holds no factors: recommend runs
    here (no wait for a worker), factors_as_dask says why it cannot."""
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as own:  # fmt: skip
        model = ALS(3, 0.1, 2, backend="numpy").fit(store, client=own)
        live = model.recommend([0, 5], k=4)
        cluster.scale(0)
        while own.scheduler_info()["workers"]:
            time.sleep(0.05)
        began = time.perf_counter()
        for got, expected in zip(model.recommend([0, 5], k=4), live, strict=True):
            np.testing.assert_array_equal(got, expected)
        assert time.perf_counter() - began < 5
        with pytest.raises(NotFittedError, match="scaling to no workers lets them go"):
            model.factors_as_dask()


def test_fit_on_arrays_without_client():
    """The store built from the arrays lives as long as the model holds it, and goes
    quietly (no ResourceWarning) when the model refits or is collected."""
    rows, cols, vals = random_ratings(30, 20, 0.3, seed=4)
    model = ALS(3, 0.1, 2, backend="numpy").fit((rows, cols, vals, (30, 20)))
    assert model.user_factors_.shape == (30, 3)
    assert np.isfinite(model.user_factors_).all()
    first = Path(model._tmp.name)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ResourceWarning)
        model.fit((rows, cols, vals, (30, 20)))
        second = Path(model._tmp.name)
        assert not first.exists() and second.exists()
        del model
        gc.collect()
    assert not second.exists()
    assert not [w for w in seen if issubclass(w.category, ResourceWarning)]


def test_bad_input(store, client, tmp_path):
    with pytest.raises(ConfigError, match="factors"):
        ALS(0).fit(store, client=client)
    with pytest.raises(ConfigError, match="'seed' must be >= 0"):
        ALS(2, seed=-1).fit(store, client=client)
    with pytest.raises(StoreError, match="no rating store"):
        ALS(2).fit(str(tmp_path / "missing.zarr"), client=client)
    with pytest.raises(NotFittedError, match="not fitted"):
        ALS(2).predict([0], [0])
    model = ALS(2, 0.1, 1, backend="numpy").fit(store, client=client)
    with pytest.raises(ConfigError, match="out of range"):
        model.predict_indices([M], [0])
    with pytest.raises(ConfigError, match=r"user id 70 is not in the model's user ids"):
        model.predict([M], [0])
    with pytest.raises(StoreError, match="not a cumf-dask model"):
        ALS.load(store.url)
    for users, items in (([[0, 1]], [0]), ([0.7], [1]), ([0, 1], [2])):
        with pytest.raises(ConfigError, match=r"indices must be|pairs"):
            model.predict_indices(users, items)
    with pytest.raises(ConfigError, match="indices must be"):
        model.recommend_indices([[0, 1]], k=2, exclude_seen=False)
    with pytest.raises(ConfigError, match="kind"):
        model.rmse(store, kind="bogus")
    with pytest.raises(ConfigError, match="finite"):
        model.rmse(([0, 1], [0, 1], [1.0, np.nan]))


def test_stores_that_number_their_ids_otherwise_are_refused(client, tmp_path):
    """Scoring or excluding seen items pairs the store's rows with the model's: a store of
    the same shape whose ids sit in other rows is refused, not read as if they matched."""
    rows, cols, vals = random_ratings(30, 20, 0.3, seed=9)
    model = ALS(3, 0.1, 1, backend="numpy").fit((rows + 100, cols, vals), client=client)
    order = np.argsort(-rows, kind="stable")  # first appearance numbers the users otherwise
    other = ingest_input((rows[order] + 100, cols[order], vals[order]), str(tmp_path / "o.zarr"),
                         test_fraction=0.0)  # fmt: skip
    assert (other.m, other.n) == model.shape_
    with pytest.raises(StoreError, match="numbers its users otherwise than the model"):
        model.rmse(other, kind="train")
    with pytest.raises(StoreError, match="numbers its users otherwise"):
        model.recommend([100], k=2, store=other)
    same = ingest_input((rows + 100, cols, vals), str(tmp_path / "s.zarr"), test_fraction=0.0)
    assert model.rmse(same, kind="train") == pytest.approx(model.rmse((rows + 100, cols, vals)))


def test_a_store_rebuilt_where_the_model_was_trained_is_noticed(client, tmp_path, monkeypatch):
    """The model records its store's absolute path and ratings: from another folder it finds
    it, a rebuild there with ids numbered otherwise is refused (not the cached 'matched'),
    and one with other ratings is a warning, not silently other numbers."""
    rows, cols, vals = random_ratings(30, 20, 0.3, seed=9)
    monkeypatch.chdir(tmp_path)
    ingest_arrays("r.zarr", rows + 100, cols, vals, test_fraction=0.2)
    model = ALS(3, 0.1, 1, backend="numpy", precision="bfloat16").fit("r.zarr", client=client)
    assert model.store_url_ == str(tmp_path / "r.zarr")
    model.save("m.zarr")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    loaded = ALS.load("../m.zarr")
    assert loaded.precision == "bfloat16"
    assert loaded.rmse(loaded.store_url_) == pytest.approx(model.rmse("../r.zarr"))
    top, _ = loaded.recommend([100], k=3)
    assert top.shape == (1, 3)
    order = np.argsort(-rows, kind="stable")
    ingest_arrays("../r.zarr", rows[order] + 100, cols[order], vals[order], test_fraction=0.2,
                  overwrite=True)  # fmt: skip
    for fitted in (model, loaded):
        with pytest.raises(StoreError, match="numbers its users otherwise"):
            fitted.rmse("../r.zarr")
    ingest_arrays("../r.zarr", rows + 100, cols, vals + 1, test_fraction=0.2, overwrite=True)
    with pytest.warns(CumfWarning, match="holds other ratings than when the model was trained"):
        model.rmse("../r.zarr")
    ingest_arrays("../s2.zarr", rows + 100, cols, vals, test_fraction=0.2, split_seed=2)
    with pytest.warns(CumfWarning, match=r"s2.zarr holds other ratings than the store it was "
                      r"trained on \(\S+/r.zarr\) .* its held-out ratings may include ones the "
                      "model trained on"):  # fmt: skip
        loaded.rmse("../s2.zarr")
    shutil.rmtree(tmp_path / "r.zarr")
    with pytest.raises(StoreError, match=r"training store cannot be opened .* exclude_seen=False"):
        loaded.recommend([100], k=3)


def closed_client(client):
    """A closed client of `client`'s cluster."""
    from distributed import Client

    other = Client(client.cluster, set_as_default=False)
    other.close()
    return other


def test_api_misuse_is_one_clear_error(store, client):
    with pytest.raises(NotFittedError, match="not fitted"):
        ALS().recommend_indices([1])
    with pytest.raises(ConfigError, match="'backend' must be one of"):
        ALS(backend="gpu").fit(store)
    with pytest.raises(ConfigError, match=r"plan must be a cumf_dask\.config\.PlanConfig"):
        ALS(plan={"p": 2}).fit(store)
    with pytest.raises(ConfigError, match="callbacks must be callables"):
        ALS(callbacks=[1]).fit(store)
    assert ALS(callbacks=print)._callbacks() == [print]
    with pytest.raises(ConfigError, match="callbacks must be a callable or a sequence"):
        ALS(callbacks=5).fit(store)
    with pytest.raises(ConfigError, match="the client is closed"):
        ALS().fit(store, client=closed_client(client))
    cluster = client.cluster
    with pytest.raises(ConfigError, match=r"got the cluster LocalCluster: pass Client\(cluster\)"):
        ALS().fit(store, client=cluster)
    with pytest.raises(ConfigError, match=r"got str 'tcp://x:1': pass Client\(address\)"):
        ALS().fit(store, client="tcp://x:1")
    with pytest.raises(ConfigError, match="progress must be None or a callable"):
        ALS(progress=5).fit(store)
    with pytest.raises(ConfigError, match="'evaluate' must be True or False, got 'no'"):
        ALS(evaluate="no").fit(store)
    with pytest.raises(IngestError, match=r"ingest_arrays\(\.\.\., duplicates=\)"):
        ALS(backend="numpy").fit((np.array([1, 1]), np.array([2, 2]), np.array([3.0, 4.0])))


@pytest.mark.parametrize("cls", [ALS, ImplicitALS])
def test_parameters_follow_the_scikit_learn_convention(cls):
    """get_params names every constructor argument and hands back the very objects given
    (sklearn.base.clone checks identity); set_params refuses an unknown name."""
    log = [print]
    model = cls(factors=7, callbacks=log, seed=3)
    params = model.get_params()
    assert set(params) == set(inspect.signature(cls).parameters)
    assert params["factors"] == 7 and params["seed"] == 3 and params["callbacks"] is log
    twin = cls(**params)
    assert all(twin.get_params()[k] is v for k, v in params.items())
    assert model.set_params(factors=9, iterations=2) is model
    assert (model.factors, model.iterations) == (9, 2)
    with pytest.raises(ConfigError, match="has no parameter 'rank'; its parameters are factors"):
        model.set_params(rank=4)


def test_parameters_set_after_a_fit_are_the_next_fits(store, client, tmp_path):
    """save, repr and fold-in keep to the parameters the factors were fitted with."""
    model = ALS(3, 0.05, 2, backend="numpy").fit(store, client=client)
    model.set_params(factors=9, regularization=5.0)
    assert "(fitted with factors=3, regularization=0.05)" in repr(model)
    model.save(tmp_path / "m.zarr")
    loaded = ALS.load(tmp_path / "m.zarr")
    assert (loaded.factors, loaded.regularization) == (3, 0.05)
    assert "fitted with" not in repr(loaded)
    implicit = ImplicitALS(3, 0.05, 1.0, 2, backend="numpy").fit(store, client=client)
    new_user = (np.zeros(3, int), np.arange(3), np.ones(3))
    before = implicit.recalculate_user(new_user)
    implicit.set_params(alpha=40.0)
    np.testing.assert_array_equal(implicit.recalculate_user(new_user), before)
    assert "(fitted with alpha=1.0)" in repr(implicit)


def test_numpy_cholesky_gives_nan_rows_for_systems_not_positive_definite():
    """As the GPU's Cholesky does, so the fit reports a NumericalError, not LinAlgError."""
    from cumf_dask.backend.numpy_backend import cholesky_solve

    M = np.stack([np.eye(3) * 2, -np.eye(3), np.eye(3)])
    x = cholesky_solve(M, np.ones((3, 3)))
    np.testing.assert_allclose(x[[0, 2]], [[0.5] * 3, [1.0] * 3])
    assert np.isnan(x[1]).all()


def test_checkpoints_of_a_shorter_rerun_survive(store, client, tmp_path):
    """A longer earlier run in the same folder never makes the new checkpoint disappear."""
    ckpt = str(tmp_path / "ckpt")
    ALS(3, 0.05, 4, backend="numpy", checkpoint_dir=ckpt).fit(store, client=client)
    with pytest.warns(CumfWarning, match=r"checkpoints of an earlier fit \(iter-00004, iter-"):
        ALS(3, 0.05, 1, backend="numpy", checkpoint_dir=ckpt).fit(store, client=client)
    resumed = ALS(3, 0.05, 2, backend="numpy", checkpoint_dir=ckpt)
    resumed.fit(store, client=client, resume=True)
    assert [r["iteration"] for r in resumed.metrics_] == [1, 2]


def test_save_refuses_to_replace_a_foreign_folder(store, client, tmp_path):
    model = ALS(2, 0.1, 1, backend="numpy").fit(store, client=client)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(StoreError, match="refusing"):
        model.save(precious)
    assert (precious / "notes.txt").read_text() == "keep me"
    model.save(tmp_path / "m.zarr")
    model.save(tmp_path / "m.zarr")  # replacing an earlier model is fine
    with pytest.raises(StoreError, match="not URLs"):
        model.save("memory://m.zarr")
