"""Seconds per ALS iteration through the whole Dask pipeline, on CPU or GPU workers.

    python benchmarks/bench_iteration.py                       # issue 3: 100k x 20k, 5M, f=50
    python benchmarks/bench_iteration.py --preset netflix --factors 100 --backend cupy
    python benchmarks/bench_iteration.py --preset yahoomusic --factors 100 --lam 1.4 --backend cupy

Generates the planted-model store once (kept under --data), then fits on a fresh cluster
(LocalCluster of single-threaded workers, or LocalCUDACluster) and prints the device, the
shape, f, each iteration's seconds (X and Theta half-steps) and RMSE, and the median over
the iterations after the first (which includes loading the resident blocks) with its ratio
to the planner's predicted seconds per iteration (``cumf_dask/engine/costs.py``).
``--task-stream`` also records Dask's task stream and prints, per iteration, how much of
its wall time some worker spent computing tasks (the union of their compute intervals) and
the compute seconds by kind of task: the rest is waiting (scheduling, transfers, the client).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import time
from collections import defaultdict
from pathlib import Path

from device import describe
from distributed import get_task_stream

from cumf_dask import ALS, RatingsStore
from cumf_dask.checkpoint import Checkpointer
from cumf_dask.config import ClusterConfig, PlanConfig
from cumf_dask.data.planted import PlantedModel
from cumf_dask.data.synthetic import generate
from cumf_dask.engine.cluster import cluster_client
from cumf_dask.errors import StoreError


def get_store(args: argparse.Namespace) -> RatingsStore:
    model = PlantedModel.create(
        preset=args.preset,
        scale=args.scale,
        m=args.m,
        n=args.n,
        nnz=round(args.nnz / 0.9) if args.nnz else None,  # train ratings + 10% held out
        rank=10,
        noise=0.5,
        rating_min=1,
        rating_max=5,
        seed=1,
    )
    # named by the resolved shape: a store of another shape (or of an older meaning of
    # --scale) is another file
    label = f"{args.preset or 'custom'}-{model.m}x{model.n}-{model.nnz}"
    url = str(Path(args.data) / f"bench-{label}.zarr")
    try:
        return RatingsStore.open(url)
    except StoreError:
        t0 = time.perf_counter()
        store = generate(url, model, test_fraction=0.1, overwrite=True, use_gpu=False)
        print(f"generated {url} in {time.perf_counter() - t0:.1f} s")
        return store


@contextlib.contextmanager
def timed_saves(saves: list[tuple[int, float]]):
    """Record (iteration, seconds) of each checkpoint save while the block runs."""
    original = Checkpointer.save

    def save(self, iteration, *args, **kwargs):
        t0 = time.perf_counter()
        original(self, iteration, *args, **kwargs)
        saves.append((iteration, time.perf_counter() - t0))

    Checkpointer.save = save
    try:
        yield
    finally:
        Checkpointer.save = original


def plot(path: str) -> str:
    """Seconds per iteration against training ratings, one line per device (report.py)."""
    from report import write_results

    rows = []
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        rows.append(
            {
                "device": r["device"].split("; ")[-1],  # the GPUs where the line names them
                "shape": f"{r['shape'][0]:,} x {r['shape'][1]:,}",
                "train_ratings": r["nnz"],
                "factors": r["factors"],
                "seconds_per_iteration": round(r["median_seconds_per_iteration"], 4),
                "date": r["date"],
            }
        )
    return write_results(
        "iteration",
        rows,
        x="train_ratings",
        y="seconds_per_iteration",
        series="device",
        title="ALS iteration, whole Dask pipeline (median)",
        logx=True,
        logy=True,
    )


def task_breakdown(tasks: list[dict], metrics: list[dict]) -> str:
    """Per iteration: wall seconds, seconds with some task computing, and compute seconds by
    kind (the key up to its first digit-bearing part, e.g. "update-X-batch"). Tasks of no
    iteration (resident block loads, the kernel compile, counts, initial factors) count in
    iteration 1, when they run."""
    spans: dict[int, list[tuple[float, float, str]]] = defaultdict(list)
    for task in tasks:
        key = str(task["key"])
        found = re.search(r"-it(\d+)", key)
        if found is None and not key.startswith(("load-", "prepare-", "counts-", "init-")):
            continue  # not the fit's (the link measurement, the model's way to the client)
        kind = re.split(r"\d", key, maxsplit=1)[0].rstrip("-")
        for ss in task["startstops"]:
            if ss["action"] == "compute":
                spans[int(found.group(1)) if found else 1].append((ss["start"], ss["stop"], kind))
    lines = [
        "| it | wall s | some task computing s | compute s by kind |",
        "| --- | --- | --- | --- |",
    ]
    for record in metrics:
        it = record["iteration"]
        busy, end = 0.0, -float("inf")
        kinds: dict[str, float] = defaultdict(float)
        for start, stop, kind in sorted(spans.get(it, [])):
            busy += max(0.0, stop - max(start, end))
            end = max(end, stop)
            kinds[kind] += stop - start
        top = ", ".join(f"{k} {v:.4f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
        lines.append(f"| {it} | {record['seconds']:.4f} | {busy:.4f} | {top} |")
    first = spans.get(1, [])
    if first:
        t0 = min(start for start, _, _ in first)
        lines += ["", "iteration 1 by kind: first start .. last stop, s after the first task"]
        window: dict[str, tuple[float, float]] = {}
        for start, stop, kind in first:
            lo, hi = window.get(kind, (start, stop))
            window[kind] = (min(lo, start), max(hi, stop))
        lines += [f"  {kind}: {lo - t0:.3f} .. {hi - t0:.3f}"
                  for kind, (lo, hi) in sorted(window.items(), key=lambda kv: kv[1])]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset")
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiplies the preset's nnz, and m and n by sqrt(scale)",
    )
    parser.add_argument("--m", type=int, help="default (no preset): issue 3's 100,000")
    parser.add_argument("--n", type=int, help="default (no preset): 20,000")
    parser.add_argument("--nnz", type=int, help="train ratings; default (no preset): 5,000,000")
    parser.add_argument("--factors", type=int, default=50)
    parser.add_argument("--lam", type=float, default=0.05)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--backend", default="numpy", choices=["numpy", "cupy"])
    parser.add_argument("--workers", type=int, help="default: one per core / per GPU")
    parser.add_argument("--threads", type=int, default=1, help="threads per CPU worker")
    parser.add_argument("--p", type=int)
    parser.add_argument("--q", type=int)
    parser.add_argument("--no-eval", action="store_true", help="skip per-iteration RMSE")
    parser.add_argument(
        "--blocks",
        default="auto",
        choices=["auto", "device", "host", "store"],
        help="where R's blocks live between half-steps (plan.blocks)",
    )
    parser.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="save checkpoints there (written while the next iterations run); prints the saves",
    )
    parser.add_argument("--data", default="/tmp/cumf-bench")
    parser.add_argument("--json", help="append the result record to this JSON-lines file")
    parser.add_argument(
        "--task-stream",
        action="store_true",
        help="print where each iteration's time goes (Dask's task stream)",
    )
    parser.add_argument(
        "--plot",
        metavar="JSONL",
        help="only report: records of earlier runs -> results/iteration.json, .png and a table",
    )
    args = parser.parse_args()
    if args.plot:
        print(plot(args.plot))
        return
    if args.preset is None:
        args.m, args.n = args.m or 100_000, args.n or 20_000
        args.nnz = args.nnz or 5_000_000

    store = get_store(args)
    cluster = ClusterConfig(
        backend=args.backend,
        n_workers=args.workers,
        threads_per_worker=args.threads,
        dashboard_address=None,
    )
    t0 = time.perf_counter()
    with cluster_client(cluster) as client:
        started = time.perf_counter() - t0
        workers = len(client.scheduler_info()["workers"])
        model = ALS(
            args.factors,
            args.lam,
            args.iterations,
            backend=args.backend,
            plan=PlanConfig(p=args.p, q=args.q, blocks=args.blocks),
            evaluate=not args.no_eval,
            checkpoint_dir=args.checkpoint,
        )
        t1 = time.perf_counter()
        stream = get_task_stream(client) if args.task_stream else contextlib.nullcontext()
        saves: list[tuple[int, float]] = []
        with stream as recorded, timed_saves(saves):
            model.fit(store, client=client)
        fit_wall = time.perf_counter() - t1
    steady = [r["seconds"] for r in model.metrics_[1:]] or [model.metrics_[0]["seconds"]]
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "device": describe(args.backend == "cupy"),
        "backend": args.backend,
        "workers": workers,
        "shape": [store.m, store.n],
        "nnz": store.nnz,
        "factors": args.factors,
        "lambda": args.lam,
        "plan": {
            "x": [model.plan_.x.p, model.plan_.x.q],
            "theta": [model.plan_.theta.p, model.plan_.theta.q],
            "blocks": model.plan_.blocks,
        },
        "median_seconds_per_iteration": statistics.median(steady),
        "median_x_seconds": statistics.median(
            r["x_seconds"] for r in model.metrics_[1:] or model.metrics_
        ),
        "median_theta_seconds": statistics.median(
            r["theta_seconds"] for r in model.metrics_[1:] or model.metrics_
        ),
        "cluster_start_seconds": started,
        "fit_wall_seconds": fit_wall,
        "iterations": model.metrics_,
    }
    print(f"device: {record['device']}, backend {args.backend}, {workers} workers")
    print(
        f"shape: {store.m:,} x {store.n:,}, {store.nnz:,} ratings, f={args.factors}, "
        f"lambda={args.lam}, plan X p,q={record['plan']['x']} Theta p,q={record['plan']['theta']}"
        f", blocks on the {model.plan_.blocks}"
    )
    print(f"{'it':>3}{'seconds':>10}{'X':>9}{'Theta':>9}{'train':>9}{'test':>9}")
    for r in model.metrics_:
        print(
            f"{r['iteration']:>3}{r['seconds']:>10.3f}{r['x_seconds']:>9.3f}"
            f"{r['theta_seconds']:>9.3f}{r.get('train_rmse', float('nan')):>9.4f}"
            f"{r.get('test_rmse', float('nan')):>9.4f}"
        )
    predicted = sum(h.predicted["seconds"] for h in (model.plan_.x, model.plan_.theta))
    record["predicted_seconds_per_iteration"] = predicted
    steady_s = record["median_seconds_per_iteration"]
    print(f"median seconds per iteration (iterations 2..): {steady_s:.3f}, "
          f"{steady_s / predicted:.2f} x the planner's prediction {predicted:.3f} "
          "(engine/costs.py's nominal rates)")  # fmt: skip
    print(f"cluster start {started:.2f} s; fit() wall {fit_wall:.2f} s "
          f"(iteration 1: {model.metrics_[0]['seconds']:.2f} s)")  # fmt: skip
    if args.checkpoint:
        record["saves"] = saves
        print(f"checkpoints saved after iterations {[it for it, _ in saves]}, "
              f"median save {statistics.median(s for _, s in saves):.3f} s")  # fmt: skip
    if args.task_stream:
        print(task_breakdown(recorded.data, model.metrics_))
    if args.json:
        with open(args.json, "a") as fh:
            fh.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
