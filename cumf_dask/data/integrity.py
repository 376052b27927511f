"""What binds a store's data to its place, and the small checks a read makes with it.

A chunk's crc32c proves its bytes whole, not that they belong where they lie: a chunk or
a whole band folder copied or swapped into another place (a bad restore or rsync, a copy
from another store) passes it, and a fit would train on the wrong ratings. So a build
records, in each band group's attrs, which band it is (kind train/test, axis row/col,
band index, nnz), the build's id (the store's ``build`` attr, made by ``init_store``) and
the crc32c stored with each chunk of its arrays, and in the attrs of ``row_nnz`` /
``col_nnz`` the build's id and the crc32c of each of their chunks. A read checks the
band's record against the band it asked for, ``band_nnz`` and the store's build (one small
JSON file per band, parsed once per version: a band folder of another store of the same
geometry passes every other check), and compares each chunk's recorded crc32c with the 4
bytes it reads anyway: no decoding and no pass over the ratings. Whatever the records, a
band's tile pointer must end at its ``band_nnz`` and its arrays hold that many entries,
and each band's slice of ``row_nnz`` / ``col_nnz`` must sum to its ``band_nnz`` (checked
where counts are read). Stores built before the records (or before the build id) read as
before, with the checks their records allow.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import StoreError
from ..paths import is_url
from ..threads import gather
from .shards import Expect, Layout

if TYPE_CHECKING:
    from .store import RatingsStore

BAND_ARRAYS = ("major", "minor", "val", "ptr")
#: what to do about a damaged id map
IDS_FIX = "rebuild the store (ingest again with --overwrite)"
#: the integer attrs every store has, each at least 1
_SIZES = ("m", "n", "nnz", "tile_rows", "tile_cols", "n_row_tiles", "n_col_tiles")


# ----------------------------------------------------------------------------- building


def chunk_crcs(path: str) -> list[int | None] | None:
    """The crc32c stored with each chunk of an array just written (read back: 4 bytes a
    chunk, and a shard's index). Its zarr.json is parsed afresh: one written twice within
    the clock's tick keeps its mtime, and a cached layout would be stale."""
    return Layout(path).chunk_crcs()


def band_record(
    url: str, path: str, kind: str, band: int, nnz: int, build: str | None
) -> dict[str, Any]:
    """The attrs of the band group `path` of store `url`, written after its arrays: which
    band it is, of which build, and the crc32c of each chunk of each array (a remote
    store's arrays read back at once)."""
    crcs = gather(lambda name: chunk_crcs(os.path.join(url, path, name)), BAND_ARRAYS,
                  len(BAND_ARRAYS) if is_url(url) else 1, use="band-records")  # fmt: skip
    return {
        "kind": "test" if kind == "test" else "train",
        "axis": "col" if kind == "col" else "row",
        "band": int(band),
        "nnz": int(nnz),
        "build": build,
        "crc32c": dict(zip(BAND_ARRAYS, crcs, strict=True)),
    }


# ----------------------------------------------------------------------------- reading


@lru_cache(maxsize=4096)
def _local_attrs(path: str, stamp: int) -> dict[str, Any]:
    with open(os.path.join(path, "zarr.json")) as fh:
        return dict(json.load(fh).get("attributes") or {})


def group_attrs(store: RatingsStore, path: str) -> dict[str, Any]:
    """The attrs of the group `path` of `store` (a local one parsed once per version)."""
    try:
        if is_url(store.url):
            return dict(store._group[path].attrs)
        full = os.path.join(store.url, path)
        return _local_attrs(full, os.stat(os.path.join(full, "zarr.json")).st_mtime_ns)
    except (OSError, KeyError):
        problem = f"'{path}/zarr.json' (the band's metadata) is missing"
    except Exception as exc:
        problem = f"'{path}/zarr.json' cannot be read ({exc})"
    raise store.damaged(problem)  # not in the handler: see RatingsStore.ensure_same_build


def check_band(
    store: RatingsStore, path: str, orient: str, split: str, band: int, nnz: int | None
) -> tuple[int | None, dict[str, Any]]:
    """Check that the band group at `path` records itself as `orient` band `band` of
    `split` holding `nnz` ratings (band_nnz's; None in a build, which has no band_nnz
    yet), written by the store's build; returns the band's size (`nnz`, else the recorded
    one) and its recorded crc32c per array ({} for a store built before the records)."""
    attrs = group_attrs(store, path)
    if "band" not in attrs:  # built before the records (or, where builds record, foreign)
        check_build(store, path, attrs)
        return nnz, {}
    want = {"kind": split, "axis": orient, "band": band,
            "nnz": attrs.get("nnz") if nnz is None else nnz}  # fmt: skip
    got = {key: attrs.get(key) for key in want}
    if got != want:
        raise store.damaged(
            f"'{path}' holds {got['axis']} band {got['band']} ({got['kind']}, {got['nnz']} "
            f"ratings), not {orient} band {band} ({split}, {want['nnz']} ratings): band "
            "folders moved, swapped or copied from another store"
        )
    check_build(store, path, attrs)
    return want["nnz"], attrs.get("crc32c") or {}


def check_build(store: RatingsStore, path: str, record: dict[str, Any]) -> None:
    """The band or count array at `path` was written by the store's own build (`record`:
    its attrs). In a store whose builds record it (``records_build``), one without the id
    was written by an older build; older stores' records are compared only where they
    hold one."""
    build = record.get("build")
    recorded = build is not None or store.attrs.get("records_build")
    if recorded and build != store.attrs.get("build"):
        raise store.damaged(
            f"'{path}' was written by another build (build {build}, the store's is "
            f"{store.attrs.get('build')}): copied from another store, or left from an "
            "earlier build of this one"
        )


def entry_requests(
    path: str, lo: int, hi: int, nnz: int | None, crcs: dict[str, Any]
) -> list[tuple[Any, ...]]:
    """The read requests of entries [lo, hi) of a band's major, minor and val arrays, each
    checked to hold the band's `nnz` entries and against its recorded crc32c."""
    return [(f"{path}/{name}", lo, hi, Expect(nnz, crcs.get(name)))
            for name in ("major", "minor", "val")]  # fmt: skip


def ptr_request(path: str, crcs: dict[str, Any]) -> tuple[Any, ...]:
    """The read request of a band's whole tile pointer, against its recorded crc32c."""
    return (f"{path}/ptr", 0, None, Expect(crcs=crcs.get("ptr")))


def check_ptr(
    store: RatingsStore, path: str, ptr: np.ndarray, n_tiles: int, nnz: int | None, where: str
) -> None:
    """A band's tile pointer starts at 0, never decreases, and ends at the band's size
    (`nnz`, when known): a pointer of another band would drop or invent ratings silently."""
    if ptr.shape != (n_tiles + 1,) or ptr[0] != 0 or np.any(np.diff(ptr) < 0):
        raise store.damaged(f"'{path}/ptr' is not a tile pointer")
    if nnz is not None and ptr[-1] != nnz:
        raise store.damaged(f"{where} holds {int(ptr[-1])} ratings by its tile pointer "
                            f"('{path}/ptr'), band_nnz says {nnz}")  # fmt: skip


def check_count_sums(
    store: RatingsStore, name: str, counts: np.ndarray, tile: int, totals: np.ndarray
) -> None:
    """Each band's slice of `counts` (whole bands, from a band boundary) sums to its
    band_nnz: count chunks swapped between bands are caught before they weight a fit."""
    sums = np.add.reduceat(counts, np.arange(0, counts.size, tile)) if counts.size else counts
    if not np.array_equal(sums, totals):
        k = int(np.argmax(sums != totals)) if sums.size == totals.size else 0
        raise store.damaged(
            f"'{name}' does not match band_nnz (a band's counts sum to "
            f"{int(sums[k]) if sums.size else 0}, band_nnz says "
            f"{int(totals[k]) if totals.size else 0}: chunks swapped?)"
        )


def check_attrs(url: str, attrs: dict[str, Any]) -> None:
    """The sizes a store's attrs give are integers that agree with each other: a damaged
    attr is one StoreError, never a KeyError or ZeroDivisionError deep in a read."""

    def bad(key: str, why: str = "") -> StoreError:
        value = repr(attrs[key]) if key in attrs else "missing"
        return StoreError(f"{url}: damaged store: attribute {key!r} is {value}{why}; rebuild it")

    def whole(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    for key in _SIZES:
        if not whole(attrs.get(key)) or attrs[key] < 1:
            raise bad(key)
    if not whole(attrs.get("nnz_test", 0)) or attrs.get("nnz_test", 0) < 0:
        raise bad("nnz_test")
    for tiles, size, tile in (("n_row_tiles", "m", "tile_rows"), ("n_col_tiles", "n", "tile_cols")):
        if attrs[tiles] != -(-attrs[size] // attrs[tile]):
            raise bad(tiles, f", not ceil({size} / {tile}) = {-(-attrs[size] // attrs[tile])}")


def check_none_held_out(store: RatingsStore, band_nnz: np.ndarray) -> None:
    """A store whose attrs say it holds no held-out ratings has none on disk (test/'s
    band_nnz): else nnz_test was damaged, and they would never be read or checked."""
    if band_nnz.sum() > 0:
        raise StoreError(f"{store.url}: damaged store: attribute 'nnz_test' is 0, but 'test' "
                         f"holds {band_nnz.sum()} ratings; rebuild it")  # fmt: skip


def check_unique_ids(store: RatingsStore, path: str, ids: np.ndarray) -> None:
    """Ids name one row or column each: a repeated one (damage the checksums missed, or a
    store built before id maps carried one) would map two users to one."""
    import pandas as pd  # a core dependency; its hash table is several times numpy's sort

    if ids.size and pd.Index(ids).has_duplicates:
        n_unique = ids.size - int(pd.Index(ids).duplicated().sum())
        raise store.damaged(f"'{path}' holds {n_unique} distinct ids of {ids.size}",
                            IDS_FIX)  # fmt: skip
