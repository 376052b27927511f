"""Several GPUs against one on the same data, in one process: speed-up, transport, plan, RMSE.

    python3 benchmarks/bench_scaling.py --preset netflix --nnz 99000000 --factors 100
    python3 benchmarks/bench_scaling.py --preset yahoomusic --factors 100 --lam 1.4 --gpus 1 2 4
    python3 benchmarks/bench_scaling.py ... --reductions     # forced p = W: scatter, two-phase, one
    python3 benchmarks/bench_scaling.py ... --implicit cg    # implicit feedback (CG 3 steps)
    python3 benchmarks/bench_scaling.py ... --no-eval        # RMSE once, after the fit
    python3 benchmarks/bench_scaling.py ... --transports ucx --repeats 3  # fits alternated
    python3 benchmarks/bench_scaling.py ... --trace          # where an iteration's time goes

For each cluster (1 GPU; then each count of --gpus over TCP and over UCX/NVLink when
distributed-ucxx is installed) a fresh LocalCUDACluster fits the same store with the same
seed; prints the device, shape, f, the median seconds per iteration after the first (X and
Theta half-steps; the first's with --iterations 1), the planner's predicted seconds, the
measured link bandwidth, the test RMSE, and the speed-up over one GPU (test RMSE must agree
to 4 digits). --reductions adds runs with a forced data-parallel plan for each reduction
strategy. --implicit fits the implicit-feedback model (the ratings as counts, alpha 1) with
that solver instead, and compares its training loss (4 digits) in place of the test RMSE.
--no-eval scores nothing during the fit (the iterations time the half-steps alone, as a fit
without evaluation runs) and the test RMSE once afterwards, on the client.

--transports picks the several-GPU clusters' transports (default: TCP, and UCX when
distributed-ucxx is installed). --repeats fits every cluster that many times, the clusters
alternated (1 GPU, then each other one, again), and shows each cluster's median fit with
all its fits' seconds beside it (fits of the same code on two GPUs vary by about +-3 ms
per iteration). --trace records Dask's task stream during each fit and prints, per
cluster, the median over iterations 2.. of each half-step's time (from the previous
half-step done on every GPU, its last non-finite check, to itself done) and of when its
last update task started after that (positive: it waited for the other factor's pieces or
the scheduler; negative: queued ahead). On one GPU a check also waits for the kernels
queued behind its half-step, so the split between the half-steps is skewed there (their
sum is right); on several GPUs it shows the waits between them. Records go to --json.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

from bench_iteration import get_store
from device import describe
from distributed import get_task_stream

from cumf_dask import ALS, ImplicitALS
from cumf_dask.compat import has_module
from cumf_dask.config import ClusterConfig, PlanConfig
from cumf_dask.devices import has_cuda
from cumf_dask.engine.cluster import cluster_client, transport

# the tasks of a half-step in the engine's task keys (engine/halfstep.py), and its checks
COMPUTES = re.compile(r"^(?:update|hermitian|reduce-solve)-(X|Theta)-.*-it(\d+)-")
CHECKS = re.compile(r"^finite-(X|Theta)-w\d+-it(\d+)-")


def run(store, args, gpus: int, protocol: str, plan: PlanConfig) -> dict:
    config = ClusterConfig(
        backend="cupy", devices=list(range(gpus)), protocol=protocol, dashboard_address=None
    )
    t0 = time.perf_counter()
    with cluster_client(config) as client:
        started = time.perf_counter() - t0
        if args.implicit:
            model = ImplicitALS(args.factors, args.lam, 1.0, args.iterations, solver=args.implicit,
                                backend="cupy", plan=plan)  # fmt: skip
        else:
            model = ALS(args.factors, args.lam, args.iterations, backend="cupy", plan=plan,
                        evaluate=not args.no_eval)  # fmt: skip
        t1 = time.perf_counter()
        with get_task_stream(client) if args.trace else nullcontext() as stream:
            model.fit(store, client=client)
        wall = time.perf_counter() - t1
        scheme = transport(client)
    last = model.metrics_[-1]
    if args.implicit:
        score = last["loss"]
    else:
        score = model.rmse(store, "test") if args.no_eval else last["test_rmse"]
    return {
        "gpus": gpus,
        "transport": scheme,
        "reduction": plan.reduction,
        "plan": {h.label: [h.p, h.q] for h in (model.plan_.x, model.plan_.theta)},
        "link_gb_s": model.plan_.link / 1e9,
        "cluster_start_s": started,
        "fit_wall_s": wall,
        **iteration_seconds(model.metrics_),
        "predicted_s": sum(h.predicted["seconds"] for h in (model.plan_.x, model.plan_.theta)),
        "model": f"implicit-{args.implicit}" if args.implicit else "explicit",
        "test_rmse": score,  # or the implicit loss
        "spans_ms": half_step_spans(stream.data) if args.trace else None,
    }


def iteration_seconds(metrics: list[dict]) -> dict[str, float]:
    """Iteration 1's seconds, and the medians of the iterations after it (of iteration 1
    itself when the fit ran only that one): whole iterations, X and Theta half-steps."""
    steady = metrics[1:] or metrics
    return {
        "iteration1_s": metrics[0]["seconds"],
        "median_s": statistics.median(r["seconds"] for r in steady),
        "x_s": statistics.median(r["x_seconds"] for r in steady),
        "theta_s": statistics.median(r["theta_seconds"] for r in steady),
    }


def half_step_spans(tasks: list[dict]) -> dict[str, float]:
    """Medians over iterations 2.. (ms), from Dask's task stream: each half-step from the
    previous one done to itself done (on every worker's GPU: the last non-finite check),
    and how long after the previous half-step was done its last update task started
    (waiting for the other factor's pieces, or the scheduler; negative: queued ahead)."""
    last_start: dict[tuple[str, int], float] = defaultdict(lambda: float("-inf"))
    done: dict[tuple[str, int], float] = defaultdict(lambda: float("-inf"))
    for task in tasks:
        key = str(task["key"])
        computes = [span for span in task["startstops"] if span["action"] == "compute"]
        if found := COMPUTES.match(key):
            slot = (found.group(1), int(found.group(2)))
            last_start[slot] = max([last_start[slot], *(span["start"] for span in computes)])
        elif found := CHECKS.match(key):
            slot = (found.group(1), int(found.group(2)))
            done[slot] = max([done[slot], *(span["stop"] for span in computes)])
    rows = defaultdict(list)
    for it in range(2, max((it for _, it in done), default=0) + 1):
        for side, before in (("X", ("Theta", it - 1)), ("Theta", ("X", it))):
            if (side, it) in done and before in done:
                rows[side].append(done[side, it] - done[before])
                rows[f"{side} start"].append(last_start[side, it] - done[before])
    return {name: 1e3 * statistics.median(values) for name, values in rows.items()}


def median_fit(repeats: list[dict]) -> dict:
    """The fit with the median seconds per iteration (the lower middle one of an even
    count), with every fit's seconds per iteration beside it."""
    ranked = sorted(repeats, key=lambda r: r["median_s"])
    return {**ranked[(len(ranked) - 1) // 2], "fits_s": [r["median_s"] for r in repeats]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="netflix")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiplies the preset's nnz, and m and n by sqrt(scale)")
    parser.add_argument("--m", type=int)
    parser.add_argument("--n", type=int)
    parser.add_argument("--nnz", type=int, help="train ratings (default: the preset's)")
    parser.add_argument("--factors", type=int, default=100)
    parser.add_argument("--lam", type=float, default=0.05)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--gpus", type=int, nargs="+", default=[2])
    parser.add_argument("--reductions", action="store_true")
    parser.add_argument("--implicit", choices=["cg", "cholesky"],
                        help="fit the implicit model with this solver")
    parser.add_argument("--no-eval", action="store_true",
                        help="no scoring during the fit; the test RMSE once, after it")
    parser.add_argument("--transports", nargs="+", choices=["tcp", "ucx"],
                        default=["tcp", "ucx"] if has_module("distributed_ucxx") else ["tcp"],
                        help="transports of the several-GPU clusters")
    parser.add_argument("--repeats", type=int, default=1,
                        help="fits per cluster, alternated; each cluster's median fit is shown")
    parser.add_argument("--trace", action="store_true",
                        help="print where each cluster's iterations go (Dask's task stream)")
    parser.add_argument("--data", default="/tmp/cumf-bench")
    parser.add_argument("--json", help="append the records to this JSON-lines file")
    args = parser.parse_args()
    if args.no_eval and args.implicit:
        parser.error("--no-eval scores the explicit model's test RMSE: not with --implicit")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if not has_cuda() or not has_module("dask_cuda"):
        parser.error("needs CUDA GPUs with cupy and dask-cuda (pip install 'cumf-dask[gpu]')")
    store = get_store(args)
    clusters = [(1, "tcp", PlanConfig())]
    for gpus in args.gpus:
        clusters += [(gpus, protocol, PlanConfig()) for protocol in args.transports]
        if args.reductions:
            for reduction in ("scatter", "two-phase", "one"):
                groups = [[g] for g in range(gpus)] if reduction == "two-phase" else None
                forced = PlanConfig(p=gpus, q=2, reduction=reduction, groups=groups)
                clusters.append((gpus, args.transports[-1], forced))
    fits: list[list[dict]] = [[] for _ in clusters]
    for _ in range(args.repeats):
        for k, cluster in enumerate(clusters):
            fits[k].append(run(store, args, *cluster))
    runs = [median_fit(repeats) for repeats in fits]
    one = runs[0]
    print(f"device: {describe(gpu=True)}")
    print(f"shape: {store.m:,} x {store.n:,}, {store.nnz:,} ratings, f={args.factors}, "
          f"lambda={args.lam}, {args.iterations} iterations (median of 2..)")  # fmt: skip
    head = (f"{'gpus':>4} {'transport':>9} {'reduction':>9} {'plan X,Theta':>16} {'link GB/s':>9} "
            f"{'it1 s':>6} {'s/it':>7} {'X s':>7} {'Theta s':>7} {'pred s':>7} {'speed-up':>8} "
            f"{'loss' if args.implicit else 'test RMSE':>9}"
            + ("  fits s/it" if args.repeats > 1 else ""))  # fmt: skip
    print(head)
    for r in runs:
        each = " ".join(f"{t:.4f}" for t in r["fits_s"]) if args.repeats > 1 else ""
        r["speedup"] = one["median_s"] / r["median_s"]
        r["rmse_matches"] = round(r["test_rmse"], 4) == round(one["test_rmse"], 4)
        plan = f"{r['plan']['X']}/{r['plan']['Theta']}".replace(" ", "")
        print(f"{r['gpus']:>4} {r['transport']:>9} {r['reduction']:>9} {plan:>16} "
              f"{r['link_gb_s']:>9.1f} {r['iteration1_s']:>6.2f} {r['median_s']:>7.4f} "
              f"{r['x_s']:>7.4f} {r['theta_s']:>7.4f} {r['predicted_s']:>7.4f} "
              f"{r['speedup']:>7.2f}x {r['test_rmse']:>9.4f}"
              + ("" if r["rmse_matches"] else "  DIFFERS")
              + (f"  {each}" if each else ""))  # fmt: skip
    if args.trace:
        print("median ms over iterations 2..: each half-step from the previous one done, and "
              "its last update task's start after that")
        for r in runs:
            spans = "  ".join(f"{name} {ms:6.1f}" for name, ms in r["spans_ms"].items())
            print(f"{r['gpus']:>4} {r['transport']:>9} {r['reduction']:>9}  {spans}")
    if args.json:
        record = {"date": time.strftime("%Y-%m-%d"), "device": describe(gpu=True),
                  "shape": [store.m, store.n], "nnz": store.nnz, "factors": args.factors,
                  "runs": runs}  # fmt: skip
        with Path(args.json).open("a") as fh:
            fh.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
