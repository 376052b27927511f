"""RatingsStore: the rating matrix R as tiles in a Zarr v3 group, in both orientations.

Layout (format ``cumf-dask-ratings``, version 2)::

    store.zarr/                attrs: format, version, complete, m, n, nnz, nnz_test, tile_rows,
                               tile_cols, n_row_tiles, n_col_tiles, stats, source, has_ids,
                               build (an id per build, recorded by each band and count array)
      row_nnz (m,)  col_nnz (n,)       int64 rating counts per row / column (training set)
      by_row/band_nnz (n_row_tiles,)   int64
      by_row/<a>/{major,minor,val,ptr} row band a: the tiles (a, 0..n_col_tiles-1) in order,
                                       each sorted by (row, col); major = row - a*tile_rows
                                       (int32), minor = global col, ptr = int64 tile offsets
      by_col/band_nnz, by_col/<b>/...  the same with rows and columns swapped
      test/band_nnz, test/<a>/...      the held-out split, banded like by_row
      ids/rows, ids/cols               the user's original ids, when they were not 0..m-1

Each band array is one Zarr shard (one file) of inner chunks of about four tiles
(:func:`band_chunk`). Why bands rather than DESIGN's flat arrays: every Zarr chunk and
shard belongs to exactly one band, so one task per band writes it (no two tasks ever touch
one chunk: the zarr v3 + dask data-loss pitfall cannot happen), bands are written in
parallel by the generator and by the out-of-core builder, and a tile is still one
contiguous slice (``ptr``). A block of any plan is the union of the tiles it overlaps,
filtered to its exact row and column range (:mod:`.assemble`).

Integrity (version 2): every chunk, shard index and small array carries a crc32c (text id
maps too, since this version's builds); chunks are blosc-lz4 with byte shuffle (decodes ~4x
faster than zstd at a similar size on rating data); fill values are impossible data (-1 for
indices and counts, NaN for ratings). Each band group records which band it is, the build
that wrote it (the root's ``build``, made by ``init_store``) and the crc32c of each of its
chunks, so a chunk or band out of place or from another store is caught too
(:mod:`.integrity`). Stores, local or behind a URL, are read by :mod:`.shards`, which
treats a missing or damaged chunk as an error. A store is marked ``complete`` only by its
last write: an interrupted build never opens; its attrs are checked on open.
"""

from __future__ import annotations

import json
import math
import os
import socket
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import numpy as np
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec

from ..blocks import Block, block_on_host, coo_to_block, take_rows
from ..errors import StoreError, StoreUnreachable, warn
from ..paths import for_zarr, is_url, normalize_url
from ..threads import gather
from . import shards
from .integrity import (
    IDS_FIX,
    check_attrs,
    check_band,
    check_build,
    check_count_sums,
    check_none_held_out,
    check_ptr,
    check_unique_ids,
    entry_requests,
    ptr_request,
)

FORMAT = "cumf-dask-ratings"
#: what to do with cumf-dask's other folders where a store was expected
_OTHER_FORMATS = {
    "cumf-dask-model": ": it is a saved model (use it with cumf-dask evaluate or recommend, or "
    "ALS.load)",
    "cumf-dask-checkpoint": ": it is a fit's checkpoint (resume with cumf-dask train --resume, "
    "or fit(resume=True))",
}
VERSION = 2
CHUNK = 1 << 22  # entries per zarr chunk of the id maps: 16 MB of int32/float32
BAND_CHUNK = 1 << 20  # entries per inner chunk of a band's (sharded) arrays, at most
MIN_BAND_CHUNK = 1 << 18  # ... and at least (for bands that hold that many)
PARALLEL_COUNTS = 2 * CHUNK  # longer runs of row_nnz / col_nnz are decoded on every core
Orientation = Literal["row", "col"]
Split = Literal["train", "test"]
_GROUPS = {"row": "by_row", "col": "by_col", "test": "test"}
#: the stores whose root metadata this process has read: one it then cannot read was deleted
#: or is being replaced; one it never could is not on storage this process reads
_ROOTS_READ: set[str] = set()


def _in_worker() -> bool:
    """Whether this thread runs a Dask worker's task (a worker on another host or in
    another folder may not see a store the client does)."""
    from distributed import get_worker

    try:
        get_worker()
    except ValueError:
        return False
    return True


def codecs() -> dict[str, Any]:
    """How every array of a store is encoded: blosc-lz4 with shuffle, then a crc32c."""
    return {"compressors": [BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"), Crc32cCodec()]}


def fill_value(dtype: Any) -> Any:
    """A value no valid entry has: a missing chunk read as it is caught by validation."""
    return float("nan") if np.dtype(dtype).kind == "f" else -1


def band_group(orient: Orientation, split: Split = "train") -> str:
    """The group of an orientation's bands: by_row, by_col, or test (held out, rows only)."""
    if split == "test":
        if orient != "row":
            raise ValueError("the held-out split is stored by rows only")
        return _GROUPS["test"]
    return _GROUPS[orient]


def band_chunk(size: int, n_tiles: int) -> int:
    """Entries per inner chunk of a band of `size` entries over `n_tiles` tiles: the power of
    two at or below four tiles' average, within [MIN_BAND_CHUNK, BAND_CHUNK] (and at most
    the band). The transposition reads one tile of every row band: with 1M-entry chunks and
    40k-entry tiles (a Facebook-shaped store) it decoded about 25 times what it used, and
    took as long as generating the row bands. Whole-band reads (loading) want few chunks:
    with 128k-entry chunks a Facebook-shaped host-tier load took 44% longer than with 1M,
    with 256k as long."""
    per_chunk = 4 * max(1, size // max(1, n_tiles))
    return max(1, min(size, BAND_CHUNK, max(MIN_BAND_CHUNK, 1 << (per_chunk.bit_length() - 1))))


MAX_TILE = 1 << 22  # rows per tile at most by default: a band's per-row arrays stay small


def default_tile(length: int, other: int, nnz: int, target: int = 4_000_000) -> int:
    """Rows per tile so that a band holds about `target` ratings (a power of two in [256,
    MAX_TILE]). The cap keeps a very sparse shape (1e9 rows, 100 ratings) from becoming one
    band whose per-row arrays (counts, degrees, planted factors) are billions long."""
    if nnz <= 0 or length <= 0:
        return max(1, length)
    per_row = nnz / length
    rows = max(256, int(target / max(per_row, 1e-9)))
    tile = min(1 << math.ceil(math.log2(rows)), max(256, 1 << math.ceil(math.log2(length))))
    return min(tile, MAX_TILE)


#: given tiles that make more bands than this, and _MANY_BANDS_RATIO times the default's, warn
_MANY_BANDS = 4096
_MANY_BANDS_RATIO = 16


def check_tiles(m: int, n: int, nnz: int, tile_rows: int, tile_cols: int) -> None:
    """Warn when the tiles cut the ratings into far more bands than the default would: each
    band is a task and several files, so tiny tiles make building and reading slow (1 x 1
    tiles on 20,000 ratings took 525 s and 110,000 files)."""
    rows, cols = default_tile(m, n, nnz), default_tile(n, m, nnz)
    bands = math.ceil(m / tile_rows) + math.ceil(n / tile_cols)
    default = math.ceil(m / rows) + math.ceil(n / cols)
    if bands > _MANY_BANDS and bands > _MANY_BANDS_RATIO * default:
        warn(f"tile_rows={tile_rows:,} and tile_cols={tile_cols:,} cut {m:,} x {n:,} "
             f"({nnz:,} ratings) into {bands:,} bands of {nnz / bands:,.0f} ratings on average; "
             "each band is a task and several files, so building and reading will be slow: "
             f"leave the tiles out (here {rows:,} x {cols:,}, {default:,} bands) or raise them")


def index_dtype(size: int) -> np.dtype:
    """int32 for indices below 2^31, else int64."""
    return np.dtype(np.int32) if size < 2**31 else np.dtype(np.int64)


class RatingsStore:
    """A complete rating store, opened read-only. Cheap to pickle (it keeps only the URL).

    Use :meth:`open` to open one and :class:`~cumf_dask.data.spill.StoreBuilder` (or the
    ingest and generate functions) to make one.
    """

    def __init__(self, url: str, attrs: dict[str, Any]):
        self.url = str(url)
        self.attrs = attrs

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, url: str | Any) -> RatingsStore:
        """Open and validate a store; a missing, partial, damaged or foreign one is a StoreError.
        A local path is made absolute: workers running in other folders read the same store."""
        url = normalize_url(url)
        if not is_url(url):
            url = os.path.abspath(url)
        try:
            group = zarr.open_group(for_zarr(url), mode="r")
        except (FileNotFoundError, zarr.errors.GroupNotFoundError):
            raise StoreError(
                f"{url}: no rating store here (create one with `cumf-dask ingest` or "
                "`cumf-dask generate`)"
            ) from None
        except Exception as exc:
            if is_url(url):
                raise shards.unreachable(url, exc) from None
            raise StoreError(f"{url}: not a readable Zarr v3 group ({exc})") from None
        attrs = dict(group.attrs)
        fmt = attrs.get("format")
        if fmt != FORMAT:
            raise StoreError(
                f"{url}: not a cumf-dask rating store (format {fmt!r}, expected {FORMAT!r})"
                + _OTHER_FORMATS.get(fmt, "")
            )
        if attrs.get("version") != VERSION:
            raise StoreError(
                f"{url}: store format version {attrs.get('version')!r} is not supported by this "
                f"cumf-dask (reads version {VERSION}); rebuild the store"
            )
        if not attrs.get("complete"):
            raise StoreError(
                f"{url}: the store is incomplete (its build was interrupted); rebuild it "
                "(ingest/generate with --overwrite)"
            )
        check_attrs(url, attrs)
        _ROOTS_READ.add(url)
        store = cls(url, attrs)
        store._validate(group)
        store.__dict__["_group"] = group
        return store

    def _validate(self, group: zarr.Group) -> None:
        def member(path: str) -> zarr.Array | None:
            """The array at `path` (None: missing); metadata zarr cannot parse is damage."""
            try:
                return group.get(path)  # type: ignore[return-value]
            except Exception as exc:
                raise StoreError(f"{self.url}: damaged store: the metadata of '{path}' cannot "
                                 f"be read ({exc}); rebuild it") from None  # fmt: skip

        def need(path: str, shape: tuple[int, ...]) -> None:
            array = member(path)
            if array is None:
                raise StoreError(f"{self.url}: damaged store: '{path}' is missing; rebuild it")
            got = array.shape
            if tuple(got) != shape:
                raise StoreError(
                    f"{self.url}: damaged store: '{path}' has shape {got}, expected {shape}"
                )

        need("row_nnz", (self.m,))
        need("col_nnz", (self.n,))
        splits = [("row", "train", self.n_row_tiles, self.nnz),
                  ("col", "train", self.n_col_tiles, self.nnz)]  # fmt: skip
        if self.has_test:
            splits.append(("row", "test", self.n_row_tiles, self.nnz_test))
        for orient, split, bands, nnz in splits:
            name = band_group(orient, split)  # type: ignore[arg-type]
            need(f"{name}/band_nnz", (bands,))
            total = int(self.band_nnz(orient, split).sum())  # type: ignore[arg-type]
            if total != nnz:
                raise StoreError(
                    f"{self.url}: damaged store: {name} holds {total} ratings, attrs say "
                    f"{nnz}; rebuild it"
                )
        if not self.has_test and member("test/band_nnz") is not None:  # every store has one
            check_none_held_out(self, *self.read([("test/band_nnz", 0, None)]))

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "attrs": self.attrs}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.url, self.attrs = state["url"], state["attrs"]

    def __repr__(self) -> str:
        return f"RatingsStore({self.url!r}, m={self.m}, n={self.n}, nnz={self.nnz})"

    @cached_property
    def _group(self) -> zarr.Group:
        return zarr.open_group(for_zarr(self.url), mode="r")

    def read(self, arrays: list[shards.Request], threads: int = 1) -> list[np.ndarray]:
        """Entries [lo, hi) (hi None: all) of arrays given by their paths in the store, as
        (path, lo, hi) or (path, lo, hi, :class:`~.shards.Expect`)."""
        reading = self.start(arrays, threads)
        return [reading.get(k) for k in range(len(reading))]

    def start(
        self, arrays: list[shards.Request], threads: int = 1,
        target: shards.Target = shards.HOST,
    ) -> shards.Reading:
        """Begin reading arrays (as :meth:`read`); ``.get(k)`` waits for array k only.

        The arrays are read by :mod:`.shards` on `threads` threads into `target`'s arrays,
        local or over a URL alike: a missing or damaged chunk, or one another build wrote
        there (an Expect's crc32c), is a StoreError, or one saying the store was replaced
        since it was opened when it was. A local store's build is checked before the
        reads; a remote store's after them (one small GET), since a rebuild in place
        replaces the root's build id before it writes any ratings. A layout this reader
        does not parse (not one cumf-dask writes) is read through zarr, at once, into
        NumPy arrays (any failure is a StoreError; the callers validate the values: a
        missing chunk reads as an impossible fill value).
        """
        remote = is_url(self.url)
        if not remote:
            self.ensure_same_build()
        full = [(os.path.join(self.url, r[0]), *r[1:]) for r in arrays]
        after = self.ensure_same_build if remote else None
        try:
            return shards.start(full, threads, target, self.ensure_same_build, after)
        except shards.Unsupported:
            pass
        read = [self._read_zarr(*r) for r in arrays]
        self.ensure_same_build()
        return shards.Reading.done(read)

    def _read_zarr(
        self, path: str, lo: int, hi: int | None, expect: shards.Expect | None = None
    ) -> np.ndarray:
        """Entries [lo, hi) of an array read through zarr; any failure is one StoreError."""
        try:
            arr = self._group[path]
            size = arr.shape[0]
            stop = size if hi is None else hi
            if expect is not None and expect.size is not None and size != expect.size:
                raise self.damaged(f"'{path}' holds {size} entries, not the {expect.size} its "
                                   "band's pointer and band_nnz say")  # fmt: skip
            if not 0 <= lo <= stop <= size:
                raise self.damaged(f"entries [{lo}, {stop}) asked of '{path}', of {size}")
            return np.asarray(arr[lo:stop])
        except StoreError:
            raise
        except KeyError:
            problem = f"'{path}' is missing"
        except Exception as exc:
            problem = f"'{path}' cannot be read ({exc})"
        raise self.damaged(problem)  # not in the handler: see ensure_same_build

    def damaged(self, what: str, fix: str = "rebuild it") -> StoreError:
        """The error for damage a read found (`what`); but for a store rebuilt since it was
        opened, the replacement is the cause, and that error is raised instead."""
        self.ensure_same_build()
        return StoreError(f"{self.url}: damaged store: {what}; {fix}")

    def ensure_same_build(self) -> None:
        """A store replaced since it was opened (``--overwrite``) is an error: reading on
        would mix two stores' ratings. Its root metadata is read afresh (a small file, or
        one GET): a process that never could read it is told where the store must be.

        Raised outside any exception handler, as the reads' errors are: a worker's error
        goes to the client pickled with its context, and zarr's errors do not unpickle (the
        client would get a bare Exception)."""
        build, readable = None, False
        try:
            meta = shards.whole(os.path.join(self.url, "zarr.json"))
            build, readable = (json.loads(meta).get("attributes") or {}).get("build"), True
        except StoreUnreachable:  # a URL out of reach: that, not a store gone
            raise
        except (OSError, ValueError, AttributeError):  # gone, or cut short
            pass
        if not readable and self.url not in _ROOTS_READ and _in_worker():
            raise StoreError(
                f"{self.url}: this worker (host {socket.gethostname()}, folder {os.getcwd()}) "
                f"cannot read the store's metadata ({self.url}/zarr.json): a store must be on "
                "storage every worker reads at the same path (a shared or mounted folder, or "
                "an object-store URL), and stay there while the fit runs"
            )
        if not readable:
            raise StoreError(f"{self.url}: the store's metadata is gone or unreadable since "
                             "it was opened (deleted or being replaced?)")  # fmt: skip
        _ROOTS_READ.add(self.url)
        if build != self.attrs.get("build"):
            raise StoreError(f"{self.url}: the store was replaced (rebuilt with --overwrite?) "
                             "since it was opened; open it again and start over")  # fmt: skip

    # ------------------------------------------------------------------ metadata
    @property
    def m(self) -> int:
        return int(self.attrs["m"])

    @property
    def n(self) -> int:
        return int(self.attrs["n"])

    @property
    def nnz(self) -> int:
        return int(self.attrs["nnz"])

    @property
    def nnz_test(self) -> int:
        return int(self.attrs.get("nnz_test", 0))

    @property
    def tile_rows(self) -> int:
        return int(self.attrs["tile_rows"])

    @property
    def tile_cols(self) -> int:
        return int(self.attrs["tile_cols"])

    @property
    def n_row_tiles(self) -> int:
        return int(self.attrs["n_row_tiles"])

    @property
    def n_col_tiles(self) -> int:
        return int(self.attrs["n_col_tiles"])

    @property
    def stats(self) -> dict[str, float]:
        return dict(self.attrs.get("stats", {}))

    @property
    def source(self) -> dict[str, Any]:
        return dict(self.attrs.get("source", {}))

    def shape(self, orient: Orientation = "row") -> tuple[int, int]:
        return (self.m, self.n) if orient == "row" else (self.n, self.m)

    def tile_size(self, orient: Orientation = "row") -> tuple[int, int]:
        """(major, minor) tile sizes in this orientation."""
        t = (self.tile_rows, self.tile_cols)
        return t if orient == "row" else (t[1], t[0])

    def counts(self, orient: Orientation = "row", rows: tuple[int, int] | None = None):
        """Training ratings per row ("row") or per column ("col") of [lo, hi), int64.

        Read from band boundaries (a count chunk is one band: no more is decoded), so each
        band's counts are checked to sum to its band_nnz, and each chunk against its
        recorded crc32c: count chunks swapped between bands are an error."""
        size, tile = self.shape(orient)[0], self.tile_size(orient)[0]
        lo, hi = rows if rows is not None else (0, size)
        a0, a1 = lo // tile, max(lo // tile, -(-hi // tile))
        start, stop = a0 * tile, max(min(a1 * tile, size), hi)  # beyond the end: an error
        name = "row_nnz" if orient == "row" else "col_nnz"
        threads = (os.cpu_count() or 1) if stop - start > PARALLEL_COUNTS else 1
        record = self._count_record(name)
        check_build(self, name, record)
        expect = shards.Expect(crcs=record.get("crc32c"))
        (counts,) = self.read([(name, start, stop, expect)], threads)
        if counts.size and counts.min() < 0:
            raise self.damaged(f"'{name}' has missing entries")
        check_count_sums(self, name, counts, tile, self.band_nnz(orient)[a0:a1])
        return counts if (start, stop) == (lo, hi) else counts[lo - start : hi - start].copy()

    def _count_record(self, name: str) -> dict[str, Any]:
        """What the build recorded in a count array's attrs: its id, and the crc32c of each
        chunk. Missing metadata of a store replaced meanwhile says so."""
        try:
            return shards.layout(os.path.join(self.url, name)).attributes
        except StoreError:
            self.ensure_same_build()
            raise
        except Exception as exc:
            problem = f"the metadata of '{name}' cannot be read ({exc})"
        raise self.damaged(problem)  # not in the handler: see ensure_same_build

    def band_nnz(self, orient: Orientation = "row", split: Split = "train") -> np.ndarray:
        """Ratings per band of an orientation (or of the held-out split), read once per
        opened store (read-only)."""
        cache = self.__dict__.setdefault("_band_nnz", {})
        if (orient, split) not in cache:
            cache[orient, split] = self._read_band_nnz(orient, split)
        return cache[orient, split]

    def _read_band_nnz(self, orient: Orientation, split: Split) -> np.ndarray:
        path = f"{band_group(orient, split)}/band_nnz"
        if split == "test" and not self.has_test:
            return np.zeros(0, np.int64)
        (counts,) = self.read([(path, 0, None)])
        if counts.size and counts.min() < 0:
            raise self.damaged(f"'{path}' has missing entries")
        counts.flags.writeable = False
        return counts

    @property
    def has_test(self) -> bool:
        return self.nnz_test > 0

    def ids(self, axis: Literal["rows", "cols"]) -> np.ndarray | None:
        """The original ids of rows or columns (None when they are 0..m-1 / 0..n-1). Every
        chunk must be there (a missing one would read as its fill value, a possible id),
        every one must decode, and no id may repeat; else one StoreError."""
        path = f"ids/{axis}"
        try:
            values = self._read_ids(path, self.m if axis == "rows" else self.n)
        except StoreError:
            raise
        except Exception as exc:
            raise self.damaged(f"'{path}' cannot be read ({exc})", IDS_FIX) from None
        if values is not None:
            check_unique_ids(self, path, values)
        return values

    def _read_ids(self, path: str, size: int) -> np.ndarray | None:
        group = self._group
        if path not in group:
            return None
        ids = group[path]
        if ids.shape != (size,) or ids.nchunks_initialized < ids.nchunks:
            raise self.damaged(f"'{path}' is not the {size} ids it should be (a chunk is "
                               "missing?)")  # fmt: skip
        if ids.dtype.kind in "iu":
            (values,) = self.read([(path, 0, None)])
            return values
        return np.asarray(ids[:])

    def size_on_disk(self) -> int | None:
        """Bytes under a local store's folder; None for a remote URL."""
        root = Path(self.url)
        if not root.is_dir():
            return None
        return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())

    # ------------------------------------------------------------------ reading
    def read_band(
        self,
        orient: Orientation,
        band: int,
        tiles: tuple[int, int] | None = None,
        split: Split = "train",
        threads: int = 1,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(major_local, minor, val) of one band, optionally only its tiles [t0, t1), checked:
        the band is the one asked for, its pointer ends at its band_nnz, each chunk is the
        one built there, local rows and global columns in range, ratings finite."""
        path, nnz, crcs = self.checked_band(orient, split, band)
        (ptr,) = self.read([ptr_request(path, crcs)])
        n_tiles = self.n_col_tiles if orient == "row" else self.n_row_tiles
        check_ptr(self, path, ptr, n_tiles, nnz, f"{orient} band {band} ({split})")
        t0, t1 = tiles if tiles is not None else (0, n_tiles)
        lo, hi = int(ptr[t0]), int(ptr[t1])
        major, minor, val = self.read(entry_requests(path, lo, hi, nnz, crcs), threads)
        self._check_band(path, band, orient, major, minor, val)
        return major, minor, val

    def checked_band(
        self, orient: Orientation, split: Split, band: int
    ) -> tuple[str, int | None, dict[str, Any]]:
        """One band's group path, checked to be the band asked for; its size (None while
        the store is built) and the crc32c its build recorded per array ({}: none)."""
        path = f"{band_group(orient, split)}/{band}"
        nnz, crcs = check_band(self, path, orient, split, band, self.band_size(orient, split, band))
        return path, nnz, crcs

    def checked_bands(
        self, orient: Orientation, split: Split, bands: list[int], threads: int = 1
    ) -> list[tuple[str, int | None, dict[str, Any]]]:
        """:meth:`checked_band` of each band; a remote store's on `threads` threads at once
        (a round trip each)."""
        if bands and self.attrs.get("complete"):
            self.band_nnz(orient, split)  # read once, not by each thread
        return gather(lambda band: self.checked_band(orient, split, band), bands,
                      threads if is_url(self.url) else 1, use="band-checks")  # fmt: skip

    def band_size(self, orient: Orientation, split: Split, band: int) -> int | None:
        """Ratings in one band (its band_nnz; None while the store is being built, before
        band_nnz is written); a band the store does not have is an error."""
        if not self.attrs.get("complete"):  # the transposition reads the row bands
            return None
        totals = self.band_nnz(orient, split)
        if not 0 <= band < totals.size:
            raise StoreError(f"{self.url}: {band_group(orient, split)} has no band {band} "
                             f"(it has {totals.size})")  # fmt: skip
        return int(totals[band])

    def _check_band(self, path: str, band: int, orient: Orientation, major, minor, val) -> None:
        if not val.size:
            return
        t_major = self.tile_size(orient)[0]
        n_major, n_minor = self.shape(orient)
        rows_here = min(t_major, n_major - band * t_major)
        bad = (
            major.min() < 0 or major.max() >= rows_here or minor.min() < 0
            or minor.max() >= n_minor or not np.isfinite(val).all()
        )  # fmt: skip
        if bad:
            raise self.damaged(f"band '{path}' holds entries out of range or not finite (a "
                               "missing chunk?)", "rebuild the store")  # fmt: skip

    def read_coo(
        self,
        orient: Orientation,
        major: tuple[int, int] | None = None,
        minor: tuple[int, int] | None = None,
        split: Split = "train",
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Global (major, minor, val) of the ratings in the given ranges, in band order.

        Reads only the tiles that overlap the ranges; in the "row" orientation major = row,
        in "col" major = column. ``split="test"``: the held-out ratings (rows only).
        """
        n_major, n_minor = self.shape(orient)
        t_major, t_minor = self.tile_size(orient)
        r0, r1 = major if major is not None else (0, n_major)
        c0, c1 = minor if minor is not None else (0, n_minor)
        out_r, out_c, out_v = [], [], []
        for band in range(r0 // t_major, min(-(-r1 // t_major), math.ceil(n_major / t_major))):
            tiles = (c0 // t_minor, max(c0 // t_minor, -(-c1 // t_minor)))
            loc, col, val = self.read_band(orient, band, tiles, split)
            row = loc.astype(np.int64) + band * t_major
            keep = (row >= r0) & (row < r1) & (col >= c0) & (col < c1)
            if not keep.all():
                row, col, val = row[keep], col[keep], val[keep]
            out_r.append(row)
            out_c.append(col)
            out_v.append(val)
        if not out_r:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
        return np.concatenate(out_r), np.concatenate(out_c), np.concatenate(out_v)

    def read_block(
        self,
        orient: Orientation,
        rows: tuple[int, int],
        cols: tuple[int, int],
        split: Split = "train",
        threads: int = 1,
    ) -> Block:
        """The block of R (or R^T for "col") with the given row and column ranges, as CSR,
        read and assembled on `threads` threads (see :mod:`.assemble`)."""
        from .assemble import read_bands

        return block_on_host(read_bands(self, orient, rows, cols, split, threads), threads)

    def rows_block(self, rows: np.ndarray) -> Block:
        """The training ratings of arbitrary rows (in the given order) over all columns.

        Each row band that holds a requested row is read once.
        """
        rows = np.asarray(rows, np.int64)
        if rows.size == 0:
            return coo_to_block(rows, rows, np.zeros(0, np.float32), 0, 0, 0, self.n)
        t_rows = self.tile_rows
        spans = []
        for band in np.unique(rows // t_rows):
            loc, c, v = self.read_band("row", int(band))
            r = loc.astype(np.int64) + int(band) * t_rows
            spans.append((r, c, v))
        r = np.concatenate([s[0] for s in spans])
        c = np.concatenate([s[1] for s in spans])
        v = np.concatenate([s[2] for s in spans])
        uniq, inverse = np.unique(rows, return_inverse=True)
        keep = np.isin(r, uniq)
        block = coo_to_block(
            np.searchsorted(uniq, r[keep]), c[keep], v[keep], 0, 0, uniq.size, self.n
        )
        return take_rows(block, inverse)

    def iter_bands(
        self, orient: Orientation, split: Split = "train"
    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Global (major, minor, val) band by band: bounded memory over the whole store."""
        t_major = self.tile_size(orient)[0]
        for band in range(len(self.band_nnz(orient, split))):
            loc, col, val = self.read_band(orient, band, split=split)
            yield loc.astype(np.int64) + band * t_major, col.astype(np.int64), val
