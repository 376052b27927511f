"""Implicit feedback: cumf-dask's ImplicitALS against `implicit` 0.7.3, quality and speed.

    python benchmarks/bench_implicit.py                        # CPU: MovieLens-100k + speed
    python benchmarks/bench_implicit.py --backend cupy         # GPU: Netflix-shaped counts
    python benchmarks/bench_implicit.py --backend cupy,numpy --parts speed --solvers cg

Two parts (``--parts``), one table printed last (also ``results/implicit.json`` and .png):

* ``ml100k``: ranking quality on MovieLens-100k, read offline from the `recbole` wheel (every
  rating an interaction; ``pip install --no-deps recbole==1.2.1``), split by user (20% of each
  user's items held out, every user kept in training). For each alpha and solver, both
  libraries fit the same model at the same f, lambda and iterations: cumf-dask with
  c = 1 + alpha r, implicit fed the matrix 1 + alpha R with its own alpha = 1 (its c is the
  stored value times alpha), over ``--seeds`` seeds; both scored by the same function
  (cumf_dask.implicit.metrics: `capped_recall` is what implicit calls precision). Means
  (and standard deviations) over the seeds.
* ``speed``: seconds per iteration (median after the first) on a Netflix-shaped count matrix
  (480,189 x 17,770, 99M at ``--scale 1``; cumf-dask's planted generator with values rounded
  to counts 1..5), at ``--factors`` and every f of ``--sweep``, CG (3 steps) and Cholesky,
  against implicit on the same data and device: its GPU ALS
  (``implicit.gpu.als.AlternatingLeastSquares``, CG only; skipped with a line saying so when
  implicit was built without CUDA) for ``--backend cupy``, its CPU ALS for ``numpy``;
  implicit's record carries ``x_cumf_dask``, its seconds over cumf-dask's in the same run.

`implicit` is an optional benchmark dependency (``pip install implicit==0.7.3``): without it
only cumf-dask's rows are measured.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from device import describe

from cumf_dask import RatingsStore
from cumf_dask.config import ClusterConfig
from cumf_dask.engine.cluster import cluster_client
from cumf_dask.errors import StoreError
from cumf_dask.implicit import ImplicitALS, ranking_metrics_at_k, train_test_split
from cumf_dask.implicit.metrics import _metrics

RECBOLE = "pip install --no-deps recbole==1.2.1"
METRICS = ("precision@10", "recall@10", "capped_recall@10", "map@10", "ndcg@10", "auc@10")


# ----------------------------------------------------------------------------- data


def movielens_100k() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(users, items, ones) of MovieLens-100k from the installed recbole wheel (not imported:
    it needs torch; find_spec only locates it). GroupLens' terms: read, not redistributed."""
    spec = importlib.util.find_spec("recbole")
    path = None if spec is None else Path(spec.origin).parent / "dataset_example" / "ml-100k"
    if path is None or not (path / "ml-100k.inter").is_file():
        raise SystemExit(
            "bench_implicit: MovieLens-100k is read from the recbole wheel, which is not "
            f"installed; run `{RECBOLE}` (without --no-deps it pulls torch)"
        )
    a = np.loadtxt(path / "ml-100k.inter", skiprows=1, dtype=np.int64)
    return a[:, 0] - 1, a[:, 1] - 1, np.ones(len(a), np.float32)


def counts_store(scale: float, directory: str) -> RatingsStore:
    """The Netflix-shaped count matrix (generated once, kept under `directory`)."""
    from cumf_dask.data.planted import PlantedModel
    from cumf_dask.data.synthetic import generate

    url = str(Path(directory) / f"implicit-netflix-counts-scale{scale:g}.zarr")
    try:
        return RatingsStore.open(url)
    except StoreError:
        model = PlantedModel.create(preset="netflix", scale=scale, rank=10, noise=0.5,
                                    rating_min=1, rating_max=5, round=True, seed=1)  # fmt: skip
        t0 = time.perf_counter()
        store = generate(url, model, test_fraction=0.0, overwrite=True, use_gpu=False)
        print(f"generated {url} in {time.perf_counter() - t0:.1f} s", flush=True)
        return store


def confidence_matrix(rows, cols, vals, shape, alpha: float) -> Any:
    """C = 1 + alpha R as implicit's input (float32 CSR): the same model as ours at alpha."""
    import scipy.sparse as sp

    return sp.csr_matrix(((1 + alpha * vals).astype(np.float32), (rows, cols)), shape=shape)


# ----------------------------------------------------------------------------- implicit


def implicit_model(device: str, f: int, lam: float, iterations: int, solver: str, seed: int):
    """implicit's ALS for the device, or a string saying why there is none."""
    if importlib.util.find_spec("implicit") is None:
        return "implicit is not installed (pip install implicit==0.7.3)"
    warnings.simplefilter("ignore")
    if device == "cupy":
        import implicit.gpu

        if not implicit.gpu.HAS_CUDA:
            return "implicit was built without CUDA: its GPU ALS cannot be imported"
        if solver != "cg":
            return "implicit's GPU ALS has no Cholesky solver"
        from implicit.gpu.als import AlternatingLeastSquares as GpuALS

        return GpuALS(factors=f, regularization=lam, alpha=1.0, iterations=iterations,
                      calculate_training_loss=False, random_state=seed + 1)  # fmt: skip
    from implicit.cpu.als import AlternatingLeastSquares

    return AlternatingLeastSquares(factors=f, regularization=lam, alpha=1.0,
                                   iterations=iterations, use_cg=solver == "cg",
                                   calculate_training_loss=False, random_state=seed)  # fmt: skip


def fit_implicit(model: Any, C: Any) -> list[float]:
    """Seconds of each iteration (implicit's fit callback)."""
    seconds: list[float] = []
    model.fit(C, show_progress=False, callback=lambda it, elapsed, loss: seconds.append(elapsed))
    return seconds


def steady(seconds: list[float]) -> float:
    """Median seconds per iteration after the first (which compiles and loads)."""
    return statistics.median(seconds[1:] or seconds)


# ----------------------------------------------------------------------------- parts


def quality(args: argparse.Namespace, client: Any, device: str) -> list[dict[str, Any]]:
    users, items, ones = movielens_100k()
    shape = (int(users.max()) + 1, int(items.max()) + 1)
    (tr, ti, tv), (sr, si, _) = train_test_split(users, items, ones, 0.2, seed=0)
    test_users, position = np.unique(sr, return_inverse=True)
    f, lam, its = 64, 0.01, 15
    records = []
    for alpha in args.alphas:
        C = confidence_matrix(tr, ti, tv, shape, alpha)
        for solver in args.solvers:
            found: dict[str, list] = {"cumf-dask": [], "implicit": []}
            speed: dict[str, list] = {"cumf-dask": [], "implicit": []}
            for seed in range(args.seeds):
                ours = ImplicitALS(f, lam, alpha, its, seed=seed, solver=solver, backend=device,
                                   evaluate=False)  # fmt: skip
                ours.fit((tr, ti, tv, shape), client=client)
                found["cumf-dask"].append(ranking_metrics_at_k(ours, (sr, si), 10, train=(tr, ti)))
                speed["cumf-dask"].append(steady([r["seconds"] for r in ours.metrics_]))
                theirs = implicit_model("numpy", f, lam, its, solver, seed)
                if isinstance(theirs, str):
                    continue
                speed["implicit"].append(steady(fit_implicit(theirs, C)))
                top = theirs.recommend(test_users, C[test_users], N=10)[0].astype(np.int64)
                seen = np.diff(C.indptr)[test_users]
                found["implicit"].append(_metrics(top, position, si, shape[1], seen, 10))
            for library, runs in found.items():
                if not runs:
                    continue
                record = {"part": "ml100k", "library": library, "device": "cpu",
                          "solver": solver, "alpha": alpha, "f": f, "seeds": len(runs),
                          "s_per_iteration": statistics.median(speed[library])}  # fmt: skip
                for key in METRICS:
                    values = [r[key] for r in runs]
                    record[key] = round(statistics.mean(values), 4)
                    if key in ("precision@10", "ndcg@10") and len(values) > 1:
                        record[f"{key} std"] = round(statistics.stdev(values), 4)
                records.append(record)
                print(record, flush=True)
    return records


def timing(args: argparse.Namespace, client: Any, device: str) -> list[dict[str, Any]]:
    gpu = device == "cupy"
    scale = args.scale if args.scale is not None else (1.0 if gpu else 0.02)
    sweep = args.sweep if args.sweep is not None else ([32, 64, 128, 256] if gpu else [])
    store = counts_store(scale, args.data)
    data = f"netflix-counts x{scale:g} ({store.m:,} x {store.n:,}, {store.nnz:,})"
    rows, cols, vals = store.read_coo("row")
    C = confidence_matrix(rows, cols, vals, (store.m, store.n), args.alpha)
    del rows, cols, vals
    records = []
    for f in dict.fromkeys([args.factors, *sweep]):
        for solver in args.solvers:
            base = {"part": "speed", "data": data, "solver": solver, "alpha": args.alpha, "f": f}
            model = ImplicitALS(f, args.lam, args.alpha, args.iterations, solver=solver,
                                cg_steps=3, backend=device, evaluate=False)  # fmt: skip
            model.fit(store, client=client)
            seconds = [r["seconds"] for r in model.metrics_]
            records.append({**base, "library": "cumf-dask", "device": device,
                            "s_per_iteration": steady(seconds)})  # fmt: skip
            print(records[-1], flush=True)
            theirs = implicit_model(device, f, args.lam, args.iterations, solver, 0)
            if isinstance(theirs, str):
                print(f"implicit, {device}, f={f}, {solver}: skipped: {theirs}", flush=True)
                continue
            ours = records[-1]["s_per_iteration"]
            their_s = steady(fit_implicit(theirs, C))
            records.append({**base, "library": "implicit", "device": device,
                            "s_per_iteration": their_s,
                            "x_cumf_dask": round(their_s / ours, 2)})  # fmt: skip
            print(records[-1], flush=True)
    return records


# ----------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="ml100k,speed", help="ml100k, speed or both")
    parser.add_argument("--backend", default="numpy", help="numpy, cupy or cupy,numpy")
    parser.add_argument("--solvers", default="cg,cholesky")
    parser.add_argument("--seeds", type=int, default=3, help="ml100k: fits per setting")
    parser.add_argument("--alphas", default="0,1", help="ml100k: confidence slopes")
    parser.add_argument("--scale", type=float, help="speed: Netflix shape times this "
                        "(default 1 on the GPU, 0.02 on the CPU)")  # fmt: skip
    parser.add_argument("--factors", type=int, default=100)
    parser.add_argument("--sweep", help="speed: more f, e.g. 32,64 ('' for none; default "
                        "32,64,128,256 on the GPU, none on the CPU)")  # fmt: skip
    parser.add_argument("--iterations", type=int, default=5, help="speed: iterations per fit")
    parser.add_argument("--alpha", type=float, default=1.0, help="speed: confidence slope")
    parser.add_argument("--lam", type=float, default=0.01)
    parser.add_argument("--workers", type=int, help="CPU workers (default: one per core)")
    parser.add_argument("--data", default="/tmp/cumf-bench")
    args = parser.parse_args()
    args.solvers = args.solvers.split(",")
    args.alphas = [float(a) for a in args.alphas.split(",")]
    if args.sweep is not None:
        args.sweep = [int(f) for f in args.sweep.split(",") if f]
    parts = args.parts.split(",")
    records: list[dict[str, Any]] = []
    load = os.getloadavg()
    for device in args.backend.split(","):
        cluster = ClusterConfig(backend=device, n_workers=args.workers if device == "numpy"
                                else None, dashboard_address=None)  # fmt: skip
        with cluster_client(cluster) as client:
            if "ml100k" in parts and device == "numpy":
                records += quality(args, client, device)
            if "speed" in parts:
                records += timing(args, client, device)
    if not records:
        raise SystemExit("nothing measured: --parts ml100k runs on --backend numpy")
    devices = describe("cupy" in args.backend.split(","))
    print(f"\n{time.strftime('%Y-%m-%d')}, {devices}, load average {load[0]:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end")  # fmt: skip
    from report import write_results

    print(write_results("implicit", records, x="f", y="s_per_iteration", series="library",
                        title="implicit ALS, seconds per iteration", logy=True))  # fmt: skip


if __name__ == "__main__":
    main()
