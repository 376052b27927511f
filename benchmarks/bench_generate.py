"""Benchmark the synthetic generator: ratings per second and store build rate.

    python benchmarks/bench_generate.py            # Netflix shape at scale 0.4, 2 workers
                                                   # (303,705 x 11,239, 39.6M ratings)
    python benchmarks/bench_generate.py --m 10000000 --n 1000000 --nnz 50000000
    python benchmarks/bench_generate.py --gpu      # pairs, values, split and the transposition's
                                                   # sort on the GPU (needs cupy)

Workers are local Dask worker processes (one thread each); --workers 0 uses the thread pool
of ``generate(client=None)``. Each repeat builds the store from scratch; the median is shown.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from cumf_dask.config import GenerateConfig
from cumf_dask.data.planted import PlantedModel
from cumf_dask.data.synthetic import generate


def describe_device(gpu: bool) -> str:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines()
                 if ln.startswith("model name")]  # fmt: skip
        cpu = names[0] if names else cpu
    text = f"{cpu}, {os.cpu_count()} cores"
    if gpu:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        text += f"; GPU {props['name'].decode()}"
    return text


def run_once(url: str, model: PlantedModel, client, gpu: bool) -> dict[str, float]:
    stages: dict[str, float] = {}
    start = time.perf_counter()

    def progress(stage: str, done: int, total: int) -> None:
        if done == total:
            stages[stage] = time.perf_counter() - start

    store = generate(url, model, client=client, overwrite=True, progress=progress, use_gpu=gpu)
    total = time.perf_counter() - start
    size = store.size_on_disk() or 0
    return {
        "total_s": total,
        "rows_s": stages["generate"],
        "cols_s": stages["transpose"] - stages["generate"],
        "ratings": store.nnz + store.nnz_test,
        "bytes": size,
        "tiles": f"{store.n_row_tiles} x {store.n_col_tiles} bands",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="netflix")
    parser.add_argument("--scale", type=float, default=0.4,
                        help="multiplies the preset's nnz, and m and n by sqrt(scale)")
    parser.add_argument("--m", type=int)
    parser.add_argument("--n", type=int)
    parser.add_argument("--nnz", type=int)
    parser.add_argument("--rank", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2, help="0: thread pool, no cluster")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu", action="store_true",
                        help="compute pairs, rating values and split (and sort the transposition) "
                        "with cupy; the CPU compresses and writes")  # fmt: skip
    parser.add_argument("--dir", default=None, help="where to write the store (default: /tmp)")
    args = parser.parse_args()

    custom = args.m is not None
    gen = GenerateConfig(
        preset=None if custom else args.preset, scale=1.0 if custom else args.scale,
        m=args.m, n=args.n, nnz=args.nnz, rank=args.rank, rating_min=1, rating_max=5,
    )  # fmt: skip
    model = PlantedModel.create(**asdict(gen))
    workdir = tempfile.mkdtemp(prefix="bench-generate-", dir=args.dir)
    url = str(Path(workdir) / "ratings.zarr")
    print(f"device: {describe_device(args.gpu)}")
    cluster = client = None
    if args.workers > 0:
        from distributed import Client, LocalCluster

        cluster = LocalCluster(n_workers=args.workers, threads_per_worker=1, dashboard_address=None)
        client = Client(cluster)
    try:
        runs = []
        for i in range(args.repeats):
            run = run_once(url, model, client, args.gpu)
            runs.append(run)
            print(
                f"  run {i + 1}: {run['total_s']:.1f} s (row bands {run['rows_s']:.1f} s, "
                f"column bands {run['cols_s']:.1f} s)"
            )
    finally:
        if client is not None:
            client.close()
            cluster.close()
        shutil.rmtree(workdir, ignore_errors=True)

    first = runs[0]
    total = statistics.median(r["total_s"] for r in runs)
    rows = statistics.median(r["rows_s"] for r in runs)
    ratings = first["ratings"]
    label = f"{args.preset} x {args.scale}" if not custom else "custom"
    m, n = model.m, model.n
    print(f"shape: {label}: {m:,} x {n:,}, {ratings:,} ratings, rank {gen.rank}, {first['tiles']}")
    print(f"workers: {args.workers or 'threads'}, gpu: {args.gpu}, repeats: {args.repeats}")
    print(f"ratings generated/s (row bands: generate + write): {ratings / rows / 1e6:.2f} M/s")
    print(f"ratings/s, whole store (incl. transposition):      {ratings / total / 1e6:.2f} M/s")
    print(f"store build rate: {first['bytes'] / total / 1e6:.1f} MB/s "
          f"({first['bytes'] / 1e6:.0f} MB on disk in {total:.1f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
