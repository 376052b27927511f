"""Writing rating stores: band writers (one task per band), transposition, and a spilling builder.

Two ways in:

* :class:`StoreBuilder` takes COO chunks of any size (``add``), spills them to per-band files
  on local disk, and ``finalize`` builds the bands one at a time: memory stays bounded by one
  band, so inputs far larger than memory work. Ingestion and in-memory arrays use it.
* The band functions (:func:`init_store`, :func:`write_band`, :func:`transpose_band`,
  :func:`finish_store`) are pure and module-level so Dask tasks can call them: the synthetic
  generator writes every row band from its own task, then every column band.

Every Zarr chunk belongs to one band and every band is written by one call, so no chunk is
ever written by two tasks.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import zarr

from ..config import DuplicatePolicy
from ..errors import IngestError, StoreError
from ..paths import normalize_url
from .store import (
    _GROUPS,
    CHUNK,
    FORMAT,
    TILE_CHUNK,
    VERSION,
    RatingsStore,
    default_tile,
    index_dtype,
)

BandKind = Literal["row", "col", "test"]


# ----------------------------------------------------------------------------- split


def split_mask(row: np.ndarray, col: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """True for ratings held out for testing: a hash of (row, col, seed) below `fraction`.

    Depends only on the (dense) pair and the seed, not on chunking, so the same input splits
    the same way however it is read; repeated pairs fall on the same side. With mapped ids
    the dense indices follow the order ids first appear, so reordering the input can move
    pairs between sides.
    """
    if fraction <= 0:
        return np.zeros(row.shape, bool)
    with np.errstate(over="ignore"):
        z = row.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z ^= col.astype(np.uint64) + np.uint64(0x632BE59BD9B4E019) + np.uint64(seed & (2**63 - 1))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53) < fraction


# ----------------------------------------------------------------------------- band functions


def check_target(url: str, overwrite: bool) -> None:
    """Refuse to replace anything but a cumf-dask store, and a store only with `overwrite`.

    Nothing there, or an empty folder, is fine; a file, a foreign folder or a foreign Zarr
    group is never deleted.
    """
    url = normalize_url(url)
    if "://" in url:
        try:
            fmt = zarr.open_group(url, mode="r").attrs.get("format")
        except Exception:
            return
    else:
        path = Path(url)
        if not path.exists() or (path.is_dir() and not any(path.iterdir())):
            return
        fmt = _local_format(path)
    if fmt != FORMAT:
        raise StoreError(
            f"{url}: exists and is not a cumf-dask rating store; refusing to replace it "
            "(choose another output path)"
        )
    if not overwrite:
        raise StoreError(f"{url}: already exists; pass overwrite=True (--overwrite) to replace")


def _local_format(path: Path) -> str | None:
    """The `format` attribute of a local Zarr v3 group folder, or None."""
    meta = path / "zarr.json"
    if not (path.is_dir() and meta.is_file()):
        return None
    try:
        return json.loads(meta.read_text()).get("attributes", {}).get("format")
    except (OSError, ValueError):
        return None


def init_store(
    url: str, m: int, n: int, tile_rows: int, tile_cols: int, overwrite: bool = False
) -> None:
    """Create an empty store marked incomplete, with its count arrays chunked by tile."""
    url = normalize_url(url)
    check_target(url, overwrite)
    if "://" not in url and Path(url).exists():
        shutil.rmtree(url)
    if m <= 0 or n <= 0:
        raise IngestError(f"{url}: the matrix would be empty ({m} x {n}); there are no ratings")
    group = zarr.open_group(url, mode="w")
    group.attrs.update(
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
        }
    )
    group.create_array("row_nnz", shape=(m,), chunks=(tile_rows,), dtype="int64", fill_value=0)
    group.create_array("col_nnz", shape=(n,), chunks=(tile_cols,), dtype="int64", fill_value=0)


def _geometry(attrs: dict[str, Any], kind: BandKind) -> tuple[int, int, int, int]:
    """(t_major, t_minor, n_major, n_minor) of a band kind."""
    if kind == "col":
        return attrs["tile_cols"], attrs["tile_rows"], attrs["n"], attrs["m"]
    return attrs["tile_rows"], attrs["tile_cols"], attrs["m"], attrs["n"]


def write_band(
    url: str,
    kind: BandKind,
    band: int,
    major: np.ndarray,
    minor: np.ndarray,
    val: np.ndarray,
    sorted_: bool = False,
) -> dict[str, float]:
    """Write one band from global (major, minor, val); returns its summary for finish_store.

    Sorts by (minor tile, major, minor) unless `sorted_`. Also writes this band's slice of
    row_nnz (kind "row") or col_nnz (kind "col"): the slice is exactly one chunk of that array.
    """
    url = normalize_url(url)
    group = zarr.open_group(url, mode="r+")
    attrs = dict(group.attrs)
    t_major, t_minor, n_major, n_minor = _geometry(attrs, kind)
    base = band * t_major
    rows_here = min(t_major, n_major - base)
    local = (major - base).astype(np.int32)
    minor_tile = minor // t_minor
    if not sorted_ and val.size:
        order = np.lexsort((minor, local, minor_tile))
        local, minor, val, minor_tile = local[order], minor[order], val[order], minor_tile[order]
    n_tiles = math.ceil(n_minor / t_minor)
    ptr = np.zeros(n_tiles + 1, np.int64)
    np.cumsum(np.bincount(minor_tile, minlength=n_tiles), out=ptr[1:])
    sub = group.require_group(f"{_GROUPS[kind]}/{band}")
    size = int(val.size)
    # One shard (one file) per band array, in small inner chunks: a tile read decodes
    # little more than the tile, and the band is still written whole by this one call.
    chunk = max(1, min(TILE_CHUNK, size))
    shard = max(chunk, -(-size // chunk) * chunk)  # zarr >= 3.2 refuses an empty shard
    layout = {"shape": (size,), "chunks": (chunk,), "shards": (shard,)}
    sub.create_array("major", dtype="int32", overwrite=True, **layout)
    sub.create_array("minor", dtype=index_dtype(n_minor), overwrite=True, **layout)
    sub.create_array("val", dtype="float32", overwrite=True, **layout)
    sub.create_array(
        "ptr", shape=(n_tiles + 1,), chunks=(n_tiles + 1,), dtype="int64", overwrite=True
    )
    if size:
        sub["major"][:] = local
        sub["minor"][:] = minor.astype(index_dtype(n_minor))
        sub["val"][:] = val.astype(np.float32)
    sub["ptr"][:] = ptr
    if kind != "test":
        counts = np.bincount(local, minlength=rows_here)
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


def transpose_band(url: str, band: int) -> dict[str, float]:
    """Build column band `band` from the row bands: tile (a, band) of every row band a."""
    url = normalize_url(url)
    store = RatingsStore(url, dict(zarr.open_group(url, mode="r").attrs))
    t_rows = store.tile_rows
    rows, cols, vals = [], [], []
    for a in range(store.n_row_tiles):
        loc, col, val = store.read_band("row", a, (band, band + 1))
        rows.append(loc.astype(np.int64) + a * t_rows)
        cols.append(col.astype(np.int64))
        vals.append(val)
    row = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    col = np.concatenate(cols) if cols else np.zeros(0, np.int64)
    val = np.concatenate(vals) if vals else np.zeros(0, np.float32)
    # by_col band order: (row tile, col, row), sorted once on one combined int64 key
    t_cols = store.tile_cols
    key = ((row // t_rows) * t_cols + (col - band * t_cols)) * t_rows + row % t_rows
    order = np.argsort(key)
    return write_band(url, "col", band, col[order], row[order], val[order], sorted_=True)


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
    group = zarr.open_group(url, mode="r+")
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
            f"{_GROUPS[kind]}/band_nnz",
            shape=(bands,),
            chunks=(max(bands, 1),),
            dtype="int64",
            overwrite=True,
        )
        if bands:
            group[f"{_GROUPS[kind]}/band_nnz"][:] = band_nnz
        if kind == "row":
            nnz = int(band_nnz.sum())
    if nnz == 0:
        raise IngestError(f"{url}: no training ratings; the input is empty")
    col_total = sum(int(s["nnz"]) for s in col_summaries)
    if col_total != nnz:
        raise StoreError(f"{url}: by_col holds {col_total} ratings, by_row {nnz}: build failed")
    for axis, ids in (("rows", row_ids), ("cols", col_ids)):
        if ids is not None:
            dtype = str if ids.dtype.kind in "OUS" else ids.dtype
            arr = group.create_array(
                f"ids/{axis}",
                shape=ids.shape,
                chunks=(max(1, min(CHUNK, ids.size)),),
                dtype=dtype,
                overwrite=True,
            )
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
    group.attrs.update(
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


# ----------------------------------------------------------------------------- duplicates


def resolve_duplicates(
    row: np.ndarray,
    col: np.ndarray,
    val: np.ndarray,
    seq: np.ndarray,
    policy: DuplicatePolicy,
    describe: Callable[[int, int, int, int], str] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Collapse repeated (row, col) pairs: 'error' raises, 'last' keeps the latest, 'mean' averages.

    `seq` orders the records (input line or record number); `describe(row, col, seq1, seq2)`
    words the error for the user (original ids, file and lines).
    """
    if row.size < 2:
        return row, col, val
    order = np.lexsort((seq, col, row))
    row, col, val, seq = row[order], col[order], val[order], seq[order]
    same = (row[1:] == row[:-1]) & (col[1:] == col[:-1])
    if not same.any():
        return row, col, val
    if policy == "error":
        k = int(np.argmax(same))
        text = (
            describe(int(row[k]), int(col[k]), int(seq[k]), int(seq[k + 1]))
            if describe
            else f"row {row[k]}, column {col[k]} (records {seq[k]} and {seq[k + 1]})"
        )
        raise IngestError(
            f"duplicate rating for {text}; choose a duplicates policy: 'last' or 'mean' "
            "(--duplicates / ingest.duplicates)"
        )
    start = np.concatenate(([True], ~same))
    first = np.flatnonzero(start)
    if policy == "last":
        last = np.concatenate((first[1:] - 1, [row.size - 1]))
        return row[last], col[last], val[last]
    sums = np.add.reduceat(val.astype(np.float64), first)
    counts = np.diff(np.concatenate((first, [row.size])))
    return row[first], col[first], (sums / counts).astype(np.float32)


# ----------------------------------------------------------------------------- spilling builder


class StoreBuilder:
    """Build a store from COO chunks of any total size with bounded memory.

    ``add`` validates a chunk, splits off the test share, and appends it to per-band spill
    files; ``finalize`` resolves duplicates and writes one band at a time. Row and column
    counts (m, n) may grow while adding (ids mapped on the fly); rows per tile are then given
    or 65,536, and columns per tile are chosen from the final shape.
    """

    def __init__(
        self,
        url: str,
        m: int | None = None,
        n: int | None = None,
        tile_rows: int | None = None,
        tile_cols: int | None = None,
        test_fraction: float = 0.0,
        split_seed: int = 0,
        duplicates: DuplicatePolicy = "error",
        overwrite: bool = False,
        expected_nnz: int | None = None,
        spill_dir: str | None = None,
    ):
        if not 0 <= test_fraction < 1:
            raise IngestError(f"test_fraction must be in [0, 1), got {test_fraction}")
        if duplicates not in ("error", "last", "mean"):
            raise IngestError(f"duplicates must be 'error', 'last' or 'mean', got {duplicates!r}")
        url = normalize_url(url)
        check_target(url, overwrite)
        for name, value in (("tile_rows", tile_rows), ("tile_cols", tile_cols)):
            if value is not None and value < 1:
                raise IngestError(f"{name} must be a positive integer, got {value}")
        self.url = url
        self.m, self.n = m, n
        if tile_rows is None:
            tile_rows = default_tile(m, n, expected_nnz) if m and n and expected_nnz else 65536
        self.tile_rows = int(tile_rows)
        # Spill files are cut by row band only, so the column tiles can wait for the shape.
        self.tile_cols = tile_cols
        self.test_fraction, self.split_seed = float(test_fraction), int(split_seed)
        self.duplicates: DuplicatePolicy = duplicates
        self.overwrite = overwrite
        self._spill = Path(tempfile.mkdtemp(prefix="cumf-spill-", dir=spill_dir))
        self._records = 0
        self._max_row = -1
        self._max_col = -1
        self._bands: dict[tuple[str, int], int] = {}

    def add(
        self, row: np.ndarray, col: np.ndarray, val: np.ndarray, seq: np.ndarray | None = None
    ) -> None:
        """Append ratings (dense 0-based indices). `seq` numbers the records (default: running)."""
        row = np.asarray(row, np.int64)
        col = np.asarray(col, np.int64)
        val = np.asarray(val, np.float32)
        if not (row.shape == col.shape == val.shape) or row.ndim != 1:
            raise IngestError("rows, columns and ratings must be 1-D arrays of the same length")
        if seq is None:
            seq = np.arange(self._records, self._records + row.size, dtype=np.int64)
        self._records += row.size
        if row.size == 0:
            return
        bad = ~np.isfinite(val)
        if bad.any():
            k = int(np.argmax(bad))
            raise IngestError(f"rating at record {int(seq[k])} is {val[k]}: ratings must be finite")
        for name, idx, limit in (("row", row, self.m), ("column", col, self.n)):
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or (limit is not None and hi >= limit):
                k = int(np.argmax((idx < 0) | (idx >= (limit if limit is not None else 2**62))))
                raise IngestError(
                    f"{name} index {int(idx[k])} at record {int(seq[k])} is out of range "
                    f"[0, {limit if limit is not None else 'inf'})"
                )
        self._max_row = max(self._max_row, int(row.max()))
        self._max_col = max(self._max_col, int(col.max()))
        test = split_mask(row, col, self.test_fraction, self.split_seed)
        for kind, keep in (("row", ~test), ("test", test)):
            if keep.any():
                self._spill_chunk(kind, row[keep], col[keep], val[keep], seq[keep])

    def _spill_chunk(self, kind: str, row, col, val, seq) -> None:
        band = row // self.tile_rows
        order = np.argsort(band, kind="stable")
        band, row, col, val, seq = band[order], row[order], col[order], val[order], seq[order]
        cuts = np.flatnonzero(np.diff(band)) + 1
        for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, band.size], strict=True):
            b = int(band[lo])
            for name, arr in (("row", row), ("col", col), ("val", val), ("seq", seq)):
                with open(self._spill / f"{kind}-{b}.{name}", "ab") as fh:
                    arr[lo:hi].tofile(fh)
            self._bands[(kind, b)] = self._bands.get((kind, b), 0) + int(hi - lo)

    def _load(self, kind: str, band: int):
        def read(name, dtype):
            return np.fromfile(self._spill / f"{kind}-{band}.{name}", dtype=dtype)

        return (
            read("row", np.int64),
            read("col", np.int64),
            read("val", np.float32),
            read("seq", np.int64),
        )

    def finalize(
        self,
        source: dict[str, Any] | None = None,
        row_ids: np.ndarray | None = None,
        col_ids: np.ndarray | None = None,
        describe: Callable[[int, int, int, int], str] | None = None,
        progress: Callable[[str, int, int], None] | None = None,
    ) -> RatingsStore:
        """Write every band, then the column bands, then mark the store complete.

        On any error the partial store is removed, so nothing incomplete is left behind.
        """
        local = "://" not in self.url
        work = work_url(self.url)
        created = False
        try:
            if self._records == 0 or not self._bands:
                raise IngestError("no ratings: the input is empty")
            m = self.m if self.m is not None else self._max_row + 1
            n = self.n if self.n is not None else self._max_col + 1
            if row_ids is not None:
                m = len(row_ids)
            if col_ids is not None:
                n = len(col_ids)
            created = True  # from here on a failure removes what was written
            tile_cols = self.tile_cols or default_tile(n, m, self._records)
            init_store(work, m, n, self.tile_rows, tile_cols, overwrite=local or self.overwrite)
            n_row_tiles = math.ceil(m / self.tile_rows)
            n_col_tiles = math.ceil(n / tile_cols)
            summaries: dict[str, list[dict[str, float]]] = {"row": [], "test": [], "col": []}
            has_test = any(k == "test" for k, _ in self._bands)
            steps = (2 if has_test else 1) * n_row_tiles + n_col_tiles
            done = 0
            for kind in ("row", "test") if has_test else ("row",):
                for band in range(n_row_tiles):
                    if (kind, band) in self._bands:
                        r, c, v, s = self._load(kind, band)
                        r, c, v = resolve_duplicates(r, c, v, s, self.duplicates, describe)
                    else:
                        r = c = np.zeros(0, np.int64)
                        v = np.zeros(0, np.float32)
                    summaries[kind].append(write_band(work, kind, band, r, c, v))
                    done += 1
                    if progress:
                        progress("bands", done, steps)
            for band in range(n_col_tiles):
                summaries["col"].append(transpose_band(work, band))
                done += 1
                if progress:
                    progress("bands", done, steps)
            finish_store(
                work,
                summaries["row"],
                summaries["col"],
                summaries["test"] or None,
                source=source,
                row_ids=row_ids,
                col_ids=col_ids,
            )
            return publish(work, self.url)
        except BaseException:
            if created and local:
                shutil.rmtree(work, ignore_errors=True)
            raise
        finally:
            shutil.rmtree(self._spill, ignore_errors=True)

    def abort(self) -> None:
        """Drop the spill files (the store itself was not created yet)."""
        shutil.rmtree(self._spill, ignore_errors=True)


def work_url(url: str) -> str:
    """Where a build writes before it is complete: beside a local target, in place for URLs."""
    return f"{url}.partial" if "://" not in url else url


def publish(work: str, url: str) -> RatingsStore:
    """Move a finished local build into place (the old store goes only now) and open it."""
    if work != url:
        _replace_dir(work, url)
    return RatingsStore.open(url)


def _replace_dir(src: str, dst: str) -> None:
    """Move a finished store into place; the old one is removed only once the new one is whole."""
    target = Path(dst)
    if target.exists():
        trash = Path(f"{dst}.old")
        shutil.rmtree(trash, ignore_errors=True)
        target.rename(trash)
        Path(src).rename(target)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        Path(src).rename(target)


def build_store(
    url: str,
    row: np.ndarray,
    col: np.ndarray,
    val: np.ndarray,
    shape: tuple[int, int] | None = None,
    **kwargs: Any,
) -> RatingsStore:
    """Build a store from in-memory COO arrays (0-based indices). kwargs go to StoreBuilder."""
    m, n = shape if shape is not None else (None, None)
    source = kwargs.pop("source", {"kind": "arrays"})
    row_ids = kwargs.pop("row_ids", None)
    col_ids = kwargs.pop("col_ids", None)
    builder = StoreBuilder(url, m=m, n=n, expected_nnz=len(val), **kwargs)
    try:
        builder.add(row, col, val)
    except BaseException:
        builder.abort()
        raise
    return builder.finalize(source=source, row_ids=row_ids, col_ids=col_ids)
