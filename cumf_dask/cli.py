"""The ``cumf-dask`` command: generate, ingest, info, plan, train, evaluate, recommend, bench.

Exit codes a script can rely on: 0 success; 2 bad usage or config; 3 bad data, store or
model file; 4 no plan fits or a worker ran out of memory; 1 anything else.
``--json`` prints one JSON document on stdout (and nothing else there); ``--quiet`` prints
only errors.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .config import Config, GenerateConfig, load_config
from .errors import ConfigError, CumfError, DeviceMemoryError, IngestError, PlanError, StoreError

EXIT = {ConfigError: 2, StoreError: 3, IngestError: 3, PlanError: 4, DeviceMemoryError: 4}


class Output:
    """Where the command talks: rich on stderr for people, JSON on stdout for scripts."""

    def __init__(self, quiet: bool, as_json: bool):
        self.quiet, self.as_json = quiet, as_json
        self.console = Console(stderr=True, quiet=quiet, soft_wrap=True)

    def log(self, text: str) -> None:
        self.console.print(text, highlight=False)

    def result(self, data: dict[str, Any], human: Callable[[], None]) -> None:
        if self.as_json:
            print(json.dumps(data, default=str))
        elif not self.quiet:
            human()

    @contextmanager
    def progress(self) -> Iterator[Callable[[str, int, int | None], None]]:
        """A progress callback (stage, done, total) drawing one bar per stage."""
        bars = Progress(
            TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), console=self.console, disable=self.quiet, transient=False,
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
    from .data.synthetic import generate

    gen = GenerateConfig(
        preset=args.preset, scale=args.scale, m=args.m, n=args.n, nnz=args.nnz, rank=args.rank,
        noise=args.noise, skew=args.skew, rating_min=args.rating_min,
        rating_max=args.rating_max, round=args.round, nonempty=not args.allow_empty,
        seed=args.seed,
    )  # fmt: skip
    with out.progress() as progress:
        store = generate(
            args.output, gen, test_fraction=args.test_fraction, split_seed=args.split_seed,
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
            test_fraction=args.test_fraction, split_seed=args.split_seed,
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
        table = Table(title=f"rating store {info['url']}", show_header=False)
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
            table.add_row("on disk", f"{info['bytes_on_disk'] / 1e6:,.1f} MB")
        table.add_row("source", json.dumps(info["source"], default=str)[:200])
        Console().print(table)

    out.result(info, human)


QUICKSTART = Path(__file__).with_name("quickstart.yaml")


def _config(args: argparse.Namespace) -> Config:
    """The given config file, or the embedded quickstart; with the --set overrides."""
    return load_config(args.config or QUICKSTART, overrides=args.set)


def cmd_plan(args: argparse.Namespace, out: Output) -> None:
    from .engine.cluster import cluster_client
    from .pipeline import plan_for, prepare_store

    config = _config(args)
    with cluster_client(config.cluster) as client:
        store = prepare_store(config, client, log=out.log)
        plan = plan_for(config, store, client)
    out.result(plan.to_dict(), lambda: print(plan.table()))


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
        out.log("  ".join(parts))

    with out.progress() as progress:
        result = train(config, resume=args.resume, on_iteration=line, progress=progress,
                       log=out.log)  # fmt: skip
    summary = result.summary

    def human() -> None:
        print(f"model saved to {summary['model']}; run folder {summary['run']}")
        if summary.get("test_rmse") is not None:
            best = summary.get("planted_test_rmse")
            extra = f" (planted noise floor {best:.4f})" if best else ""
            print(f"final test RMSE {summary['test_rmse']:.4f}{extra}")

    out.result(summary, human)


def cmd_evaluate(args: argparse.Namespace, out: Output) -> None:
    from .data.store import RatingsStore
    from .evaluate import ranking_metrics
    from .model import ALS

    model = ALS.load(args.model)
    store = RatingsStore.open(args.store)
    if (store.m, store.n) != model.shape_:
        raise StoreError(
            f"{args.store} is {store.m:,} x {store.n:,} but the model is "
            f"{model.shape_[0]:,} x {model.shape_[1]:,}: evaluate on the store it was trained on"
        )
    result: dict[str, Any] = {"train_rmse": model.rmse(store, kind="train")}
    if store.has_test:
        result["test_rmse"] = model.rmse(store, kind="test")
        model._store = store
        result.update(ranking_metrics(model, store, k=args.k, threshold=args.threshold,
                                      max_users=args.users))  # fmt: skip

    def human() -> None:
        for key, value in result.items():
            print(f"{key:<14}{value:.4f}" if isinstance(value, float) else f"{key:<14}{value}")

    out.result(result, human)


def cmd_recommend(args: argparse.Namespace, out: Output) -> None:
    import numpy as np

    from .data.store import RatingsStore
    from .model import ALS

    model = ALS.load(args.model)
    store_url = args.store or model.store_url_
    store = RatingsStore.open(store_url) if store_url else None
    user_ids, item_ids = model.user_ids_, model.item_ids_
    index = _lookup(args.user, user_ids, model.shape_[0])
    top, scores = model.recommend([index], k=args.k, exclude_seen=store is not None, store=store)
    items = [item_ids[i].item() if item_ids is not None else int(i) for i in top[0]]
    result = {"user": args.user, "items": items, "scores": [float(s) for s in scores[0]]}

    def human() -> None:
        for rank, (item, score) in enumerate(zip(items, scores[0], strict=True), 1):
            print(f"{rank:>3}. {item}  {float(np.float32(score)):.4f}")

    out.result(result, human)


def _lookup(user: str, ids: Any, m: int) -> int:
    """Dense index of a user given in the user's own ids."""
    if ids is None:
        if not user.lstrip("-").isdigit() or not 0 <= int(user) < m:
            raise ConfigError(f"user {user!r} is not an index in [0, {m})")
        return int(user)
    import numpy as np

    matches = np.flatnonzero(np.asarray(ids).astype(str) == user)
    if matches.size == 0:
        raise ConfigError(f"user {user!r} is not in the model's user ids")
    return int(matches[0])


def cmd_bench(args: argparse.Namespace, out: Output) -> None:
    root = Path(args.dir)
    available = sorted(p.stem.removeprefix("bench_") for p in root.glob("bench_*.py"))
    script = root / f"bench_{args.name}.py"
    if not script.is_file():
        raise ConfigError(f"no benchmark '{args.name}' in {root}/; available: "
                          f"{', '.join(available) or 'none'}")  # fmt: skip
    sys.argv = [str(script), *args.args]
    runpy.run_path(str(script), run_name="__main__")


# ----------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cumf-dask", description=__doc__.split("\n")[0])
    parser.add_argument("--quiet", "-q", action="store_true", help="print only errors")
    parser.add_argument("--json", action="store_true", help="print one JSON result on stdout")
    sub = parser.add_subparsers(dest="command", required=True)

    def store_layout(p: argparse.ArgumentParser) -> None:
        p.add_argument("-o", "--output", required=True, help="store path or URL to write")
        p.add_argument("--test-fraction", type=float, default=0.1)
        p.add_argument("--split-seed", type=int, default=0)
        p.add_argument("--tile-rows", type=int)
        p.add_argument("--tile-cols", type=int)
        p.add_argument("--overwrite", action="store_true", help="replace an existing store")

    g = sub.add_parser("generate", help="write a synthetic planted-model store")
    g.add_argument("--preset", help="netflix, yahoomusic, hugewiki, sparkals, factorbird, facebook")
    g.add_argument("--scale", type=float, default=1.0, help="multiplies the preset's m, n, nnz")
    for name in ("m", "n", "nnz"):
        g.add_argument(f"--{name}", type=int)
    g.add_argument("--rank", type=int, default=10)
    g.add_argument("--noise", type=float, default=0.1)
    g.add_argument("--skew", type=float, default=0.8)
    g.add_argument("--rating-min", type=float)
    g.add_argument("--rating-max", type=float)
    g.add_argument("--round", action="store_true")
    g.add_argument("--allow-empty", action="store_true", help="rows/columns may have no rating")
    g.add_argument("--seed", type=int, default=0)
    store_layout(g)
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("ingest", help="read a ratings file into a store")
    i.add_argument("file", help="input path or fsspec URL")
    i.add_argument("--format", default="csv", help="csv, tsv, delimited, movielens-100k, "
                   "movielens-1m, movielens-csv, netflix, parquet")  # fmt: skip
    i.add_argument("--delimiter")
    i.add_argument("--header", action=argparse.BooleanOptionalAction, default=None)
    i.add_argument("--columns", help="user,item,rating columns: names or 0-based positions")
    i.add_argument("--duplicates", choices=["error", "last", "mean"], default="error")
    i.add_argument("--m", type=int, help="declared rows: ids are indices in [0, m)")
    i.add_argument("--n", type=int, help="declared columns")
    store_layout(i)
    i.set_defaults(func=cmd_ingest)

    info = sub.add_parser("info", help="describe a store")
    info.add_argument("store")
    info.set_defaults(func=cmd_info)

    for name, func, text in (("plan", cmd_plan, "print the plan of a config"),
                             ("train", cmd_train, "run a configured training job")):  # fmt: skip
        p = sub.add_parser(name, help=text)
        p.add_argument("config", nargs="?", help="YAML config (default: the embedded "
                       "quickstart; every key: configs/reference.yaml)")  # fmt: skip
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set model.factors=64")  # fmt: skip
        if name == "train":
            p.add_argument("--resume", action="store_true",
                           help="continue the latest run of this config from its checkpoint")
        p.set_defaults(func=func)

    e = sub.add_parser("evaluate", help="RMSE and ranking metrics of a saved model")
    e.add_argument("model")
    e.add_argument("store")
    e.add_argument("-k", type=int, default=10)
    e.add_argument("--threshold", type=float, help="held-out ratings >= this are relevant")
    e.add_argument("--users", type=int, default=10_000, help="users sampled for ranking")
    e.set_defaults(func=cmd_evaluate)

    r = sub.add_parser("recommend", help="top-k items for a user (in the user's own ids)")
    r.add_argument("model")
    r.add_argument("--user", required=True)
    r.add_argument("-k", type=int, default=10)
    r.add_argument("--store", help="the training store (default: the one the model names)")
    r.set_defaults(func=cmd_recommend)

    b = sub.add_parser("bench", help="run a named benchmark from benchmarks/")
    b.add_argument("name")
    b.add_argument("args", nargs=argparse.REMAINDER)
    b.add_argument("--dir", default="benchmarks")
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Output(args.quiet, args.json)
    try:
        args.func(args, out)
    except CumfError as exc:
        code = next((c for kind, c in EXIT.items() if isinstance(exc, kind)), 1)
        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {exc}", highlight=False)
        return code
    except KeyboardInterrupt:
        Console(stderr=True).print("interrupted")
        return 130
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
