"""Where iteration 1 goes: reading R from the store into (GPU) memory, and compiling kernels.

    python3 benchmarks/bench_load.py --preset netflix --nnz 99000000 [--gpu]

Times reading the whole matrix in each orientation (what a p = 1, q = 1 plan loads) as
``RatingsStore.read_block`` does (decode + CSR on the host), median of --repeats, with the
page cache warm and then cold (the store's files evicted with posix_fadvise), beside the
disk's own sequential rate (``dd`` of a fresh 1 GiB file, evicted first; "x dd" is the
stored rate over it). Rates are stored bytes (the band files on disk) and raw bytes (12 per
rating) per second. With --gpu also
what a GPU worker does (decoded by the host's threads, which copy each chunk to the GPU;
CSR built on the GPU: ``store -> GPU s``), the
copy of a host-built block into GPU memory (pageable and pinned), and the first ``update``
with an empty CuPy kernel cache (compiling) and with a warm one (a second run's case).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_iteration import get_store
from device import describe


def evict(root: Path) -> None:
    """Drop the files under `root` from the page cache (their pages are clean)."""
    for path in root.rglob("*"):
        if path.is_file():
            evict_file(path)


def evict_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_rate(folder: str, size: int = 1 << 30) -> float:
    """Bytes/s of `dd` reading a fresh file of `size` bytes that is not in the page cache."""
    path = Path(folder) / "dd-probe.bin"
    with path.open("wb") as fh:
        block = np.random.default_rng(0).bytes(1 << 24)
        for _ in range(size >> 24):
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())
    evict_file(path)
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)
    seconds = time.perf_counter() - t0
    path.unlink()
    return size / seconds


def stored_bytes(store, group: str) -> int:
    return sum(f.stat().st_size for f in (Path(store.url) / group).rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiplies the preset's nnz, and m and n by sqrt(scale)")
    parser.add_argument("--m", type=int, default=None)
    parser.add_argument("--n", type=int, default=None)
    parser.add_argument("--nnz", type=int, default=None)
    parser.add_argument("--factors", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--gpu", action="store_true", help="also the GPU copy and compilation")
    parser.add_argument("--data", default="/tmp/cumf-bench")
    args = parser.parse_args()
    if args.preset is None:
        args.m, args.n, args.nnz = args.m or 100_000, args.n or 20_000, args.nnz or 5_000_000
    store = get_store(args)
    print(f"device: {describe(args.gpu)}")
    print(f"store: {store.m:,} x {store.n:,}, {store.nnz:,} ratings; {args.threads} threads")
    dd = disk_rate(args.data)
    print(f"disk (dd, cold): {dd / 1e9:.2f} GB/s")
    be = None
    if args.gpu:
        from cumf_dask.backend import get_backend

        be = get_backend("cupy")
    head = (f"{'orient':<7}{'cache':<6}{'seconds':>9}{'stored GB/s':>12}{'x dd':>6}"
            f"{'raw GB/s':>10}{'M ratings/s':>12}")  # fmt: skip
    if be is not None:
        head += f"{'store -> GPU s':>15}{'GB/s stored':>12}{'copy s':>8}{'pinned s':>9}"
    print(head)
    for orient, group in (("row", "by_row"), ("col", "by_col")):
        stored = stored_bytes(store, group)
        shape = store.shape(orient)
        for cache in ("warm", "cold"):
            times = []
            for _ in range(args.repeats):
                if cache == "cold":
                    evict(Path(store.url) / group)
                t0 = time.perf_counter()
                block = store.read_block(orient, (0, shape[0]), (0, shape[1]), threads=args.threads)
                times.append(time.perf_counter() - t0)
            sec = statistics.median(times)
            rates = (stored / sec / 1e9, 12 * block.nnz / sec / 1e9, block.nnz / sec / 1e6)
            line = (f"{orient:<7}{cache:<6}{sec:>9.3f}{rates[0]:>12.2f}{rates[0] * 1e9 / dd:>6.2f}"
                    f"{rates[1]:>10.2f}")  # fmt: skip
            line += f"{rates[2]:>12.0f}"
            if be is not None and cache == "warm":
                sec_gpu = gpu_load_seconds(be, store, orient, shape, args.threads, args.repeats)
                line += f"{sec_gpu:>15.3f}{stored / sec_gpu / 1e9:>12.2f}"
                line += "".join(f"{t:>8.3f} " for t in gpu_copy_seconds(be, block))
            print(line)
    if be is not None:
        compile_seconds(args.factors)


def gpu_load_seconds(be, store, orient, shape, threads, repeats) -> float:
    """Median seconds from the store to a CSR block in GPU memory, as a GPU worker loads."""
    from cumf_dask.data.assemble import read_bands

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        bands = read_bands(store, orient, (0, shape[0]), (0, shape[1]), "train", threads,
                           be.decode_target())  # fmt: skip
        be.block_from_bands(bands, threads)
        be.xp.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gpu_copy_seconds(be, block) -> tuple[float, float]:
    """(pageable, pinned) seconds to copy the block's arrays into GPU memory."""
    cp = be.xp
    be.block_to_device(block)
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    be.block_to_device(block)
    cp.cuda.Device().synchronize()
    pageable = time.perf_counter() - t0
    arrays = [block.indptr, block.indices, block.values]
    pinned = []
    for a in arrays:
        mem = cp.cuda.alloc_pinned_memory(a.nbytes)
        host = np.frombuffer(mem, a.dtype, a.size)
        host[...] = a
        pinned.append(host)
    t0 = time.perf_counter()
    out = [cp.asarray(h) for h in pinned]
    cp.cuda.Device().synchronize()
    del out
    return pageable, time.perf_counter() - t0


def compile_seconds(f: int) -> None:
    """First update in a fresh process with an empty kernel cache (compiles), then again in
    another process with the disk cache the first one filled (what the next run sees)."""
    code = (
        "import numpy as np, time\n"
        "from cumf_dask.backend import get_backend\n"
        "from cumf_dask.blocks import coo_to_block\n"
        "be = get_backend('cupy'); rng = np.random.default_rng(0)\n"
        "r, c = rng.integers(0, 100, 5000), rng.integers(0, 200, 5000)\n"
        "blk = be.block_to_device(coo_to_block(r, c, np.ones(5000, np.float32), 0, 0, 100, 200))\n"
        f"fixed = be.asarray(rng.random((200, {f}), dtype=np.float32))\n"
        "counts = be.asarray(np.bincount(r, minlength=100))\n"
        "t0 = time.perf_counter(); be.prepare(fixed.shape[1])\n"
        "be.update(blk, fixed, counts, 0.05)\n"
        "be.xp.cuda.Device().synchronize(); print(f'{time.perf_counter() - t0:.2f}')\n"
    )
    cache = tempfile.mkdtemp(prefix="cupy-cache-")
    env = {**os.environ, "CUPY_CACHE_DIR": cache}
    for label in ("empty kernel cache (compiles)", "warm kernel cache (next run)"):
        out = subprocess.run(["python3", "-c", code], env=env, capture_output=True, text=True)
        print(f"first update, f={f}, {label}: {out.stdout.strip() or out.stderr[-300:]} s")


if __name__ == "__main__":
    main()
