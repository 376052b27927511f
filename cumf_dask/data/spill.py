"""The spilling builder: a store from COO chunks of any total size, in bounded memory.

:class:`StoreBuilder` is the one way in for ingestion (files, arrays, DataFrames, SciPy) and
for in-memory arrays (:func:`build_store`, used by ``ALS.fit`` on arrays). It validates each
chunk, splits off the test share (:func:`~.hashing.split_mask`), and spills it to local
disk, SPILL_BUFFER bytes at a time, each spill one file sorted by spill band; at
``finalize`` it resolves duplicates (:mod:`.duplicates`) and writes the bands with the band
functions of :mod:`.bands`, one band per thread (:mod:`.parallel`; one sort per band puts it
in storage order and brings repeated pairs together): memory stays bounded by one band per
thread, so inputs far larger than memory work. With ``split="users"`` the test share is
taken per row at ``finalize`` instead (:func:`~.hashing.user_split_mask`: a share of each
row's ratings, never all of them), where a band holds all of its rows' ratings.

A builder holds its target's writer lock from construction (before any input is read) to
``finalize``/``abort`` (:func:`~.target.claim`). Its spill folder
(``<tmp>/cumf-spill-<pid>-*``) carries an owner record: a later builder removes the spill
folders of owners that died (a killed ingest leaves them), never a live one's.
"""

from __future__ import annotations

import functools
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..checks import MAX_RATING, check_choice, check_fraction, check_positive_int
from ..errors import ConfigError, IngestError
from ..locks import clear_dead_folders, owned_folder
from ..paths import disk_full_as, is_url, normalize_url
from .bands import band_order_key, finish_store, init_store, transpose_band, write_band
from .duplicates import DUPLICATE_POLICIES, DuplicatePolicy, resolve_duplicates
from .hashing import SPLITS, SplitKind, split_mask, user_split_mask
from .limits import SPLIT_SEED_BITS, check_dimension, check_fits, check_seed
from .parallel import run_tasks
from .store import MAX_TILE, RatingsStore, check_tiles, default_tile
from .target import check_target, claim, discard, naming_target, publish, work_url, writing

SPILL_PREFIX = "cumf-spill-"
#: rows per spill band when the rows per tile are not given: the store's tile is a whole
#: number of them (:meth:`StoreBuilder._store_tile_rows`), so small enough that a store of
#: many ratings per row still gets bands of about default_tile's size
SPILL_TILE = 4096
#: a spilled rating (28 bytes)
SPILL_RECORD = np.dtype([("row", "<i8"), ("col", "<i8"), ("val", "<f4"), ("seq", "<i8")])
#: bytes of ratings held in memory before they are spilled, as one file sorted by spill band:
#: files number one per SPILL_BUFFER of input, not one per band (on the 2-core box creating
#: a file took 0.2 ms, 40 appends' time: 0.27 s for 1M ratings' 1,221 bands of 5M rows)
SPILL_BUFFER = 32 << 20


class StoreBuilder:
    """Build a store from COO chunks of any total size with bounded memory.

    ``add`` validates a chunk, splits off the test share, and holds it; once SPILL_BUFFER bytes
    are held they are spilled, one file sorted by spill band. ``finalize`` spills what is
    still held, reads each band's share of every spill file, resolves duplicates and writes
    the bands, one per thread. Row and column counts (m, n) may grow while adding (ids mapped
    on the fly); rows per tile are then given or SPILL_TILE, and columns per tile are chosen
    from the final shape. Rows per tile that were not given grow at ``finalize`` to what the
    final shape wants (:func:`default_tile`, whole spill bands merged), so a declared m far
    above the ratings (1e9 rows, 2,000 ratings) makes a few hundred bands, not tens of
    thousands of empty ones, and rows of many ratings still get small bands (2,000 ratings a
    row: 4,096 rows, not 65,536, which a block load would decode whole). Declared m and n are
    checked to fit this machine (:func:`~.limits.check_fits`) before anything is written.
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
        split: SplitKind = "pairs",
    ):
        if not str(url).strip():
            raise ConfigError("the output path is empty; give the store's path or URL (-o)")
        check_fraction("test_fraction", test_fraction)
        check_seed("split_seed", split_seed, SPLIT_SEED_BITS)
        check_choice("split", split, SPLITS)
        check_choice("duplicates", duplicates, DUPLICATE_POLICIES)
        url = normalize_url(url)
        check_positive_int("tile_rows", tile_rows, optional=True)
        check_positive_int("tile_cols", tile_cols, optional=True)
        check_dimension("m", m)
        check_dimension("n", n)
        self._tile_given = tile_rows is not None
        known = bool(m and n and expected_nnz)
        if tile_rows is None:
            tile_rows = default_tile(m, n, expected_nnz) if known else SPILL_TILE
        if m is not None or n is not None:  # row and test bands, column bands
            # the store's bands, not the spill's: without a tile or a rating count, spill
            # bands are merged at finalize, so count the fewest (the m and n counts, 8 bytes
            # a row, outweigh a band's bookkeeping per row at any tile of SPILL_TILE or more)
            store_rows = tile_rows if self._tile_given or known else MAX_TILE
            bands = 2 * -(-(m or 0) // store_rows) + -(-(n or 0) // (tile_cols or MAX_TILE))
            check_fits(m, n, bands, "declare m and n no larger than the largest id + 1, or "
                       "leave them out to map the ids")  # fmt: skip
        self._lock = claim(url)
        try:
            check_target(url, overwrite)
            clear_dead_folders(SPILL_PREFIX, "spill folder(s) of interrupted ingests", spill_dir)
            self._spill = owned_folder(SPILL_PREFIX, spill_dir)
        except BaseException:
            self._lock.release()
            raise
        self.url = url
        self.m, self.n = m, n
        self.tile_rows = int(tile_rows)  # of the spill bands; finalize may merge them
        # Spills are sorted by row band only, so the column tiles can wait for the shape.
        self.tile_cols = tile_cols
        self.test_fraction, self.split_seed = float(test_fraction), int(split_seed)
        self.split = split
        self.duplicates: DuplicatePolicy = duplicates
        self.overwrite = overwrite
        self._records = 0
        self._max_row = -1
        self._max_col = -1
        self._held: dict[str, list[np.ndarray]] = {"row": [], "test": []}  # SPILL_RECORDs
        self._held_bytes = 0
        # per kind, each spill file: its path, the spill bands in it, where each one starts
        # (16 bytes per band per file)
        self._spills: dict[str, list[tuple[Path, np.ndarray, np.ndarray]]] = {"row": [], "test": []}

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
        bad = ~(np.abs(val) <= MAX_RATING)
        if bad.any():
            k = int(np.argmax(bad))
            raise IngestError(
                f"rating at record {int(seq[k])} is {float(val[k]):g}: ratings must be finite "
                f"numbers within +-{MAX_RATING:.0e} (float32 training would overflow beyond)"
            )
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
        records = np.empty(row.size, SPILL_RECORD)
        for name, arr in zip(SPILL_RECORD.names, (row, col, val, seq), strict=True):
            records[name] = arr
        by_pair = self.test_fraction if self.split == "pairs" else 0.0  # users: at finalize
        test = split_mask(row, col, by_pair, self.split_seed)
        for kind, keep in (("row", ~test), ("test", test)):
            part = records if keep.all() else records.compress(keep)
            if part.size:
                self._held[kind].append(part)
                self._held_bytes += part.nbytes
        if self._held_bytes > SPILL_BUFFER:
            self._flush()

    def _flush(self) -> None:
        """Spill the held ratings and let them go."""
        with disk_full_as(self._spill.parent, "the ingest's spill files",
                          "free space there, or point TMPDIR at a disk with room for about "
                          "28 bytes per rating"):  # fmt: skip
            for kind, held in self._held.items():
                if held:
                    records = np.concatenate(held) if len(held) > 1 else held[0]
                    held.clear()
                    self._spill_chunk(kind, records)
        self._held_bytes = 0

    def _spill_chunk(self, kind: str, records: np.ndarray) -> None:
        """Write `records` (the held ratings of one kind) to a new spill file sorted by spill
        band (stably: each band's in the order added), and note where each band starts."""
        band = records["row"] // self.tile_rows
        # a stable sort of 16-bit keys is a radix sort: 8 ms per 1M, against 68 for int64's
        keys = band.astype(np.uint16) if band.max() < 1 << 16 else band
        order = np.argsort(keys, kind="stable")
        records, band = records.take(order), band[order]  # 1/4 the time of 4 fields' gathers
        path = self._spill / f"{kind}-{len(self._spills[kind])}"
        records.tofile(path)
        starts = np.flatnonzero(np.r_[True, band[1:] != band[:-1]])
        self._spills[kind].append((path, band[starts], np.r_[starts, band.size]))

    @staticmethod
    def _load(path: Path, lo: int, hi: int) -> tuple[np.ndarray, ...]:
        """Records lo to hi of a spill file as (row, col, val, seq), views of the records."""
        records = np.fromfile(path, SPILL_RECORD, hi - lo, offset=lo * SPILL_RECORD.itemsize)
        return tuple(records[name] for name in SPILL_RECORD.names)

    def finalize(
        self,
        source: dict[str, Any] | None = None,
        row_ids: np.ndarray | None = None,
        col_ids: np.ndarray | None = None,
        describe: Callable[[int, int, int, int], str] | None = None,
        progress: Callable[[str, int, int], None] | None = None,
    ) -> RatingsStore:
        """Write every band, then the column bands, then mark the store complete.

        On any error the partial store is removed, so nothing incomplete is left behind (a
        full disk is one StoreError naming the folder). A remote target is written in place,
        so its row bands are resolved once before it is touched, for what the data can fail
        (repeats under 'error', sums beyond the limit): bad data leaves the old store whole.
        """
        with writing(self.url):
            return self._write_store(source, row_ids, col_ids, describe, progress)

    def _write_store(
        self,
        source: dict[str, Any] | None,
        row_ids: np.ndarray | None,
        col_ids: np.ndarray | None,
        describe: Callable[[int, int, int, int], str] | None,
        progress: Callable[[str, int, int], None] | None,
    ) -> RatingsStore:
        local = not is_url(self.url)
        work = work_url(self.url)
        created = False
        try:
            self._flush()
            with naming_target(work, self.url):  # errors name the target, not `work`
                if self._records == 0 or not any(self._spills.values()):
                    raise IngestError("no ratings: the input is empty")
                if not self._spills["row"]:
                    raise IngestError(
                        f"all {self._records:,} ratings fell in the held-out split (test fraction "
                        f"{self.test_fraction:g}), none is left to train on; lower the test "
                        "fraction (--test-fraction, data.test_fraction)"
                    )
                m = self.m if self.m is not None else self._max_row + 1
                n = self.n if self.n is not None else self._max_col + 1
                if row_ids is not None:
                    m = self._id_count("row", row_ids, self._max_row)
                if col_ids is not None:
                    n = self._id_count("column", col_ids, self._max_col)
                created = True  # from here on a failure removes what was written
                tile_rows = self._store_tile_rows(m, n)
                tile_cols = self.tile_cols or default_tile(n, m, self._records)
                check_tiles(m, n, self._records, tile_rows, tile_cols)
                n_row_tiles = math.ceil(m / tile_rows)
                n_col_tiles = math.ceil(n / tile_cols)
                by_user = self.split == "users" and self.test_fraction > 0
                has_test = by_user or bool(self._spills["test"])
                kinds = ("row", "test") if has_test else ("row",)
                if not local:  # built in place: bad data must fail before the target is touched
                    spilled = ("row",) if by_user else kinds  # by user: test cut from row spills
                    checks = [(kind, band, tile_rows, tile_cols, describe) for kind in spilled
                              for band in range(n_row_tiles)]  # fmt: skip
                    run_tasks(None, self._check_row_band, checks, "check", None)
                init_store(work, m, n, tile_rows, tile_cols, overwrite=local or self.overwrite)
                steps = len(kinds) * n_row_tiles + n_col_tiles

                def report(_stage: str, done: int, _total: int, before: int = 0) -> None:
                    if progress:
                        progress("bands", before + done, steps)

                row_jobs = [(work, kind, band, tile_rows, tile_cols, describe) for kind in kinds
                            for band in range(n_row_tiles)]  # fmt: skip
                written = run_tasks(None, self._write_row_band, row_jobs, "bands", report)
                summaries = {kind: written[i * n_row_tiles : (i + 1) * n_row_tiles]
                             for i, kind in enumerate(kinds)}  # fmt: skip
                summaries["col"] = run_tasks(
                    None, transpose_band, [(work, b) for b in range(n_col_tiles)], "bands",
                    functools.partial(report, before=len(row_jobs)),
                )  # fmt: skip
                finish_store(
                    work,
                    summaries["row"],
                    summaries["col"],
                    summaries.get("test"),
                    source=source,
                    row_ids=row_ids,
                    col_ids=col_ids,
                )
                return publish(work, self.url)
        except BaseException:
            if created:
                discard(work)
            raise
        finally:
            shutil.rmtree(self._spill, ignore_errors=True)
            self._lock.release()

    @staticmethod
    def _id_count(axis: str, ids: np.ndarray, largest: int) -> int:
        """The rows (or columns) an id map names; fewer than the ratings use would drop or
        misplace ratings."""
        if len(ids) <= largest:
            raise IngestError(f"the {axis} ids name {len(ids):,} {axis}s, but the ratings use "
                              f"{axis} index {largest:,}: give one id per {axis} (at least "
                              f"{largest + 1:,})")  # fmt: skip
        return len(ids)

    def _store_tile_rows(self, m: int, n: int) -> int:
        """Rows per tile of the store: the spill bands' when given (or when the final shape
        wants no more), else a whole number of spill bands, as default_tile chooses for the
        final shape and rating count."""
        if self._tile_given:
            return self.tile_rows
        return self.tile_rows * max(1, default_tile(m, n, self._records) // self.tile_rows)

    def _write_row_band(
        self,
        work: str,
        kind: str,
        band: int,
        tile_rows: int,
        tile_cols: int,
        describe: Callable[[int, int, int, int], str] | None,
    ) -> dict[str, float]:
        """Write row (or test) band `band`."""
        r, c, v = self._row_band(kind, band, tile_rows, tile_cols, describe)
        return write_band(work, kind, band, r, c, v)

    def _check_row_band(self, *band: Any) -> None:
        """Resolve a row (or test) band (`band`: _row_band's arguments) for what its data can
        fail (repeats under 'error', sums beyond the limit), before a remote target is
        written; the band itself is let go at once."""
        self._row_band(*band)

    def _row_band(
        self,
        kind: str,
        band: int,
        tile_rows: int,
        tile_cols: int,
        describe: Callable[[int, int, int, int], str] | None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Row (or test) band `band` from its spill bands' share of each spill file (one read
        per file): duplicates resolved and the band's storage order in one sort; with
        split="users" the test share taken here."""
        by_user = self.split == "users" and self.test_fraction > 0
        source_kind = "row" if by_user else kind
        per = tile_rows // self.tile_rows  # spill bands
        parts = []
        for path, bands, starts in self._spills[source_kind]:
            lo, hi = starts[np.searchsorted(bands, [band * per, (band + 1) * per])].tolist()
            if hi > lo:
                parts.append(self._load(path, lo, hi))
        if not parts:
            empty = np.zeros(0, np.int64)
            return empty, empty, np.zeros(0, np.float32)
        r, c, v, s = (np.concatenate(arrays) for arrays in zip(*parts, strict=True))
        key = band_order_key(r, c, band * tile_rows, tile_rows, tile_cols)
        r, c, v = resolve_duplicates(r, c, v, s, self.duplicates, describe, key=key)
        if by_user:
            test = user_split_mask(r, c, self.test_fraction, self.split_seed)
            keep = test if kind == "test" else ~test
            r, c, v = r[keep], c[keep], v[keep]
        return r, c, v

    def abort(self) -> None:
        """Drop the held ratings, the spill files (the store itself was not created yet) and
        the lock."""
        self._held.clear()
        shutil.rmtree(self._spill, ignore_errors=True)
        self._lock.release()


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
