"""What ``ALS.fit`` takes besides a store, built into one through the ingestion pipeline.

* ``(users, items, ratings)`` or ``(users, items, ratings, (m, n))``: three 1-D arrays;
* a pandas or Dask DataFrame with columns ``user``, ``item``, ``rating`` (or exactly three
  columns, in that order, unless a name says otherwise: ``movieId, userId, rating`` is refused);
* a NumPy or Dask array of shape (nnz, 3): rows of (user, item, rating);
* a SciPy sparse matrix or array: rows are users, columns items, entries ratings.

Ids follow ingestion's rules (:mod:`.ingest`): mapped in order of first appearance and kept
in the store, so a fitted model speaks them; a shape (always for SciPy) declares them 0-based
indices instead. Float ids (a Dask array holds one dtype; an integer column with a missing
value becomes float) must be whole numbers; a fraction is refused, never truncated. A Dask
input is read one partition (block) at a time, so it may be larger than this process's
memory. Everything is training data unless ``test_fraction`` says otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from os import PathLike
from typing import Any

import numpy as np

from ..checks import check_scale
from ..errors import ConfigError
from .ingest import (
    declared_shape,
    ingest_arrays,
    ingest_chunks,
    ingest_dataframe,
    ingest_scipy,
    with_scale,
)
from .readers import Chunk, Records, misplaced
from .store import RatingsStore

COLUMNS = ("user", "item", "rating")
ACCEPTED = (
    "a RatingsStore or its path/URL, (users, items, ratings[, (m, n)]) arrays, a pandas or "
    "Dask DataFrame with user, item, rating columns, a NumPy or Dask array of (user, item, "
    "rating) rows, or a SciPy sparse matrix"
)


def ingest_input(
    data: Any, url: str | PathLike[str], *, client: Any = None, **options: Any
) -> RatingsStore:
    """Build a store at `url` from any input listed in the module docstring; `options` go
    to the ingest functions (test_fraction, duplicates, overwrite, ...); a Dask input is
    computed on `client` when one is given, else on Dask's default scheduler."""
    module = type(data).__module__
    if isinstance(data, tuple) and len(data) in (3, 4):
        shape = data[3] if len(data) == 4 else None
        return ingest_arrays(url, *data[:3], shape, **options)
    if module.startswith("scipy.sparse"):
        return ingest_scipy(data, url, **options)
    if module.startswith("pandas"):
        if not hasattr(data, "columns"):
            raise ConfigError(f"fit() takes {ACCEPTED}; got a pandas {type(data).__name__}")
        return ingest_dataframe(data, url, *_columns(data.columns), **options)
    if module.startswith("dask"):
        return ingest_dask(data, url, client=client, **options)
    if isinstance(data, np.ndarray):
        _check_rows(data.shape)
        return ingest_arrays(url, data[:, 0], data[:, 1], data[:, 2], **options)
    raise ConfigError(f"fit() takes {ACCEPTED}; got {type(data).__name__}")


def ingest_dask(
    data: Any,
    url: str | PathLike[str],
    shape: tuple[int | None, int | None] | None = None,
    *,
    rating_min: float | None = None,
    rating_max: float | None = None,
    progress: Any = None,
    client: Any = None,
    **options: Any,
) -> RatingsStore:
    """Build a store from a Dask DataFrame (user, item, rating columns) or a Dask array of
    (user, item, rating) rows, one partition at a time (on `client` when given, else on
    Dask's default scheduler); ids as for ingest_arrays."""
    m, n = declared_shape(shape)
    if hasattr(data, "columns"):
        cols = list(_columns(data.columns))
        parts = data[cols].to_delayed()
        source = {"kind": "dask-dataframe", "columns": [str(c) for c in cols]}
    else:
        _check_rows(data.shape)
        parts = data.rechunk({1: 3}).to_delayed()[:, 0].tolist()
        source = {"kind": "dask-array"}
    check_scale(rating_min, rating_max)
    return ingest_chunks(
        _dask_chunks(parts, client), url, Records(None),
        with_scale(source, rating_min, rating_max), m, n, scale=(rating_min, rating_max),
        progress=progress, **options,
    )  # fmt: skip


def _dask_chunks(parts: list[Any], client: Any) -> Iterator[Chunk]:
    """Each partition computed in turn, as a chunk of raw records numbered in order."""
    done = 0
    for part in parts:
        block = part.compute() if client is None else client.compute(part).result()
        if hasattr(block, "columns"):
            users, items, ratings = (block.iloc[:, k].to_numpy() for k in range(3))
        else:
            users, items, ratings = block[:, 0], block[:, 1], block[:, 2]
        seq = np.arange(done, done + len(ratings), dtype=np.int64)
        done += len(ratings)
        yield Chunk(users, items, ratings, seq, done)


def _columns(columns: Any) -> tuple[Any, Any, Any]:
    """The user, item and rating columns: by name, else the only three there are, unless a
    name says that a column is another one (a silent mis-parse: refused)."""
    names = list(columns)
    if all(c in names for c in COLUMNS):
        return COLUMNS
    if len(names) == 3:
        wrong = misplaced(names, "the DataFrame")
        if wrong is not None:
            problem, example = wrong
            raise ConfigError(f"{problem}; reorder them (df[{example!r}]) or rename them "
                              "user, item, rating")  # fmt: skip
        return names[0], names[1], names[2]
    raise ConfigError(
        f"a DataFrame for fit() needs columns {', '.join(COLUMNS)} (or exactly three columns, "
        f"in that order); it has {', '.join(map(str, names))}: select or rename them, or use "
        "cumf_dask.data.ingest.ingest_dataframe(df, url, user_col=..., ...)"
    )


def _check_rows(shape: tuple[int, ...]) -> None:
    if len(shape) != 2 or shape[1] != 3:
        raise ConfigError(f"an array for fit() has rows of (user, item, rating): shape "
                          f"(nnz, 3), got {shape}")  # fmt: skip
