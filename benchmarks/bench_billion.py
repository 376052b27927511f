"""A paper-scale run end to end: generate the store on every core, then fit on every GPU.

    python3 benchmarks/bench_billion.py --preset hugewiki --factors 100 --lam 0.05
    python3 benchmarks/bench_billion.py --preset sparkals --factors 10 --iterations 10
    python3 benchmarks/bench_billion.py --preset facebook --scale 0.01 --factors 16 \
        --plan blocks=auto --plan memory_budget=6GB,factors=host   # two fits, one store

Generation runs on a LocalCluster of one process per core (pairs, rating values and split on
the CPU unless --gen-gpu, which computes them on GPU 0, every process's default device), so
it uses the whole machine; training on a LocalCUDACluster (one worker per GPU, UCX over
NVLink when distributed-ucxx is installed). Prints the device, the shape, generation rate
and disk use, the plan, time to the first iteration (cluster, loading, compiling), seconds
per iteration (median after the first; n/a with one iteration), test RMSE against the
planted noise, and peak host and GPU memory per worker; appends a JSON record to --json.
Each --plan (PlanConfig fields, e.g. ``memory_budget=6GB,factors=host``) is one fit on the
same store, on a fresh cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

from device import describe
from distributed import get_task_stream

from cumf_dask import ALS
from cumf_dask.config import ClusterConfig, PlanConfig
from cumf_dask.data.planted import PlantedModel
from cumf_dask.data.store import RatingsStore
from cumf_dask.data.synthetic import generate
from cumf_dask.devices import has_cuda
from cumf_dask.engine.cluster import cluster_client, transport


def generate_store(args: argparse.Namespace) -> tuple[RatingsStore, float]:
    from distributed import Client, LocalCluster

    model = PlantedModel.create(
        preset=args.preset, scale=args.scale, rank=args.rank, noise=args.noise,
        rating_min=1, rating_max=5, seed=1,
    )  # fmt: skip
    url = str(Path(args.data) / f"billion-{args.preset}-scale{args.scale:g}.zarr")
    workers = args.gen_workers or os.cpu_count() or 1
    with (
        LocalCluster(n_workers=workers, threads_per_worker=1, dashboard_address=None) as cl,
        Client(cl) as client,
    ):
        t0 = time.perf_counter()
        store = generate(url, model, test_fraction=0.1, client=client, overwrite=True,
                         use_gpu=args.gen_gpu)  # fmt: skip
        seconds = time.perf_counter() - t0
    return store, seconds


def peaks(client) -> dict[str, float]:
    """Peak resident host memory of the workers, and the GPU memory they hold after the fit
    (all of it, and CuPy's pool's share, which a memory budget bounds), GB (largest worker)."""

    def measure() -> tuple[float, float, float]:
        import resource

        import cupy

        host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        free, total = cupy.cuda.runtime.memGetInfo()
        pool = cupy.get_default_memory_pool().total_bytes()
        return host / 1e9, (total - free) / 1e9, pool / 1e9

    values = list(client.run(measure).values())
    keys = ("host_gb", "gpu_gb", "pool_gb")
    return {key: max(v[k] for v in values) for k, key in enumerate(keys)}


def plan_config(text: str, blocks: str) -> PlanConfig:
    """A --plan value (``key=value,...`` of PlanConfig's top-level fields) as a PlanConfig."""
    fields: dict[str, str] = {"blocks": blocks}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--plan {text!r}: expected key=value items, got {item!r}")
        fields[key.strip()] = value.strip()
    return PlanConfig(**fields)  # type: ignore[arg-type]


def print_task_seconds(records: list[dict]) -> None:
    """Task seconds on the workers by kind (the key without numbers and run suffix): what
    each kind of task computed, and the transfers of its inputs."""
    totals: dict[tuple[str, str], list[float]] = {}
    for record in records:
        kind = re.sub(r"\d+", "#", str(record["key"]).rsplit("-", 1)[0])
        for span in record.get("startstops", ()):
            total = totals.setdefault((kind, span["action"]), [0.0, 0])
            total[0] += span["stop"] - span["start"]
            total[1] += 1
    print(f"{'task kind':<44}{'action':>10}{'seconds':>9}{'count':>7}")
    for (kind, action), (seconds, count) in sorted(totals.items(), key=lambda t: -t[1][0])[:16]:
        print(f"{kind:<44}{action:>10}{seconds:>9.2f}{count:>7}")


def print_iteration_tasks(records: list[dict], kinds: int = 4) -> None:
    """Per iteration, the compute seconds of the busiest kinds of per-iteration task: their
    sum and the longest task (where a slow iteration's time went)."""
    table: dict[str, dict[int, list[float]]] = {}
    for record in records:
        key = str(record["key"])
        it = re.search(r"-it(\d+)", key)
        if it is None:
            continue
        kind = re.sub(r"\d+", "#", key.rsplit("-", 1)[0])
        for span in record.get("startstops", ()):
            if span["action"] == "compute":
                seconds = span["stop"] - span["start"]
                cell = table.setdefault(kind, {}).setdefault(int(it.group(1)), [0.0, 0.0])
                cell[0] += seconds
                cell[1] = max(cell[1], seconds)
    busiest = sorted(table, key=lambda k: -sum(c[0] for c in table[k].values()))[:kinds]
    print("compute seconds per iteration, sum / longest task:")
    print(f"{'it':>3}" + "".join(f"{k[:30]:>32}" for k in busiest))
    for it in sorted({i for k in busiest for i in table[k]}):
        cells = [table[k].get(it, [0.0, 0.0]) for k in busiest]
        print(f"{it:>3}" + "".join(f"{f'{c[0]:.3f} / {c[1]:.3f}':>32}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="hugewiki")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--rank", type=int, default=10)
    parser.add_argument("--noise", type=float, default=0.5)
    parser.add_argument("--factors", type=int, default=100)
    parser.add_argument("--lam", type=float, default=0.05)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--solver", default=None, help="cholesky or cg (when available)")
    parser.add_argument("--gen-workers", type=int, default=None)
    parser.add_argument("--gen-gpu", action="store_true", help="generation's pairs, rating "
                        "values and split (and the transposition's sort) on GPU 0: each "
                        "generator process's default device (they are not spread over the "
                        "GPUs); the CPUs compress and write")  # fmt: skip
    parser.add_argument("--blocks", default="auto", choices=["auto", "device", "host", "store"],
                        help="where R's blocks live between half-steps (plan.blocks)")
    parser.add_argument("--plan", action="append", default=None, help="key=value,... of "
                        "PlanConfig for one fit (repeat: several fits on one store)")  # fmt: skip
    parser.add_argument("--score", default="final", choices=["final", "every"],
                        help="test RMSE once after the fit, on this host (iterations timed "
                        "alone), or train and test RMSE after every iteration on the workers "
                        "(on one GPU the scoring runs between the next half-steps and counts "
                        "in their seconds)")  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="print where the workers' "
                        "time went: task seconds by kind, summed over the fit")  # fmt: skip
    parser.add_argument("--data", default="/tmp/cumf-bench")
    parser.add_argument("--keep", action="store_true", help="keep the store afterwards")
    parser.add_argument("--json")
    args = parser.parse_args()
    plans = [plan_config(text, args.blocks) for text in args.plan or [""]]
    if not has_cuda():
        parser.error("needs a CUDA GPU with cupy (this benchmark times the GPU engine)")
    device = describe(gpu=True)
    store, gen_seconds = generate_store(args)
    try:
        run_fits(store, gen_seconds, device, args, plans)
    finally:
        if not args.keep:
            shutil.rmtree(store.url, ignore_errors=True)


def run_fits(store: RatingsStore, gen_seconds: float, device: str, args: argparse.Namespace,
             plans: list[PlanConfig]) -> None:  # fmt: skip
    """Print the store's generation, then one fit per plan (appended to --json)."""
    ratings = store.nnz + store.nnz_test
    disk = store.size_on_disk() or 0
    print(f"device: {device}")
    print(f"generated {args.preset} x {args.scale:g}: {store.m:,} x {store.n:,}, {ratings:,} "
          f"ratings in {gen_seconds:.1f} s ({ratings / gen_seconds / 1e6:.1f} M ratings/s), "
          f"{disk / 1e9:.1f} GB on disk")  # fmt: skip
    record = {"date": time.strftime("%Y-%m-%d"), "device": device,
              "preset": args.preset, "scale": args.scale, "shape": [store.m, store.n],
              "ratings": ratings, "factors": args.factors, "generation_s": gen_seconds,
              "disk_bytes": disk}  # fmt: skip
    for config in plans:
        result = fit_once(store, args, config)
        if args.json:
            with open(args.json, "a") as fh:
                fh.write(json.dumps({**record, **result}) + "\n")


def steady_text(steady: float | None) -> str:
    """The median seconds per iteration after the first, for the summary line ("n/a" when
    the fit ran one iteration: there is none after it)."""
    return "n/a (one iteration)" if steady is None else f"{steady:.2f} s/iteration"


def fit_once(store: RatingsStore, args: argparse.Namespace, config: PlanConfig) -> dict:
    """One fit on a fresh cluster: prints the plan, each iteration, the time to the first
    one and peak memory; returns them as a record."""
    t0 = time.perf_counter()
    with cluster_client(ClusterConfig(backend="cupy", dashboard_address=None)) as client:
        started = time.perf_counter() - t0
        extra = {"solver": args.solver} if args.solver else {}
        model = ALS(args.factors, args.lam, args.iterations, backend="cupy", plan=config,
                    evaluate=args.score == "every", **extra)  # fmt: skip
        t1 = time.perf_counter()
        with get_task_stream(client) if args.profile else nullcontext() as stream:
            model.fit(store, client=client)
        fit_wall = time.perf_counter() - t1
        memory = peaks(client)
        scheme = transport(client)
    its = model.metrics_
    if args.score == "final":
        t2 = time.perf_counter()
        its[-1]["test_rmse"] = model.rmse(store)
        print(f"test RMSE of the final model on the host: {time.perf_counter() - t2:.1f} s")
    steady = statistics.median(r["seconds"] for r in its[1:]) if len(its) > 1 else None
    plan = {h.label: [h.p, h.q] for h in (model.plan_.x, model.plan_.theta)}
    print(f"--plan {config}")
    print(model.plan_.table())
    print(f"{'it':>3}{'seconds':>9}{'X':>8}{'Theta':>8}{'train':>8}{'test':>8}")
    for r in its:
        print(f"{r['iteration']:>3}{r['seconds']:>9.2f}{r['x_seconds']:>8.2f}"
              f"{r['theta_seconds']:>8.2f}{r.get('train_rmse', 0):>8.4f}"
              f"{r.get('test_rmse', 0):>8.4f}")  # fmt: skip
    print(f"cluster start {started:.1f} s; time to first iteration done (after generation) "
          f"{started + (fit_wall - sum(r['seconds'] for r in its[1:])):.1f} s; iteration 1 "
          f"{its[0]['seconds']:.1f} s (loading, compiling); steady {steady_text(steady)}; "
          f"fit wall {fit_wall:.1f} s; transport {scheme}")  # fmt: skip
    print(f"test RMSE {its[-1].get('test_rmse')} (planted noise {args.noise}); peak per worker:"
          f" host {memory['host_gb']:.1f} GB, GPU {memory['gpu_gb']:.1f} GB (CuPy's pool"
          f" {memory['pool_gb']:.1f} GB)")  # fmt: skip
    if stream is not None:
        print_task_seconds(stream.data)
        print_iteration_tasks(stream.data)
    return {"plan_config": str(config), "blocks": model.plan_.blocks,
            "host_factor": model.plan_.host_factor, "plan": plan, "transport": scheme,
            "fit_wall_s": fit_wall, "cluster_start_s": started, "steady_s": steady,
            "iterations": its, **memory}  # fmt: skip


if __name__ == "__main__":
    main()
