"""A whole configured job: data -> plan -> fit -> evaluate -> save, recorded in a run folder."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .budget import check_cpu_time, forecast_note
from .callbacks import Log, Progress
from .checkpoint import Checkpointer
from .config import Config, DataConfig, is_rating_store
from .data.store import RatingsStore
from .engine.cluster import (
    client_resources,
    cluster_client,
    local_resources,
    transport,
    worker_addresses,
)
from .engine.plan import Plan, make_plan
from .errors import ConfigError, IngestError, StoreError, warn
from .model import ALS
from .paths import check_writable, is_url, normalize_url, signals_deferred
from .records import RunFolder, runs_dir, warm_plotting

if TYPE_CHECKING:
    from .data import ingest


def prepare_store(
    config: Config, client: Any = None, progress: Progress | None = None, log: Log = print
) -> RatingsStore:
    """Open the configured store, generating or ingesting it first when the config says so.

    An existing complete store is reused unless ``data.overwrite`` is true, and only when
    the config's settings built it (:func:`_check_reuse`).
    """
    data = config.data
    if data.source == "store":
        return RatingsStore.open(data.store)
    store = None if data.overwrite else _reused(config, log)
    if store is not None:
        return store
    if data.source == "generate":
        from .data.planted import PlantedModel
        from .data.synthetic import generate

        return generate(
            data.store, PlantedModel.create(**asdict(data.generate)),
            test_fraction=data.test_fraction, split_seed=data.split_seed,
            tile_rows=data.tile_rows, tile_cols=data.tile_cols, client=client, overwrite=True,
            progress=progress,
        )  # fmt: skip
    # A store that failed to open (missing or partial) is replaced.
    return ingest_from_config(replace(data, overwrite=True), progress=progress)


def _reused(config: Config, log: Log, check: bool = True) -> RatingsStore | None:
    """The complete store at data.store, which the config's generate or ingest step then
    does not build (`check`: refused when built from other settings, :func:`_check_reuse`),
    or None when there is none."""
    data = config.data
    store = _complete_store(data.store)
    if store is None:
        return None
    if check:
        _check_reuse(config, store)
        log(f"using the existing store {data.store} (data.overwrite: true rebuilds it)")
    else:
        log(f"planned on the existing store {data.store} as it is (train rebuilds it: "
            "data.overwrite is true)")  # fmt: skip
    return store


def ingest_from_config(
    cfg: DataConfig,
    url: str | PathLike[str] | None = None,
    *,
    chunk_rows: int = 1_000_000,
    progress: ingest.Progress | None = None,
) -> RatingsStore:
    """Run ``cfg.ingest`` into `url` (default ``cfg.store``) with cfg's split, tiles, overwrite."""
    from .data.ingest import ingest_file

    return ingest_file(
        _ingest_path(cfg), url if url is not None else cfg.store, **_ingest_settings(cfg),
        rating_min=cfg.ingest.rating_min, rating_max=cfg.ingest.rating_max,
        tile_rows=cfg.tile_rows, tile_cols=cfg.tile_cols, overwrite=cfg.overwrite,
        chunk_rows=chunk_rows, progress=progress,
    )  # fmt: skip


def _ingest_path(data: DataConfig) -> str:
    """data.ingest.path; left empty, or naming a rating store (nothing to ingest), a config
    error."""
    path = data.ingest.path
    if not path:
        raise ConfigError("data.ingest.path is empty: set the input file to ingest")
    if is_rating_store(path):
        raise ConfigError(f"data.ingest.path {path} is a rating store already, not a ratings "
                          f"file: train on it with data.source: store, data.store: {path} "
                          f"(cumf-dask train --store {path})")  # fmt: skip
    return path


def _ingest_settings(data: DataConfig) -> dict[str, Any]:
    """What shapes an ingested store besides its input and scale, as ingest_file takes it
    and records it in the store's source."""
    ing = data.ingest
    return dict(
        format=ing.format, delimiter=ing.delimiter, header=ing.header, columns=ing.columns,
        duplicates=ing.duplicates, m=ing.m, n=ing.n, test_fraction=data.test_fraction,
        split=data.split, split_seed=data.split_seed,
    )  # fmt: skip


def _check_reuse(config: Config, store: RatingsStore) -> None:
    """Refuse to silently reuse a store that was built from other settings than the config's
    (generated: the generator's, the test share and split seed; ingested: the input file,
    what it was read with and split by, and the file itself changed since).

    A store of another kind (ingested ratings where the config generates, generated ones
    where it ingests) holds data that no rebuild may delete: the fixes offered keep it.
    """
    data = config.data
    kind = store.source.get("kind")
    generated = kind == "synthetic"
    if generated != (data.source == "generate"):
        built = "generated (synthetic)" if generated else _built_from(store.source)
        wanted = "generate data" if data.source == "generate" else f"ingest {data.ingest.path}"
        raise StoreError(
            f"{data.store} exists and holds ratings {built}, but the config has data.source: "
            f"{data.source}; to train on that store as it is: cumf-dask train --store "
            f"{data.store}; to {wanted}, point data.store at another path"
        )
    differ = (_generated_differences if generated else _ingested_differences)(data, store.source)
    if differ:
        raise StoreError(
            f"{data.store} exists but is not the store this config builds ({'; '.join(differ)}"
            "); set data.overwrite: true to rebuild it, point data.store elsewhere, or train "
            f"on it as it is: cumf-dask train --store {data.store}"
        )


def _generated_differences(data: DataConfig, source: dict[str, Any]) -> list[str]:
    """'key: store value (the config: value)' for each generator setting, test share or
    split seed in which a generated store differs from the config."""
    from .data.planted import PlantedModel

    want = dict(PlantedModel.create(**asdict(data.generate)).settings)
    want.update(test_fraction=data.test_fraction, split_seed=data.split_seed)
    return _differences(want, {key: source.get(key) for key in want})


def _ingested_differences(data: DataConfig, source: dict[str, Any]) -> list[str]:
    """How an ingested store differs from what the config would ingest: its input (the
    path resolved: the same words name another file from another working folder), what it
    was read with and split by, then whether the input changed since. A store from before
    these were recorded is compared on what it records: its path, format, duplicates and
    scale (recorded only when declared)."""
    from .data.ingest import resolved_location

    path = _ingest_path(data)
    then = source.get("resolved") or (source.get("path") and resolved_location(source["path"]))
    now = resolved_location(path)
    if then != now:
        return [f"input: {then or _built_from(source)} (the config: {now})"]
    want = {**_ingest_settings(data), "rating_min": data.ingest.rating_min,
            "rating_max": data.ingest.rating_max}  # fmt: skip
    recorded = {key: value for key, value in want.items()
                if key in source or key.startswith("rating_")}  # fmt: skip
    differ = _differences(recorded, {key: source.get(key) for key in recorded})
    return differ or _changed_input(path, source)


def _changed_input(path: str, source: dict[str, Any]) -> list[str]:
    """How the input file(s) changed since the store was ingested from them (how many,
    their bytes, the latest modification time): nothing when none of that was recorded, or
    the input is gone (the store stands for it then)."""
    from .data.ingest import input_identity
    from .data.readers import Files

    if "bytes" not in source:
        return []
    try:
        now = input_identity(path, Files(path, unit="line"))
    except IngestError:
        return []
    changed = [f"{key} {source.get(key)} then, {now[key]} now"
               for key in ("files", "bytes", "modified")
               if source.get(key) != now[key]]  # fmt: skip
    return [f"{path} changed since it was ingested ({'; '.join(changed)})"] if changed else []


def _differences(want: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """'key: got (the config: want)' for each key of `want` whose value `got` does not hold."""
    return [f"{key}: {got[key]!r} (the config: {want[key]!r})"
            for key in want if got[key] != want[key]]  # fmt: skip


def _built_from(source: dict[str, Any]) -> str:
    """'ingested from plays.csv', 'ingested from arrays': where a store's ratings came from."""
    origin = source.get("path") or source.get("kind") or "an unknown source"
    return f"ingested from {origin}"


def check_inputs(config: Config) -> None:
    """Fail before any cluster starts when the config's input is missing or invalid: a store
    to open that is not there, a file to ingest that is not there (unless a complete store
    built from it is reused), generator settings that do not make a shape."""
    data = config.data
    if data.source == "generate":
        from .data.planted import PlantedModel

        PlantedModel.create(**asdict(data.generate))
        return
    if data.source == "store" or not data.overwrite:
        try:
            store = RatingsStore.open(data.store)
        except StoreError:
            if data.source == "store":
                raise
        else:
            if data.source == "ingest":
                _check_reuse(config, store)
            return
    from .data.readers import Files

    Files(_ingest_path(data), unit="line")  # raises for a missing file or an empty glob


@dataclass
class JobPlan:
    """A config's plan, and the data it was made from.

    `store` is the store planned on (None when it is still to be generated: the plan then
    comes from the generator's shape with even splits, `estimated`); `generate_nnz` the
    ratings to generate first (0 when the store exists).
    """

    plan: Plan
    store: RatingsStore | None
    generate_nnz: int = 0

    @property
    def estimated(self) -> bool:
        return self.store is None


def job_plan(
    config: Config,
    client: Any = None,
    progress: Progress | None = None,
    log: Log = print,
    *,
    rebuild: bool = True,
) -> JobPlan:
    """The plan of this config on this client's workers, or with no client on the local
    cluster the config would start (read from this machine, no cluster started).

    With an existing store the plan uses its exact counts; a file to ingest is ingested
    first (its counts are only known then). A store still to be generated is planned from
    the generator's shape with even splits, so planning a billion-rating config does not
    first build it. `rebuild` False (``cumf-dask plan``): a complete store of an ingest
    config is planned on as it is, even with data.overwrite (only train rebuilds it).
    """
    f = config.model.factors
    data = config.data
    store: RatingsStore | None = None
    if data.source == "store":
        store = RatingsStore.open(data.store)
    elif data.source == "ingest":  # ingest needs no cluster; a complete store is reused
        if not rebuild and data.overwrite:  # plan: on the store as it is, if there is one
            store = _reused(config, log, check=False)
        if store is None:
            overwrite = replace(data, overwrite=data.overwrite and rebuild)
            store = prepare_store(replace(config, data=overwrite), None, progress, log)
    elif not data.overwrite:
        store = _reused(config, log)  # None: generated when the job runs
    if store is None:
        from .data.presets import resolve_shape

        gen = config.data.generate
        m, n, total = resolve_shape(preset=gen.preset, scale=gen.scale, m=gen.m, n=gen.n,
                                    nnz=gen.nnz, nonempty=gen.nonempty)  # fmt: skip
        nnz = int(total * (1 - config.data.test_fraction))
        counts: tuple[Any, Any] = (None, None)
    else:
        m, n, nnz, total = store.m, store.n, store.nnz, 0
        counts = (store.counts("row"), store.counts("col"))
    if client is None:
        res = local_resources(config.cluster, nnz)
    else:
        res = client_resources(client, config.cluster.backend)
    held_out = store.nnz_test if store is not None else total - nnz  # the test RMSE's blocks
    # the link's bandwidth is measured when a fit starts; the plan assumes the transport's
    tensor_cores = config.model.precision == "float32" and config.model.kind == "explicit"
    plan = make_plan(m, n, nnz, f, res.workers, res.memory, *counts, config.plan, res.backend,
                     transport=res.transport, host_memory=res.host_memory, held_out=held_out,
                     tensor_cores=tensor_cores, checkpoint=config.output.checkpoint)  # fmt: skip
    return JobPlan(plan, store, total)


def planted_reference(source: dict[str, Any]) -> dict[str, Any]:
    """What a generated store's test RMSE can be compared with: the noise sigma (the floor
    when ratings are neither clipped nor rounded), and the test RMSE of the planted
    X* Theta*^T before clipping and rounding. Clipping removes noise that a fitted model can
    learn (a rating at the top of the scale is the top whatever the noise), so a fitted
    model may score below the planted model then. Empty for a store that was not generated."""
    if source.get("kind") != "synthetic":
        return {}
    return {
        "planted_test_rmse": source.get("planted_test_rmse"),
        "noise": source.get("noise"),
        "clipped": any(source.get(k) is not None for k in ("rating_min", "rating_max")),
        "rounded": bool(source.get("round")),
    }


def predicted_and_measured(plan: Plan, metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """The cost model's seconds per half-step beside the measured median of the iterations
    after the first (which loads the blocks and compiles kernels)."""
    steady = metrics[1:] or metrics
    out: dict[str, Any] = {}
    for h, key in ((plan.x, "x_seconds"), (plan.theta, "theta_seconds")):
        measured = statistics.median(r[key] for r in steady) if steady else None
        out[h.label] = {"predicted": h.predicted.get("seconds"), "measured": measured}
    return out


def make_model(config: Config, **options: Any) -> ALS:
    """The estimator of ``config.model``: :class:`ALS`, or :class:`ImplicitALS` for
    ``kind: implicit``; `options` are the estimators' shared keyword arguments."""
    m = config.model
    common = dict(
        backend=config.cluster.backend, precision=m.precision, solver=m.solver,
        cg_steps=m.cg_steps, **options,
    )  # fmt: skip
    if m.kind == "implicit":
        from .implicit.model import ImplicitALS

        return ImplicitALS(
            m.factors, m.regularization, m.alpha, m.iterations, m.seed,
            confidence=m.confidence, eps=m.eps, regularization_mode=m.regularization_kind(),
            **common,
        )  # fmt: skip
    if m.regularization_kind() != "weighted":
        raise ConfigError(
            "model.regularization_mode: the explicit model uses weighted lambda; 'plain' is "
            "for model.kind: implicit"
        )
    return ALS(m.factors, m.regularization, m.iterations, m.seed, **common)


@dataclass
class TrainResult:
    model: ALS
    run: RunFolder
    store: RatingsStore
    summary: dict[str, Any]


def train(
    config: Config,
    *,
    resume: bool = False,
    client: Any = None,
    force: bool = False,
    on_iteration: Callable[[dict[str, Any]], None] | None = None,
    progress: Progress | None = None,
    log: Log = print,
    command: str | None = None,
) -> TrainResult:
    """Run a configured job end to end and write its run folder.

    Before any cluster starts the inputs are checked and the job is planned (on this
    machine when the cluster is local); a CPU job forecast over an hour is refused unless
    `force` (:mod:`.budget`). `on_iteration` gets each iteration's metrics record;
    `progress(stage, done, total)` the data stages, stage "train" (iterations done) and the
    half-steps' batches ("update X", "update Theta"); `log` one-line messages. `command`:
    the command line that resumes this job, named in the advice after a failure (default:
    ``train(config, resume=True)``).
    """
    if resume and not config.output.checkpoint:
        raise ConfigError("--resume needs output.checkpoint: true (this config turns "
                          "checkpoints off)")  # fmt: skip
    _check_outputs(config)  # before a cluster starts or any input is read
    run = RunFolder.latest(config) if resume else None
    if resume and run is None:
        log(f"no earlier run of '{config.output.name}' with checkpoints: starting fresh")
    data_step = _resumed_data(config, run, log) if run is not None else config
    check_inputs(data_step)
    result = None
    try:
        with ExitStack() as stack:
            if run is not None:  # one writer per run folder: a second resume fails at once
                stack.enter_context(Checkpointer(run.checkpoints).locked())
            if client is None and config.cluster.address is None:  # planned before it starts
                planned = _planned(data_step, None, force, progress, log)
                nnz = planned.plan.x.nnz
                client = stack.enter_context(cluster_client(config.cluster, nnz=nnz))
            else:
                if client is None:
                    client = stack.enter_context(cluster_client(config.cluster))
                planned = _planned(data_step, client, force, progress, log)
            job = _Job(config, on_iteration, progress, log, command)
            result = _train(job, run, client, planned.store)
    except KeyboardInterrupt:
        if result is None:
            raise
        # Ctrl-C while the cluster closed: the run itself finished and is recorded
        log("interrupted while the cluster was closing; the run had finished and is saved")
    return result


def _resumed_data(config: Config, run: RunFolder, log: Log) -> Config:
    """The config whose data step a --resume of `run` takes: the store its checkpoints were
    made on, as it is (``source: store``), when it is at data.store: whether it would be
    built from these settings and input today does not matter to them, and touching the
    input file must not stop a resume. Refused before any data step when that step would
    build the store anew where the checkpoints were made on it: data.overwrite rebuilds
    it, or it is gone and would be built again. A new build is another store to them (its
    build id): the resume would be refused once the build is done, hours later at full
    size, and with data.overwrite the store they could resume on would be gone for good."""
    data = config.data
    if data.source == "store":
        return config
    if data.overwrite:
        raise ConfigError(
            f"--resume with data.overwrite: true would rebuild {data.store}, the store the "
            f"checkpoints of {run.path} were made on, and they do not resume on another "
            "build; resume with --set data.overwrite=false"
        )
    from .data.ingest import resolved_location

    made_on = Checkpointer(run.checkpoints).store_url()
    if made_on != resolved_location(data.store):
        return config  # made on another store (or unknown): the data step as configured
    if _complete_store(data.store) is None:
        raise StoreError(
            f"{data.store}: the store the checkpoints of {run.path} were made on is gone, and "
            "they do not resume on a store built again (another build); put it back there, "
            "or run without --resume to start over"
        )
    log(f"resuming on {data.store}, the store the checkpoints were made on, as it is")
    return replace(config, data=replace(data, source="store"))


def _complete_store(url: str) -> RatingsStore | None:
    """The complete store at `url`, or None when none opens there."""
    try:
        return RatingsStore.open(url)
    except StoreError:
        return None


def _check_outputs(config: Config) -> None:
    """Every location the job writes is writable (StoreError otherwise): the run folder, and
    the store when it is to be built (not a complete one reused where it is). Run folders
    are local: an output.dir URL is refused (it would name a local folder ``s3:``)."""
    check_writable(runs_dir(config), "the run folder", folder=True)
    data = config.data
    built = not is_url(data.store) and (Path(normalize_url(data.store)) / "zarr.json").is_file()
    if data.source != "store" and (data.overwrite or not built):
        check_writable(data.store, "the rating store")


def _planned(
    config: Config, client: Any, force: bool, progress: Progress | None, log: Log
) -> JobPlan:
    """job_plan, refused when a CPU job is forecast too long (unless forced), else its
    forecast logged when it is long enough to mention."""
    planned = job_plan(config, client, progress, log)
    fc = check_cpu_time(config, planned.plan, planned.generate_nnz, force=force)
    note = forecast_note(config, planned.plan, fc)
    if note:
        log(note)
    return planned


@dataclass
class _Job:
    """What train() was given that its steps share: the config, the callbacks, and the
    command line that resumes the job (None: the Python call)."""

    config: Config
    on_iteration: Callable[[dict[str, Any]], None] | None
    progress: Progress | None
    log: Log
    command: str | None

    def after_error(self) -> str:
        """What to do, once space is freed, after a full disk stopped the run: resume it
        (the checkpoints and a saved model are kept), or train again without checkpoints."""
        if not self.config.output.checkpoint:
            return "then train again"
        if self.command:
            return f"then run the same command with --resume: `{self.command}`"
        return "then run train(config, resume=True) (it goes on from the checkpoints)"


def _train(job: _Job, run: RunFolder | None, client: Any, store: RatingsStore | None
           ) -> TrainResult:  # fmt: skip
    """train() once the cluster is up: `store` is the one planned on (None: prepare it);
    `run` the run folder resumed (None: a new one)."""
    config, progress, log = job.config, job.progress, job.log
    resume = run is not None
    if client.dashboard_link and config.cluster.dashboard_address is not None:
        log(f"Dask dashboard: {client.dashboard_link}")
    log(f"{len(worker_addresses(client))} workers, transport {transport(client)}")
    if store is None:
        store = prepare_store(config, client, progress, log)
    run = run or RunFolder.create(config)
    warm_plotting()  # the plot at the end does not wait for matplotlib's import
    started = time.perf_counter()
    model = _fit(job, run, client, store, resume)
    cleared = run.clear_damaged_model()
    if cleared:
        log(cleared)
    try:
        model.save(run.model, after_error=run.after_error)
    except BaseException:
        if resume:  # the record stays its saved model's (the fit appended its iterations)
            run.restore_metrics()
        raise
    with signals_deferred():  # the record is completed (a second or less), then a Ctrl-C
        summary = _record(job, run, store, model, resume, started)
    return TrainResult(model, run, store, summary)


def _record(job: _Job, run: RunFolder, store: RatingsStore, model: ALS, resume: bool,
            started: float) -> dict[str, Any]:  # fmt: skip
    """The run's record of its saved model: config, metrics, plan, plot, summary, -latest."""
    config = job.config
    if resume:  # a resumed run's record changes only once its model is saved
        run.write_config(config)
    run.write_metrics(model.metrics_)  # the fit's own list: no iteration lost, none twice
    run.write_plan(model.plan_)
    plot = _plot(run, model.metrics_, f"{config.output.name}: {store.m:,} x {store.n:,}, "
                                      f"f={config.model.factors}")  # fmt: skip
    last = model.metrics_[-1] if model.metrics_ else {}
    summary = {
        "run": str(run.path),
        "latest": str(run.latest_link(config)),
        "store": store.url,
        "shape": [store.m, store.n],
        "nnz": store.nnz,
        "factors": config.model.factors,
        "iterations": len(model.metrics_),
        "seconds": time.perf_counter() - started,
        "seconds_per_iteration": (
            sum(r["seconds"] for r in model.metrics_) / len(model.metrics_)
            if model.metrics_ else None
        ),
        "kind": config.model.kind,
        "train_rmse": last.get("train_rmse"),
        "test_rmse": last.get("test_rmse"),
        "loss": last.get("loss"),
        **planted_reference(store.source),
        "model": str(run.model),
        "plot": str(plot) if plot else None,
        "half_step_seconds": predicted_and_measured(model.plan_, model.metrics_),
    }  # fmt: skip
    run.write_summary(summary)  # before -latest moves: the run it names has its summary
    if run.make_latest(config) is None:
        summary["latest"] = None
        run.write_summary(summary)
    return summary


def _fit(job: _Job, run: RunFolder, client: Any, store: RatingsStore, resume: bool) -> ALS:
    """The fitted model, its iterations appended to metrics.jsonl as they end. A new run's
    folder that no iteration finished in is removed when the fit (or writing its config)
    fails, so --resume never finds it."""
    config, progress, iterations = job.config, job.progress, job.config.model.iterations

    def record(metrics: dict[str, Any]) -> None:
        run.append_metrics(metrics)
        if job.on_iteration:
            job.on_iteration(metrics)
        if progress:
            progress("train", metrics["iteration"], iterations)

    try:
        if not resume:
            run.write_config(config)  # a full disk now: "then run again", nothing to resume
        run.after_error = job.after_error()
        model = make_model(
            config, plan=config.plan, callbacks=[record], progress=progress,
            checkpoint_dir=str(run.checkpoints) if config.output.checkpoint else None,
        )  # fmt: skip
        if progress:
            progress("train", 0, iterations)
        model.fit(store, client=client, resume=resume)
    except BaseException:
        if resume:  # the record stays its saved model's, iterations included
            run.restore_metrics()
        else:
            run.discard_if_empty()
        raise
    return model


def _plot(run: RunFolder, metrics: list[dict[str, Any]], title: str) -> Path | None:
    """The run's plot, or None with a CumfWarning when it cannot be written: the model is
    saved by then, and the metrics are in metrics.jsonl, so a plot never fails a run."""
    try:
        return run.plot(metrics, title)
    except OSError as exc:
        warn(f"{run.path}: the plot was not written ({exc.strerror or exc}); the model is "
             "saved and every iteration's metrics are in metrics.jsonl")
        return None
