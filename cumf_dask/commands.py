"""What each ``cumf-dask`` command does: generate, ingest, info, plan, train, evaluate,
recommend, bench. The parser and the exit codes are in :mod:`.cli`; what they print is
built in :mod:`.output`. Heavy imports happen inside the commands, so ``--help`` is quick.
"""

from __future__ import annotations

import argparse
import os
import re
import runpy
import shlex
import sys
from contextlib import ExitStack, redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np

from .config import Config, GenerateConfig, check_columns, is_rating_store, load_config
from .errors import ConfigError, IngestError
from .output import Output, recommend_table, report_store, rmse_line

QUICKSTART = Path(__file__).with_name("quickstart.yaml")
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# `train --store PATH` without a config: model settings for real rating data. f = 64 is a
# common middle; with the weighted lambda (n_u lambda per row) 0.1 held up better than the
# paper's Netflix 0.05 on sparser data: on a MovieLens-1M-shaped planted model (noise 0.9,
# rounded stars) f = 64 scored test RMSE 0.894 with 0.1, 0.924 with 0.05, 1.055 with 0.02.
OWN_DATA = {"factors": 64, "regularization": 0.1, "iterations": 10}
USERS = 10_000  # evaluate: users sampled for the ranking metrics of an explicit model
K = 10  # evaluate: length of the ranked lists


def cmd_generate(args: argparse.Namespace, out: Output) -> None:
    from dataclasses import asdict

    from .data.planted import PlantedModel
    from .data.synthetic import generate

    gen = GenerateConfig(
        preset=args.preset, scale=args.scale, m=args.m, n=args.n, nnz=args.nnz, rank=args.rank,
        noise=args.noise, skew=args.skew, rating_min=args.rating_min,
        rating_max=args.rating_max, round=args.round, nonempty=not args.allow_empty,
        seed=args.seed,
    )  # fmt: skip
    model = PlantedModel.create(**asdict(gen))
    with out.progress() as progress:
        store = generate(
            args.output, model, test_fraction=args.test_fraction, split_seed=args.split_seed,
            tile_rows=args.tile_rows, tile_cols=args.tile_cols, overwrite=args.overwrite,
            progress=progress,
        )  # fmt: skip
    report_store(store, out)


def cmd_ingest(args: argparse.Namespace, out: Output) -> None:
    from .data.ingest import ingest_file

    if not args.file.strip():
        raise ConfigError("the input path is empty: give the ratings file to ingest")
    if is_rating_store(args.file):
        raise IngestError(
            f"{args.file}: is a rating store already, not a ratings file: `cumf-dask info "
            f"{args.file}` describes it, `cumf-dask train --store {args.file}` trains on it"
        )
    columns = None
    if args.columns:
        names = [c.strip() for c in args.columns.split(",")]
        columns = [int(c) if c.isdecimal() else c for c in names]
        check_columns("--columns", columns)
    with out.progress() as progress:
        store = ingest_file(
            args.file, args.output, args.format, delimiter=args.delimiter, header=args.header,
            columns=columns, duplicates=args.duplicates, m=args.m, n=args.n,
            rating_min=args.rating_min, rating_max=args.rating_max,
            test_fraction=args.test_fraction, split_seed=args.split_seed, split=args.split,
            tile_rows=args.tile_rows, tile_cols=args.tile_cols, overwrite=args.overwrite,
            progress=progress,
        )  # fmt: skip
    report_store(store, out)


def cmd_info(args: argparse.Namespace, out: Output) -> None:
    from .data.store import RatingsStore

    store = RatingsStore.open(args.store)
    verified = None
    if args.verify:
        from .data.verify import verify_store

        with out.progress() as progress:
            verified = verify_store(store, progress)
    report_store(store, out, verified)


def resume_command(args: argparse.Namespace) -> str:
    """The command line that ran this train, with --resume: the advice after a failure
    repeats the user's own arguments (--store, --set), not a CONFIG they may not have."""
    words = getattr(args, "argv", None)
    words = sys.argv[1:] if words is None else words
    return shlex.join(["cumf-dask", *(w for w in words if w != "--resume"), "--resume"])


def run_name(url: str) -> str:
    """A run name from a store's path or URL: data/ml-1m.zarr -> ml-1m."""
    stem = re.sub(r"\.zarr$", "", url.rstrip("/").rsplit("/", 1)[-1])
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", stem).strip("-.") or "store"


def job_config(args: argparse.Namespace) -> Config:
    """The config of plan/train: the given file, else the embedded quickstart, with --set.

    ``--store PATH`` trains on an existing store: with a config file it only replaces the
    data source; without one, the model settings are OWN_DATA's and the run is named after
    the store (``data/ml.zarr`` -> ``runs/ml-<timestamp>``).
    """
    if args.store is None:
        return load_config(args.config or QUICKSTART, overrides=args.set)
    data: dict[str, Any] = {"data": {"source": "store", "store": args.store}}
    if args.config is None:
        data.update(model=dict(OWN_DATA), output={"name": run_name(args.store)})
    return load_config(args.config, overrides=args.set, data=data)


def cmd_plan(args: argparse.Namespace, out: Output) -> None:
    from .budget import check_cpu_time, forecast
    from .engine.cluster import cluster_client
    from .pipeline import check_inputs, job_plan

    config = job_config(args)
    check_inputs(config)
    with ExitStack() as stack, out.progress() as progress:
        client = None  # a local cluster is planned from this machine, without starting it
        if config.cluster.address:
            client = stack.enter_context(cluster_client(config.cluster))
        planned = job_plan(config, client, progress, out.log, rebuild=False)
    plan = planned.plan
    fc = forecast(config, plan, planned.generate_nnz)
    refusal = None
    try:
        check_cpu_time(config, plan, planned.generate_nnz)
    except ConfigError as exc:
        refusal = str(exc)
    note = "estimated from the generator's shape: the store is not built yet (even splits)"

    def human() -> None:
        print(plan.table())
        if planned.estimated:
            print(note)
        print(f"forecast: {fc.describe()} (cost model: cumf_dask/engine/costs.py)")
        if refusal:
            print(f"train would refuse it: {refusal}")

    out.result({**plan.to_dict(), "estimated": planned.estimated, "forecast": fc.to_dict(),
                "refused": refusal}, human)  # fmt: skip


def cmd_train(args: argparse.Namespace, out: Output) -> None:
    from .pipeline import train

    config = job_config(args)
    total = config.model.iterations

    def line(r: dict[str, Any]) -> None:
        parts = [f"iteration {r['iteration']}/{total}", f"{r['seconds']:.3f} s",
                 f"(X {r['x_seconds']:.3f} s, Theta {r['theta_seconds']:.3f} s)"]  # fmt: skip
        for key in ("train_rmse", "test_rmse"):
            if key in r:
                parts.append(f"{key.replace('_', ' ')} {r[key]:.4f}")
        if "loss" in r:
            parts.append(f"loss {r['loss']:.6g}")
        out.log("  ".join(parts))

    with out.progress() as progress:
        result = train(config, resume=args.resume, force=args.force, on_iteration=line,
                       progress=progress, log=out.log, command=resume_command(args))  # fmt: skip
    summary = result.summary

    def human() -> None:
        also = f" (also {summary['latest']})" if summary["latest"] else ""
        print(f"model saved to {summary['model']}; run folder {summary['run']}{also}")
        text = rmse_line(summary)
        if text is None and summary.get("loss") is not None:  # an implicit model's
            text = f"final loss {summary['loss']:.6g}"
        if text:
            print(text)

    out.result(summary, human)


def cmd_evaluate(args: argparse.Namespace, out: Output) -> None:
    from .evaluate import ranking_metrics
    from .model import ALS
    from .records import model_path

    ranked = {"-k": args.k, "--threshold": args.threshold, "--users": args.users}
    args.k = K if args.k is None else args.k
    _check_k(args.k)
    if args.users is not None and args.users < 1:
        raise ConfigError(f"--users must be at least 1, got {args.users}")
    model = ALS.load(model_path(args.model))
    store = _evaluated_store(args, model)
    if args.k > model.shape_[1]:
        out.log(f"k={args.k} is more than the {model.shape_[1]:,} items: ranking metrics at "
                f"k={model.shape_[1]:,}")  # fmt: skip
    if getattr(model, "implicit", False):
        result = _implicit_metrics(args, model, store)
    else:
        ranking = {}  # first: a threshold no held-out rating reaches fails at once
        if store.has_test:
            ranking = ranking_metrics(model, store, k=args.k, threshold=args.threshold,
                                      max_users=args.users or USERS)  # fmt: skip
        else:
            _no_held_out(store, [k for k, v in ranked.items() if v is not None], out)
        result = {"train_rmse": model.rmse(store, kind="train")}
        if store.has_test:
            result["test_rmse"] = model.rmse(store, kind="test")
        result.update(ranking)

    def human() -> None:
        width = max(map(len, result)) + 2
        for key, value in result.items():
            print(f"{key:<{width}}{value:.4f}" if isinstance(value, float)
                  else f"{key:<{width}}{value}")  # fmt: skip

    out.result(result, human)


def _evaluated_store(args: argparse.Namespace, model: Any) -> Any:
    """The store given after the model, else the model's training store: one that moved or
    was deleted since is named as the model's, with the way to give another."""
    if args.store:
        return model._matching(args.store)
    if not model.store_url_:
        raise ConfigError(f"{args.model} names no training store: give the store to evaluate on")
    fix = "give the store to evaluate on after the model: cumf-dask evaluate MODEL STORE"
    return model._matching(model._open_training_store(model.store_url_, fix))


def _no_held_out(store: Any, options: list[str], out: Output) -> None:
    """A store without held-out ratings gives the training RMSE only: said in one line, and
    refused (ConfigError) where ranking options ask for what it cannot give."""
    build = "build one with --test-fraction, or data.test_fraction in a config"
    if options:
        raise ConfigError(
            f"{store.url} has no held-out ratings, so {', '.join(options)} have nothing to "
            "rank: leave them out for the training RMSE alone, or give a store with held-out "
            f"ratings after the model ({build})"
        )
    out.log(f"{store.url} has no held-out ratings: only the training RMSE (a store with "
            f"held-out ratings also gives the test RMSE and ranking metrics: {build})")  # fmt: skip


def cmd_recommend(args: argparse.Namespace, out: Output) -> None:
    from .model import ALS
    from .records import model_path

    _check_k(args.k)
    model = ALS.load(model_path(args.model))
    store = None  # the training store, whose items the user rated are left out
    if args.include_rated and args.store:
        raise ConfigError("--store names the store whose rated items are left out, "
                          "--include-rated leaves them in: give one of the two")  # fmt: skip
    if args.store:
        store = model._matching(args.store)
    elif model.store_url_ and not args.include_rated:
        store = model._matching(model._open_training_store(
            model.store_url_, "give the store it was trained on with --store, or rank the items "
            "the user rated too with --include-rated"))  # fmt: skip
    elif not args.include_rated:  # fitted on in-memory ratings: no store of what was rated
        out.log("the model names no training store: items the user already rated are not "
                "left out (give the store with --store)")  # fmt: skip
    user, n = _user_id(args.user, model), model.shape_[1]
    if getattr(model, "implicit", False):
        items, scores = model.recommend(  # type: ignore[call-arg]
            [user], k=min(args.k, n), filter_already_liked_items=store is not None, store=store
        )
    else:
        items, scores = model.recommend([user], k=min(args.k, n), exclude_seen=store is not None,
                                        store=store)  # fmt: skip
    found = np.isfinite(scores[0])  # -inf: no item left to recommend in that place
    if args.k > int(found.sum()):
        out.log(
            f"k={args.k}: only {int(found.sum()):,} of the {n:,} items are ones the user has not "
            "rated; recommending those"
            if store is not None
            else f"k={args.k}: the model has only {n:,} items; recommending all of them"
        )
    result = {"user": user, "items": items[0][found].tolist(),  # the id as the model holds it
              "scores": scores[0][found].tolist()}  # fmt: skip

    def human() -> None:
        print(recommend_table(user, result["items"], result["scores"]))

    out.result(result, human)


def _implicit_metrics(args: argparse.Namespace, model: Any, store: Any) -> dict[str, Any]:
    """evaluate of an implicit model: ranking metrics over every user with held-out
    interactions (ranking_metrics_at_k has no threshold and no sample of users)."""
    from .implicit.metrics import ranking_metrics_at_k

    for option, value in (("--threshold", args.threshold), ("--users", args.users)):
        if value is not None:
            raise ConfigError(
                f"{option} is for explicit models: an implicit model is ranked on every held-"
                f"out interaction of every user, each with a positive count; leave {option} out"
            )
    if not store.has_test:
        raise ConfigError(
            f"{store.url} has no held-out interactions to rank: build the store with a test "
            "share (data.test_fraction > 0 in the config, or --test-fraction of `cumf-dask "
            "ingest`) and train on it, or give such a store after the model"
        )
    return ranking_metrics_at_k(model, store, k=args.k)


def _check_k(k: int) -> None:
    if k < 1:
        raise ConfigError(f"-k must be at least 1, got {k}")


def _user_id(text: str, model: Any) -> Any:
    """The user id typed on the command line, as the model's ids are typed (int or text).

    An integer is plain decimal digits: int() would also take '1_0' (10), ' 7' or '٣'."""
    ids = model.user_ids_
    if ids is not None and ids.dtype.kind not in "iu":
        return text
    if not re.fullmatch(r"-?[0-9]+", text):
        kind = "the model's user ids are integers" if ids is not None else "users are indices"
        raise ConfigError(f"user {text!r} is not in the model's user ids ({kind})")
    return int(text)


def available_benchmarks(root: Path = BENCHMARKS) -> list[str]:
    """Names of the bench_NAME.py scripts in `root` (a source checkout's benchmarks/)."""
    return sorted(p.stem.removeprefix("bench_") for p in root.glob("bench_*.py"))


def cmd_bench(args: argparse.Namespace, out: Output) -> None:
    """Run benchmarks/bench_<name>.py with the remaining arguments (it prints for itself).

    The benchmarks are scripts of a source checkout, not part of the installed package.
    ``--json`` is refused (their output is their own text); ``--quiet`` drops their stdout.
    """
    if out.as_json:
        raise ConfigError(
            "--json: bench scripts print their own text, not one JSON document; leave --json "
            "out (benchmarks/report.py writes a benchmark's records as JSON to "
            "benchmarks/results/)"
        )
    root = Path(args.dir)
    if not root.is_dir():
        raise ConfigError(
            f"no benchmarks folder at {root}: `cumf-dask bench` runs the scripts in a source "
            "checkout's benchmarks/ (git clone the repository and pip install -e it), or "
            "pass --dir PATH"
        )
    available = available_benchmarks(root)
    script = root / f"bench_{args.name}.py"
    if not script.is_file():
        raise ConfigError(f"no benchmark '{args.name}' in {root}/; available: "
                          f"{', '.join(available) or 'none'}")  # fmt: skip
    sys.argv = [str(script), *args.args]
    sys.path.insert(0, str(root))  # as `python script.py` would: `from report import ...`
    with ExitStack() as stack:
        if out.quiet:  # only errors: the script's own lines go nowhere
            stack.enter_context(redirect_stdout(stack.enter_context(open(os.devnull, "w"))))
        runpy.run_path(str(script), run_name="__main__")
