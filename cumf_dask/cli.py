"""The ``cumf-dask`` command: generate, ingest, info, plan, train, evaluate, recommend, bench.

Exit codes a script can rely on: 0 success; 2 bad usage or config; 3 bad data, store or
model file; 4 no plan fits or a worker ran out of memory; 130 interrupted; 1 anything else.
``--json`` prints one JSON document on stdout and nothing else there (on failure
``{"error": ..., "exit_code": ...}``); ``--quiet`` prints only errors. Both may come before
or after the command. Progress bars and log lines go to stderr; bars only on a terminal.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .config import Config, GenerateConfig, load_config
from .errors import (
    ConfigError,
    CumfError,
    CumfWarning,
    DeviceMemoryError,
    IngestError,
    NotFittedError,
    NumericalError,
    PlanError,
    StoreError,
)

EXIT = {
    ConfigError: 2,
    NotFittedError: 2,
    StoreError: 3,
    IngestError: 3,
    NumericalError: 3,
    PlanError: 4,
    DeviceMemoryError: 4,
}


class Output:
    """Where the command talks: rich on stderr for people, JSON on stdout for scripts.

    Log lines go through the same console as the progress bars, so a line printed while a
    bar is live appears above the bars instead of tearing them.
    """

    def __init__(self, quiet: bool, as_json: bool, console: Console | None = None):
        self.quiet, self.as_json = quiet, as_json
        self.console = console or Console(stderr=True, quiet=quiet, soft_wrap=True)

    def log(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False)

    def result(self, data: dict[str, Any], human: Callable[[], None]) -> None:
        if self.as_json:
            print(json.dumps(data, default=str))
        elif not self.quiet:
            human()

    def error(self, message: str, code: int) -> None:
        """The error on stderr (also when quiet), and as the JSON document in --json mode."""
        Console(stderr=True, soft_wrap=True).print(
            f"[bold red]error:[/] {escape(message)}", highlight=False
        )
        if self.as_json:
            print(json.dumps({"error": message, "exit_code": code}))

    @contextmanager
    def progress(self) -> Iterator[Callable[[str, int, int | None], None]]:
        """A progress callback (stage, done, total) drawing one bar per stage on a terminal."""
        bars = Progress(
            TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), console=self.console,
            disable=self.quiet or not self.console.is_terminal,
        )  # fmt: skip
        tasks: dict[str, Any] = {}

        def update(stage: str, done: int, total: int | None) -> None:
            if stage not in tasks:
                tasks[stage] = bars.add_task(stage, total=total)
            bars.update(tasks[stage], completed=done, total=total)

        with bars:
            yield update


# ----------------------------------------------------------------------------- commands


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
    _report_store(store, out)


def cmd_ingest(args: argparse.Namespace, out: Output) -> None:
    from .data.ingest import ingest_file

    columns = None
    if args.columns:
        columns = [int(c) if c.isdigit() else c for c in args.columns.split(",")]
    with out.progress() as progress:
        store = ingest_file(
            args.file, args.output, args.format, delimiter=args.delimiter, header=args.header,
            columns=columns, duplicates=args.duplicates, m=args.m, n=args.n,
            rating_min=args.rating_min, rating_max=args.rating_max,
            test_fraction=args.test_fraction, split_seed=args.split_seed, split=args.split,
            tile_rows=args.tile_rows, tile_cols=args.tile_cols, overwrite=args.overwrite,
            progress=progress,
        )  # fmt: skip
    _report_store(store, out)


def cmd_info(args: argparse.Namespace, out: Output) -> None:
    from .data.store import RatingsStore

    _report_store(RatingsStore.open(args.store), out)


def store_info(store: Any) -> dict[str, Any]:
    """Shape, density, degree skew, tiles, size on disk and provenance of a store."""
    rows, cols = store.counts("row"), store.counts("col")

    def skew(c: Any) -> dict[str, float]:
        mean = float(c.mean()) if c.size else 0.0
        return {"mean": mean, "max": int(c.max()) if c.size else 0,
                "max_over_mean": float(c.max() / mean) if mean else 0.0,
                "empty": int((c == 0).sum())}  # fmt: skip

    return {
        "url": store.url, "m": store.m, "n": store.n, "nnz": store.nnz,
        "nnz_test": store.nnz_test, "density": store.nnz / (store.m * store.n),
        "rows": skew(rows), "cols": skew(cols),
        "tiles": {"rows": store.tile_rows, "cols": store.tile_cols,
                  "row_tiles": store.n_row_tiles, "col_tiles": store.n_col_tiles},
        "ratings": store.stats, "bytes_on_disk": store.size_on_disk(),
        "has_ids": bool(store.attrs.get("has_ids")), "source": store.source,
    }  # fmt: skip


def _report_store(store: Any, out: Output) -> None:
    info = store_info(store)

    def human() -> None:
        table = Table(title=f"rating store {escape(info['url'])}", show_header=False)
        table.add_row("shape", f"{info['m']:,} x {info['n']:,}")
        table.add_row("ratings", f"{info['nnz']:,} train, {info['nnz_test']:,} held out "
                                 f"(density {info['density']:.2e})")  # fmt: skip
        for axis in ("rows", "cols"):
            d = info[axis]
            table.add_row(f"{axis} degree", f"mean {d['mean']:.1f}, max {d['max']:,} "
                          f"({d['max_over_mean']:.1f}x mean), {d['empty']:,} empty")  # fmt: skip
        t = info["tiles"]
        table.add_row("tiles", f"{t['rows']:,} x {t['cols']:,} ({t['row_tiles']} x "
                               f"{t['col_tiles']})")  # fmt: skip
        r = info["ratings"]
        table.add_row("values", f"min {r['min']:.3g}, max {r['max']:.3g}, mean {r['mean']:.3g}, "
                                f"std {r['std']:.3g}")  # fmt: skip
        if info["bytes_on_disk"] is not None:
            table.add_row("on disk", _bytes(info["bytes_on_disk"]))
        table.add_row("ids", "the input's own ids, kept" if info["has_ids"] else "dense indices")
        source = ", ".join(f"{key} {_short(value)}" for key, value in info["source"].items())
        table.add_row("source", escape(source))
        Console().print(table)

    out.result(info, human)


def _bytes(size: int) -> str:
    """12.3 kB, 4.5 MB, 6.7 GB."""
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000:
            return f"{size:.3g} {unit}"
        size /= 1000
    return f"{size:,.1f} TB"


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


QUICKSTART = Path(__file__).with_name("quickstart.yaml")


def _config(args: argparse.Namespace) -> Config:
    """The given config file, or the embedded quickstart; with the --set overrides."""
    return load_config(args.config or QUICKSTART, overrides=args.set)


def cmd_plan(args: argparse.Namespace, out: Output) -> None:
    from .engine.cluster import cluster_client
    from .pipeline import job_plan

    config = _config(args)
    with cluster_client(config.cluster) as client, out.progress() as progress:
        plan, estimated = job_plan(config, client, progress, out.log)
    note = "estimated from the generator's shape: the store is not built yet (even splits)"

    def human() -> None:
        print(plan.table())
        if estimated:
            print(note)

    out.result({**plan.to_dict(), "estimated": estimated}, human)


def cmd_train(args: argparse.Namespace, out: Output) -> None:
    from .pipeline import train

    config = _config(args)
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
        result = train(config, resume=args.resume, on_iteration=line, progress=progress,
                       log=out.log)  # fmt: skip
    summary = result.summary

    def human() -> None:
        print(f"model saved to {summary['model']}; run folder {summary['run']}")
        if summary.get("test_rmse") is not None:
            planted = summary.get("planted_test_rmse")
            extra = f" (the planted model scores {planted:.4f})" if planted else ""
            print(f"final test RMSE {summary['test_rmse']:.4f}{extra}")

    out.result(summary, human)


def cmd_evaluate(args: argparse.Namespace, out: Output) -> None:
    from .data.store import RatingsStore
    from .evaluate import ranking_metrics
    from .model import ALS

    _check_k(args.k)
    model = ALS.load(args.model)
    store = RatingsStore.open(args.store)
    _check_shape(model, store, args.store)
    if args.k > model.shape_[1]:
        out.log(f"k={args.k} is more than the {model.shape_[1]:,} items: ranking metrics at "
                f"k={model.shape_[1]:,}")  # fmt: skip
    if getattr(model, "implicit", False):
        from .implicit.metrics import ranking_metrics_at_k

        result: dict[str, Any] = ranking_metrics_at_k(model, store, k=args.k)  # type: ignore[arg-type]
    else:
        result = {"train_rmse": model.rmse(store, kind="train")}
    if store.has_test and not getattr(model, "implicit", False):
        result["test_rmse"] = model.rmse(store, kind="test")
        result.update(ranking_metrics(model, store, k=args.k, threshold=args.threshold,
                                      max_users=args.users))  # fmt: skip

    def human() -> None:
        for key, value in result.items():
            print(f"{key:<14}{value:.4f}" if isinstance(value, float) else f"{key:<14}{value}")

    out.result(result, human)


def cmd_recommend(args: argparse.Namespace, out: Output) -> None:
    from .data.store import RatingsStore
    from .model import ALS

    _check_k(args.k)
    model = ALS.load(args.model)
    store_url = args.store or model.store_url_
    store = RatingsStore.open(store_url) if store_url else None
    if store is not None:
        _check_shape(model, store, store_url)
    index = _lookup(args.user, model.user_ids_, model.shape_[0])
    n = model.shape_[1]
    if getattr(model, "implicit", False):
        top, scores = model.recommend(  # type: ignore[call-arg]
            [index], k=min(args.k, n), filter_already_liked_items=store is not None, store=store
        )
    else:
        top, scores = model.recommend([index], k=min(args.k, n), exclude_seen=store is not None,
                                      store=store)  # fmt: skip
    found = top[0] >= 0  # -1: no item left to recommend in that place
    if args.k > int(found.sum()):
        out.log(
            f"k={args.k}: only {int(found.sum()):,} of the {n:,} items are ones the user has not "
            "rated; recommending those"
            if store is not None
            else f"k={args.k}: the model has only {n:,} items; recommending all of them"
        )
    top, scores = top[0][found], scores[0][found]
    items = model.item_ids_[top].tolist() if model.item_ids_ is not None else top.tolist()
    result = {"user": args.user, "items": items, "scores": scores.tolist()}

    def human() -> None:
        for rank, (item, score) in enumerate(zip(items, result["scores"], strict=True), 1):
            print(f"{rank:>3}. {item}  {score:.4f}")

    out.result(result, human)


def _check_k(k: int) -> None:
    if k < 1:
        raise ConfigError(f"-k must be at least 1, got {k}")


def _check_shape(model: Any, store: Any, url: str) -> None:
    """The store must be the one the model was trained on (same m and n)."""
    if (store.m, store.n) != model.shape_:
        raise StoreError(
            f"{url} is {store.m:,} x {store.n:,} but the model is "
            f"{model.shape_[0]:,} x {model.shape_[1]:,}: use the store it was trained on"
        )


def _lookup(user: str, ids: np.ndarray | None, m: int) -> int:
    """Dense index of a user given in the user's own ids (a dense index if none were kept)."""
    numeric = user.lstrip("-").isdigit()
    if ids is None:
        if not numeric or not 0 <= int(user) < m:
            raise ConfigError(f"user {user!r} is not an index in [0, {m})")
        return int(user)
    if ids.dtype.kind in "iu":
        matches = np.flatnonzero(ids == int(user)) if numeric else np.zeros(0)
    else:
        matches = np.flatnonzero(ids == user)
    if matches.size == 0:
        raise ConfigError(f"user {user!r} is not in the model's user ids (e.g. {ids[:3].tolist()})")
    return int(matches[0])


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def cmd_bench(args: argparse.Namespace, out: Output) -> None:
    """Run benchmarks/bench_<name>.py with the remaining arguments (it prints for itself).

    The benchmarks are scripts of a source checkout, not part of the installed package.
    """
    root = Path(args.dir)
    if not root.is_dir():
        raise ConfigError(
            f"no benchmarks folder at {root}: `cumf-dask bench` runs the scripts in a source "
            "checkout's benchmarks/ (git clone the repository and pip install -e it), or "
            "pass --dir PATH"
        )
    available = sorted(p.stem.removeprefix("bench_") for p in root.glob("bench_*.py"))
    script = root / f"bench_{args.name}.py"
    if not script.is_file():
        raise ConfigError(f"no benchmark '{args.name}' in {root}/; available: "
                          f"{', '.join(available) or 'none'}")  # fmt: skip
    sys.argv = [str(script), *args.args]
    sys.path.insert(0, str(root))  # as `python script.py` would: `from report import ...`
    runpy.run_path(str(script), run_name="__main__")


# ----------------------------------------------------------------------------- parser


def _modes(p: argparse.ArgumentParser, default: Any) -> None:
    p.add_argument("--quiet", "-q", action="store_true", default=default, help="print only errors")
    p.add_argument("--json", action="store_true", default=default,
                   help="print one JSON document on stdout")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cumf-dask",
        description="ALS matrix factorization on Dask, on CPUs and GPUs.",
        epilog="exit codes: 0 success, 2 bad usage or config, 3 bad data, store or model "
        "file, 4 no plan fits or out of memory, 130 interrupted, 1 anything else",
    )
    _modes(parser, False)
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, func: Callable[..., None], text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=text, description=text)
        _modes(p, argparse.SUPPRESS)  # after the command too, without resetting the global flag
        p.set_defaults(func=func)
        return p

    def store_layout(p: argparse.ArgumentParser) -> None:
        p.add_argument("-o", "--output", required=True, help="store path or URL to write")
        p.add_argument("--test-fraction", type=float, default=0.1, help="held-out share")
        p.add_argument("--split-seed", type=int, default=0)
        p.add_argument("--tile-rows", type=int, help="rows per tile (default: from the shape)")
        p.add_argument("--tile-cols", type=int)
        p.add_argument("--overwrite", action="store_true", help="replace an existing store")

    g = add("generate", cmd_generate, "write a synthetic planted-model store")
    g.add_argument("--preset", help="netflix, yahoomusic, hugewiki, sparkals, factorbird, facebook")
    g.add_argument("--scale", type=float, default=1.0, help="multiplies the preset's m, n, nnz")
    for name in ("m", "n", "nnz"):
        g.add_argument(f"--{name}", type=int, help=f"{name} (overrides the preset)")
    g.add_argument("--rank", type=int, default=10, help="rank of the planted model")
    g.add_argument("--noise", type=float, default=0.1, help="sigma of the Gaussian noise")
    g.add_argument("--skew", type=float, default=0.8, help="Zipf exponent of the degrees")
    g.add_argument("--rating-min", type=float, help="clip ratings below")
    g.add_argument("--rating-max", type=float, help="clip ratings above")
    g.add_argument("--round", action="store_true", help="round ratings to integers")
    g.add_argument("--allow-empty", action="store_true", help="rows/columns may have no rating")
    g.add_argument("--seed", type=int, default=0)
    store_layout(g)

    i = add("ingest", cmd_ingest, "read a ratings file into a store")
    i.add_argument("file", help="input path or fsspec URL")
    i.add_argument("--format", default="csv", help="csv, tsv, delimited, movielens-100k, "
                   "movielens-1m, movielens-csv, netflix, parquet")  # fmt: skip
    i.add_argument("--delimiter")
    i.add_argument("--header", action=argparse.BooleanOptionalAction, default=None)
    i.add_argument("--columns", help="user,item,rating columns: names or 0-based positions")
    i.add_argument("--duplicates", choices=["error", "last", "mean", "sum"], default="error",
                   help="repeated (user, item) pairs; sum adds counts")  # fmt: skip
    i.add_argument("--split", choices=["pairs", "users"], default="pairs",
                   help="hold out a share of all pairs, or of each user's (keeps every user)")
    i.add_argument("--m", type=int, help="declared rows: ids are indices in [0, m)")
    i.add_argument("--n", type=int, help="declared columns")
    i.add_argument("--rating-min", type=float, help="declared scale: a rating below is an error")
    i.add_argument("--rating-max", type=float, help="declared scale: a rating above is an error")
    store_layout(i)

    add("info", cmd_info, "describe a store").add_argument("store")

    for name, func, text in (("plan", cmd_plan, "print the plan of a config"),
                             ("train", cmd_train, "run a configured training job")):  # fmt: skip
        p = add(name, func, text)
        p.add_argument("config", nargs="?", help="YAML config (default: the embedded "
                       "quickstart; every key: configs/reference.yaml)")  # fmt: skip
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set model.factors=64")  # fmt: skip
        if name == "train":
            p.add_argument(
                "--resume",
                action="store_true",
                help="continue the latest run of this config from its checkpoint",
            )

    e = add("evaluate", cmd_evaluate, "RMSE and ranking metrics of a saved model")
    e.add_argument("model")
    e.add_argument("store")
    e.add_argument("-k", type=int, default=10)
    e.add_argument("--threshold", type=float, help="held-out ratings >= this are relevant")
    e.add_argument("--users", type=int, default=10_000, help="users sampled for ranking")

    r = add("recommend", cmd_recommend, "top-k items for a user (in the user's own ids)")
    r.add_argument("model")
    r.add_argument("--user", required=True)
    r.add_argument("-k", type=int, default=10)
    r.add_argument("--store", help="the training store (default: the one the model names)")

    b = add("bench", cmd_bench, "run benchmarks/bench_NAME.py (it prints its own output)")
    b.add_argument("--dir", default=str(BENCHMARKS), help="folder of bench_*.py scripts")
    b.add_argument("name", help="e.g. kernels for bench_kernels.py")
    b.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    return parser


@contextmanager
def _warnings_as_log_lines(out: Output) -> Iterator[None]:
    """cumf-dask's own warnings (a damaged checkpoint skipped, a lost worker replaced,
    leftovers removed) as one 'warning:' line each on stderr, every time they happen."""
    shown = warnings.showwarning

    def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        if issubclass(category, CumfWarning):
            out.log(f"warning: {message}")
        else:
            shown(message, category, *args, **kwargs)

    with warnings.catch_warnings():  # restores showwarning and the filters after
        if not out.quiet:
            warnings.simplefilter("always", CumfWarning)
        warnings.showwarning = show
        yield


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quiet:  # also the libraries' warnings and Dask's logs, in worker processes too
        warnings.simplefilter("ignore")
        os.environ.setdefault("PYTHONWARNINGS", "ignore")
        os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "error")
    out = Output(args.quiet, args.json)
    try:
        with _warnings_as_log_lines(out):
            args.func(args, out)
    except CumfError as exc:
        code = next((c for kind, c in EXIT.items() if isinstance(exc, kind)), 1)
        out.error(str(exc), code)
        return code
    except KeyboardInterrupt:
        out.error("interrupted", 130)
        return 130
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
