"""Benchmark the synthetic generator: ratings per second and store build rate.

    python benchmarks/bench_generate.py            # Netflix shape at scale 0.4, 2 workers
                                                   # (303,705 x 11,239, 39.6M ratings)
    python benchmarks/bench_generate.py --m 10000000 --n 1000000 --nnz 50000000
    python benchmarks/bench_generate.py --gpu      # pairs, values, split and the transposition's
                                                   # sort on GPU 0 (needs cupy)

Workers are local Dask worker processes (one thread each); --workers 0 uses the thread pool
of ``generate(client=None)``. With --gpu every worker computes on its default device, GPU 0:
a LocalCluster does not spread its workers over the GPUs. --m, --n and --nnz override the
preset's shape at --scale, as in ``cumf-dask generate``. Each repeat builds the store from
scratch; the median is shown, and the build rate as a share of the ceiling: writing as many
bytes to a file in the same folder (through the page cache, as the build writes).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
from device import describe

from cumf_dask.config import GenerateConfig
from cumf_dask.data.planted import PlantedModel
from cumf_dask.data.synthetic import generate


def write_rate(folder: str, size: int) -> float:
    """Bytes/s of writing `size` random bytes (at most 1 GiB) to a fresh file in `folder`, as a
    store build writes (through the page cache, no fsync): the build's ceiling were it only
    writing its bytes."""
    size = max(1, min(size, 1 << 30))
    chunk = np.random.default_rng().bytes(min(size, 16 << 20))
    path = Path(folder) / "write-probe.bin"
    start = time.perf_counter()
    with open(path, "wb") as fh:
        for _ in range(-(-size // len(chunk))):
            fh.write(chunk)
    seconds = time.perf_counter() - start
    written = path.stat().st_size
    path.unlink()
    return written / seconds


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


def planted_model(args: argparse.Namespace) -> tuple[PlantedModel, str]:
    """The model to generate and its shape's label: the preset at --scale, with any of --m,
    --n and --nnz applied on top of it, as ``cumf-dask generate`` does."""
    overrides = {k: getattr(args, k) for k in ("m", "n", "nnz") if getattr(args, k) is not None}
    gen = GenerateConfig(preset=args.preset, scale=args.scale, rank=args.rank, rating_min=1,
                         rating_max=5, **overrides)  # fmt: skip
    label = f"{args.preset} x {args.scale:g}"
    if overrides:
        label += f", {', '.join(overrides)} overridden"
    return PlantedModel.create(**asdict(gen)), label


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
                        "with cupy, on GPU 0: each worker's default device (the workers are "
                        "not spread over the GPUs); the CPU compresses and writes")  # fmt: skip
    parser.add_argument("--dir", default=None, help="where to write the store (default: /tmp)")
    args = parser.parse_args()

    model, label = planted_model(args)
    workdir = tempfile.mkdtemp(prefix="bench-generate-", dir=args.dir)
    url = str(Path(workdir) / "ratings.zarr")
    print(f"device: {describe(args.gpu)}")
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
        ceiling = write_rate(workdir, runs[0]["bytes"])
    finally:
        if client is not None:
            client.close()
            cluster.close()
        shutil.rmtree(workdir, ignore_errors=True)

    first = runs[0]
    total = statistics.median(r["total_s"] for r in runs)
    rows = statistics.median(r["rows_s"] for r in runs)
    ratings = first["ratings"]
    m, n = model.m, model.n
    print(f"shape: {label}: {m:,} x {n:,}, {ratings:,} ratings, rank {model.rank}, "
          f"{first['tiles']}")  # fmt: skip
    print(f"workers: {args.workers or 'threads'}, gpu: {args.gpu}, repeats: {args.repeats}")
    print(f"ratings generated/s (row bands: generate + write): {ratings / rows / 1e6:.2f} M/s")
    print(f"ratings/s, whole store (incl. transposition):      {ratings / total / 1e6:.2f} M/s")
    rate = first["bytes"] / total
    print(f"store build rate: {rate / 1e6:.1f} MB/s ({first['bytes'] / 1e6:.0f} MB on disk in "
          f"{total:.1f} s), {rate / ceiling:.3f} of writing as many bytes to a file there "
          f"({ceiling / 1e6:.0f} MB/s)")  # fmt: skip


if __name__ == "__main__":
    main()
