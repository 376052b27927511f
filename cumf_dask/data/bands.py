"""Band writing and transposition: the pure functions every store build runs, one band per call.

Dask tasks call them directly (the synthetic generator writes every row band from its own
task, then every column band), and the spilling builder (:mod:`.spill`) calls them in a loop.
They are module-level and pure so tasks pickle small and read well in the dashboard. Every
Zarr chunk belongs to one band and every band is written by one call, so no chunk is ever
written by two tasks; :func:`finish_store` marks the store complete, last. A task that
computes with CuPy (:func:`band_module`) hands its arrays to :func:`write_band` on the GPU:
it orders, counts and converts them there and copies only what is stored to the host,
where the encoding and writing run.
"""

from __future__ import annotations

import math
import shutil
import uuid
from pathlib import Path
from typing import Any, Literal

import numpy as np
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec

from ..compat import import_cupy
from ..devices import has_cuda
from ..errors import IngestError, StoreError
from ..paths import for_zarr, is_url, normalize_url
from .hashing import array_module
from .integrity import band_record, chunk_crcs
from .sampling import Array, bin_counts
from .store import (
    _GROUPS,
    CHUNK,
    FORMAT,
    VERSION,
    RatingsStore,
    band_chunk,
    codecs,
    fill_value,
    index_dtype,
)
from .target import check_target

BandKind = Literal["row", "col", "test"]


def band_module(use_gpu: bool | Literal["auto"]) -> Any:
    """The array module a band task computes with: CuPy when `use_gpu` is True, or "auto"
    and this process sees a GPU; else NumPy."""
    return import_cupy() if use_gpu is True or (use_gpu and has_cuda()) else np


def to_host(x: Any) -> np.ndarray:
    """`x` as a NumPy array: copied from the GPU when it is a CuPy array."""
    return x if isinstance(x, np.ndarray) else x.get()


def init_store(
    url: str, m: int, n: int, tile_rows: int, tile_cols: int, overwrite: bool = False
) -> None:
    """Create an empty store marked incomplete, with its count arrays chunked by tile, and
    the id of this build, which every band and count array written into it records."""
    url = normalize_url(url)
    check_target(url, overwrite)
    if not is_url(url) and Path(url).exists():
        shutil.rmtree(url)
    if m <= 0 or n <= 0:
        raise IngestError(f"{url}: the matrix would be empty ({m} x {n}); there are no ratings")
    group = zarr.open_group(for_zarr(url), mode="w")
    group.update_attributes(
        {
            "format": FORMAT,
            "version": VERSION,
            "complete": False,
            "m": int(m),
            "n": int(n),
            "tile_rows": int(tile_rows),
            "tile_cols": int(tile_cols),
            "n_row_tiles": math.ceil(m / tile_rows),
            "n_col_tiles": math.ceil(n / tile_cols),
            "build": uuid.uuid4().hex,  # which build: a replacement or foreign band is noticed
            "records_build": True,  # every band and count array records it: one without is foreign
        }
    )
    for name, size, tile in (("row_nnz", m, tile_rows), ("col_nnz", n, tile_cols)):
        # a chunk per band (one writer each); a tile taller than the matrix is one band
        group.create_array(
            name, shape=(size,), chunks=(min(tile, size),), dtype="int64", fill_value=-1,
            **codecs(),
        )  # fmt: skip


def _geometry(attrs: dict[str, Any], kind: BandKind) -> tuple[int, int, int, int]:
    """(t_major, t_minor, n_major, n_minor) of a band kind."""
    if kind == "col":
        return attrs["tile_cols"], attrs["tile_rows"], attrs["n"], attrs["m"]
    return attrs["tile_rows"], attrs["tile_cols"], attrs["m"], attrs["n"]


def band_order_key(major: Array, minor: Array, base: int, t_major: int, t_minor: int) -> Array:
    """One int64 per entry of the band whose majors start at `base`, ordered as the band is
    stored, (minor tile, major, minor), and equal exactly for equal (major, minor) pairs: one
    sort of it replaces a three-key lexsort. NumPy or CuPy arrays."""
    minor = minor.astype(np.int64, copy=False)
    return ((minor // t_minor) * t_major + (major - base)) * t_minor + minor % t_minor


def write_band(
    url: str,
    kind: BandKind,
    band: int,
    major: Array,
    minor: Array,
    val: Array,
) -> dict[str, float]:
    """Write one band from global (major, minor, val); returns its summary for finish_store.

    The entries come in the band's storage order, (minor tile, major, minor) with distinct
    pairs (sorted by :func:`band_order_key`), as NumPy or CuPy arrays (the tile pointers,
    counts and stored dtypes are computed where they live). Also writes this band's slice of
    row_nnz (kind "row") or col_nnz (kind "col"): the slice is exactly one chunk of that array.
    """
    url = normalize_url(url)
    group = zarr.open_group(for_zarr(url), mode="r+")
    attrs = dict(group.attrs)
    t_major, t_minor, n_major, n_minor = _geometry(attrs, kind)
    base = band * t_major
    rows_here = min(t_major, n_major - base)
    xp = array_module(val)
    n_tiles = math.ceil(n_minor / t_minor)
    ptr = xp.zeros(n_tiles + 1, xp.int64)
    xp.cumsum(bin_counts(xp, minor // t_minor, n_tiles), out=ptr[1:])
    local = (major - base).astype(xp.int32)
    counts = to_host(bin_counts(xp, local, rows_here)) if kind != "test" else None
    minor, val = minor.astype(index_dtype(n_minor), copy=False), val.astype(xp.float32, copy=False)
    local, minor, val, ptr = (to_host(a) for a in (local, minor, val, ptr))
    sub = group.require_group(f"{_GROUPS[kind]}/{band}")
    size = int(val.size)
    # One shard (one file) per band array, in inner chunks of about four tiles, written whole
    # by this one call; every chunk carries a crc32c, and the fill values are impossible data.
    chunk = band_chunk(size, n_tiles)
    shard = max(chunk, -(-size // chunk) * chunk)  # zarr >= 3.2 refuses an empty shard
    layout = {"shape": (size,), "chunks": (chunk,), "shards": (shard,), **codecs()}
    for name, dtype in (("major", "int32"), ("minor", index_dtype(n_minor)), ("val", "float32")):
        sub.create_array(name, dtype=dtype, fill_value=fill_value(dtype), overwrite=True, **layout)
    sub.create_array(
        "ptr", shape=(n_tiles + 1,), chunks=(n_tiles + 1,), dtype="int64", fill_value=-1,
        overwrite=True, **codecs(),
    )  # fmt: skip
    if size:
        sub["major"][:] = local
        sub["minor"][:] = minor
        sub["val"][:] = val
    sub["ptr"][:] = ptr
    # which band this is, of which build, and each chunk's crc32c: a read finds a band or
    # chunk out of place, or from another store
    sub.update_attributes(band_record(url, f"{_GROUPS[kind]}/{band}", kind, band, size,
                                      attrs.get("build")))  # fmt: skip
    if counts is not None:
        group["row_nnz" if kind == "row" else "col_nnz"][base : base + rows_here] = counts
    finite = val.astype(np.float64)
    return {
        "band": band,
        "nnz": size,
        "sum": float(finite.sum()) if size else 0.0,
        "sumsq": float((finite * finite).sum()) if size else 0.0,
        "min": float(finite.min()) if size else math.inf,
        "max": float(finite.max()) if size else -math.inf,
    }


def transpose_band(
    url: str, band: int, use_gpu: bool | Literal["auto"] = False
) -> dict[str, float]:
    """Build column band `band` from the row bands: tile (a, band) of every row band a.

    `use_gpu` (see :func:`band_module`) copies each tile to the GPU as it is decoded and
    orders and converts the band there; the keys are distinct, so the order is the same
    either way.
    """
    url = normalize_url(url)
    store = RatingsStore(url, dict(zarr.open_group(for_zarr(url), mode="r").attrs))
    xp = band_module(use_gpu)
    t_rows = store.tile_rows
    rows, cols, vals = [xp.zeros(0, xp.int64)], [xp.zeros(0, xp.int64)], [xp.zeros(0, xp.float32)]
    for a in range(store.n_row_tiles):
        loc, col, val = (xp.asarray(x) for x in store.read_band("row", a, (band, band + 1)))
        rows.append(loc.astype(xp.int64) + a * t_rows)
        cols.append(col.astype(xp.int64))
        vals.append(val)
    row, col, val = xp.concatenate(rows), xp.concatenate(cols), xp.concatenate(vals)
    t_cols = store.tile_cols
    order = xp.argsort(band_order_key(col, row, band * t_cols, t_cols, t_rows))
    return write_band(url, "col", band, col[order], row[order], val[order])


def finish_store(
    url: str,
    row_summaries: list[dict[str, float]],
    col_summaries: list[dict[str, float]],
    test_summaries: list[dict[str, float]] | None = None,
    source: dict[str, Any] | None = None,
    row_ids: np.ndarray | None = None,
    col_ids: np.ndarray | None = None,
) -> RatingsStore:
    """Write band totals, stats, id maps and attrs, then mark the store complete (last write)."""
    url = normalize_url(url)
    group = zarr.open_group(for_zarr(url), mode="r+")
    attrs = dict(group.attrs)
    nnz = 0
    for kind, summaries, bands in (
        ("row", row_summaries, attrs["n_row_tiles"]),
        ("col", col_summaries, attrs["n_col_tiles"]),
        ("test", test_summaries or [], attrs["n_row_tiles"] if test_summaries else 0),
    ):
        band_nnz = np.zeros(bands, np.int64)
        for s in summaries:
            band_nnz[int(s["band"])] = int(s["nnz"])
        group.create_array(
            f"{_GROUPS[kind]}/band_nnz", shape=(bands,), chunks=(max(bands, 1),), dtype="int64",
            fill_value=-1, overwrite=True, **codecs(),
        )  # fmt: skip
        if bands:
            group[f"{_GROUPS[kind]}/band_nnz"][:] = band_nnz
        if kind == "row":
            nnz = int(band_nnz.sum())
    if nnz == 0:
        raise IngestError(f"{url}: no training ratings; the input is empty")
    for name in ("row_nnz", "col_nnz"):  # written a chunk per band task: recorded here, once
        group[name].update_attributes({"crc32c": chunk_crcs(f"{url}/{name}"),
                                       "build": attrs.get("build")})  # fmt: skip
    col_total = sum(int(s["nnz"]) for s in col_summaries)
    if col_total != nnz:
        raise StoreError(f"{url}: by_col holds {col_total} ratings, by_row {nnz}: build failed")
    for axis, ids in (("rows", row_ids), ("cols", col_ids)):
        if ids is not None:
            # Every id is possible (0 too), so no fill value can mark a chunk missing: every
            # chunk is written, even one that zarr would skip as all fill (all zeros). Text
            # ids get a crc32c after their compressor too: a flipped bit is an error, never
            # another id
            dtype = str if ids.dtype.kind in "OUST" else ids.dtype
            encoding = {"compressors": [ZstdCodec(), Crc32cCodec()]} if dtype is str else codecs()
            arr = group.create_array(
                f"ids/{axis}", shape=ids.shape, chunks=(max(1, min(CHUNK, ids.size)),),
                dtype=dtype, overwrite=True, config={"write_empty_chunks": True}, **encoding,
            )  # fmt: skip
            arr[:] = ids.astype(object) if dtype is str else ids
    total = sum(s["sum"] for s in row_summaries)
    sumsq = sum(s["sumsq"] for s in row_summaries)
    mean = total / nnz
    stats = {
        "min": min(s["min"] for s in row_summaries),
        "max": max(s["max"] for s in row_summaries),
        "mean": mean,
        "std": math.sqrt(max(sumsq / nnz - mean * mean, 0.0)),
    }
    group.update_attributes(
        {
            "nnz": nnz,
            "nnz_test": sum(int(s["nnz"]) for s in test_summaries or []),
            "stats": stats,
            "source": source or {},
            "has_ids": row_ids is not None or col_ids is not None,
        }
    )
    group.attrs["complete"] = True
    return RatingsStore.open(url)
