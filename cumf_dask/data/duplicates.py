"""Repeated (row, column) pairs: the policy type and the one function that applies it.

The policy is an argument of every ingestion entry point and a config key
(``data.ingest.duplicates``); the config schema imports :data:`DuplicatePolicy` from here, so
the data layer owns its own vocabulary and does not import the schema.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import numpy as np

from ..checks import MAX_RATING
from ..errors import IngestError

DuplicatePolicy = Literal["error", "last", "mean", "sum"]
DUPLICATE_POLICIES: tuple[str, ...] = get_args(DuplicatePolicy)


def resolve_duplicates(
    row: np.ndarray,
    col: np.ndarray,
    val: np.ndarray,
    seq: np.ndarray,
    policy: DuplicatePolicy,
    describe: Callable[[int, int, int, int], str] | None = None,
    key: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Collapse repeated (row, col) pairs: 'error' raises, 'last' keeps the latest, 'mean'
    averages, 'sum' adds them up (counts of implicit feedback: plays, clicks; a sum beyond
    +-MAX_RATING is an error, as such a rating would be).

    `seq` orders the records (input line or record number); `describe(row, col, seq1, seq2)`
    words the error for the user (original ids, file and lines). The pairs come back sorted
    by `key`, one int64 per pair, equal exactly for equal pairs (default: by row, then
    column; a band writer passes its storage order and need not sort again).
    """
    if row.size < 2:
        return row, col, val
    if key is None:
        key = row.astype(np.int64) * (int(col.max()) + 1) + col
    order = _pair_order(key, seq)
    if order is not None:
        row, col, val, seq, key = row[order], col[order], val[order], seq[order], key[order]
    same = key[1:] == key[:-1]
    if not same.any():
        return row, col, val
    if policy == "error":
        k = int(np.argmax(same))
        raise IngestError(
            f"duplicate rating for {_pair(describe, row, col, seq, k, k + 1)}; choose a "
            "duplicates policy: 'last', 'mean' or 'sum' (cumf-dask ingest --duplicates, "
            "ingest.duplicates in a config, or ingest_arrays(..., duplicates=) in Python, then "
            "fit on that store)"
        )
    start = np.concatenate(([True], ~same))
    first = np.flatnonzero(start)
    last = np.concatenate((first[1:] - 1, [row.size - 1]))
    if policy == "last":
        return row[last], col[last], val[last]
    sums = np.add.reduceat(val.astype(np.float64), first)
    if policy == "sum":
        big = np.abs(sums) > MAX_RATING
        if big.any():
            g = int(np.argmax(big))
            raise IngestError(
                f"the ratings of {_pair(describe, row, col, seq, first[g], last[g])} sum to "
                f"{sums[g]:g}, beyond +-{MAX_RATING:.0e}, the largest magnitude cumf-dask "
                "accepts (float32 training would overflow to NaN); rescale the ratings, or "
                "choose duplicates 'last' or 'mean'"
            )
        return row[first], col[first], sums.astype(np.float32)
    counts = np.diff(np.concatenate((first, [row.size])))
    return row[first], col[first], (sums / counts).astype(np.float32)


def _pair(
    describe: Callable[[int, int, int, int], str] | None,
    row: np.ndarray,
    col: np.ndarray,
    seq: np.ndarray,
    a: int,
    b: int,
) -> str:
    """Entries a and b of one pair, as `describe` words them for the user (ids, file, lines)."""
    if describe is None:
        return f"row {row[a]}, column {col[a]} (records {seq[a]} and {seq[b]})"
    return describe(int(row[a]), int(col[a]), int(seq[a]), int(seq[b]))


def _pair_order(key: np.ndarray, seq: np.ndarray) -> np.ndarray | None:
    """The permutation that sorts by (key, seq); None when already so. One fast unstable
    sort of the key when no pair repeats (the usual case), a two-key sort only when one does."""
    if (key[1:] > key[:-1]).all():
        return None
    order = np.argsort(key)
    ordered = key[order]
    if (ordered[1:] != ordered[:-1]).all():
        return order
    return np.lexsort((seq, key))
