"""Ingestion: rating files and in-memory ratings into a :class:`RatingsStore`.

Every input goes through one pipeline: a reader (:mod:`cumf_dask.data.readers`) yields chunks
of raw (user, item, rating) records with their record numbers; the ratings are checked (finite
numbers), the ids turned into dense indices, and the chunk handed to a
:class:`~cumf_dask.data.spill.StoreBuilder`, which spills it to disk. Memory is bounded by
one chunk plus the id maps, whatever the size of the input.

Ids:

* With no declared size for an axis (``m`` for users, ``n`` for items), its ids may be anything
  (strings, sparse integers): they are numbered 0, 1, ... in order of first appearance and the
  map is kept in the store (``store.ids("rows")`` / ``store.ids("cols")``). Ids read from text
  are strings; when every id of an axis is a plain integer (``17``, not ``017``) the map is
  stored as int64; else one whole number written two ways (``1`` and ``1.0``) is an error.
  In-memory and Parquet ids keep their type, except floats: those must be whole numbers
  and are stored as int64 (a fraction is an error, never truncated); Python or NumPy
  integers in an object array are stored as int64, other objects and bytes as text, so two
  ids that read alike as text (``1`` and ``"1"``, ``b"a"`` and ``"a"``) are an error. An id
  must be a scalar (a list is an error).
* A declared size uses the ids as indices directly (no map): they must be integers in
  ``[0, m)`` / ``[0, n)``. A SciPy matrix always declares its shape.

Ratings: a scale may be declared (``rating_min``/``rating_max``, ``--rating-min/--rating-max``):
a rating outside it is an error. Without one, a rating beyond +-1e9
(:data:`~cumf_dask.checks.MAX_RATING`) is refused as absurd: training runs in float32 and
squares ratings, so such values would overflow to NaN factors (1e9 leaves ample margin; no
real scale comes near it). ``duplicates="sum"`` checks the sums against that limit, and is
refused with a declared scale (a sum of ratings on a scale may leave it). Text ratings are
numbers as files write them: ``1_0`` or non-ASCII digits are not numbers.

Errors in the input (a malformed line, a rating that is not a finite number, outside the
declared scale or beyond +-1e9, an id out of the declared range, an empty file, a repeated
pair under ``duplicates="error"``, a binary or compressed file read as text, damaged
compressed data, a file that changed while it was read) raise one
:class:`~cumf_dask.errors.IngestError` that names the file and the 1-based line (the record
for in-memory input). Nothing is left at ``url`` then, and an existing store there is untouched
(a remote URL is checked against all of these before it is written; it is written in place,
so a failure while writing it, such as a lost connection or Ctrl-C, leaves an incomplete
store there, which never opens, instead of the old one).
An argument out of range (``test_fraction``, tile sizes, ``chunk_rows``, ``duplicates``, m or n
below 1, a shape that is not (m, n), an unknown format, not three columns or a negative
position, an empty output path, an empty delimiter or a line break, ``duplicates="sum"``
with a scale) is a :class:`~cumf_dask.errors.ConfigError`, raised before anything is read.
Declared m and n must fit this machine: a store keeps a count per row and column
(:mod:`.limits`); a shape whose counts exceed the memory available is a
:class:`~cumf_dask.errors.PlanError`, raised before anything is written.

``progress(stage, done, total)`` is called after each chunk with stage ``"read"`` (bytes of
input files, or records of in-memory input; total None when unknown), then with stage
``"bands"`` while the store is written.
"""

from __future__ import annotations

import decimal
import itertools
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from os import PathLike
from typing import Any

import numpy as np
import pandas as pd  # a core dependency: chunked, C-speed text parsing

from ..checks import MAX_RATING, check_positive_int, check_scale
from ..errors import ConfigError, IngestError
from ..paths import is_url, normalize_url
from .duplicates import DuplicatePolicy
from .formats import FORMATS
from .hashing import SplitKind
from .limits import check_dimension
from .readers import (
    Chunk,
    Column,
    Files,
    Records,
    TextFormat,
    read_arrays,
    read_parquet,
    read_text,
    show,
)
from .spill import StoreBuilder
from .store import RatingsStore

Progress = Callable[[str, int, int | None], None]
PathSpec = str | PathLike[str] | Sequence[str | PathLike[str]]


_TEXT_FORMATS = {
    "csv": TextFormat(","),
    "tsv": TextFormat("\t"),
    "delimited": TextFormat(None),
    "movielens-100k": TextFormat("\t", header=False, fields=4),
    # '::' read as ':' with empty fields between: the fast C parser handles it.
    "movielens-1m": TextFormat(":", columns=(0, 2, 4), header=False, fields=7, doubled=True),
    "movielens-csv": TextFormat(",", columns=("userId", "movieId", "rating"), header=True),
    "netflix": TextFormat(",", header=False, fields=3, blocks=True),
}
Scale = tuple[float | None, float | None]


# ----------------------------------------------------------------------------- public API


def ingest_file(
    path: PathSpec,
    url: str | PathLike[str],
    format: str = "csv",
    *,
    delimiter: str | None = None,
    header: bool | None = None,
    columns: Sequence[Column] | None = None,
    duplicates: DuplicatePolicy = "error",
    m: int | None = None,
    n: int | None = None,
    rating_min: float | None = None,
    rating_max: float | None = None,
    test_fraction: float = 0.1,
    split_seed: int = 0,
    split: SplitKind = "pairs",
    tile_rows: int | None = None,
    tile_cols: int | None = None,
    overwrite: bool = False,
    chunk_rows: int = 1_000_000,
    progress: Progress | None = None,
) -> RatingsStore:
    """Read a rating file (or several: a glob or a list) into a new store at `url`.

    Parameters
    ----------
    path : local path or fsspec URL; a glob or a list reads several files in order
        (Netflix ``training_set/mv_*.txt``). ``.gz``, ``.bz2``, ``.xz`` are decompressed.
    format : one of :data:`FORMATS`.
    delimiter, header, columns : override the format's (text formats; `columns` also for
        Parquet): the user, item and rating columns by name or 0-based position. Without
        `columns` (Parquet, or a text file with a header): the columns named user, item and
        rating when it has all three, else the first three, unless a column's name says it
        is another (such as a column 'rating' second): an error.
        ``header=None`` guesses: a header when line 1's rating field reads as a name (it
        has a letter and is no number and no NA) and its user and item fields are not both
        numbers (then it is a data line with a bad rating, an error).
    duplicates : repeated (user, item) pairs: ``"error"``, ``"last"`` (latest line wins),
        ``"mean"`` or ``"sum"`` (counts of implicit feedback).
    m, n : declared numbers of users and items: ids are then indices in [0, m) / [0, n).
    rating_min, rating_max : the declared rating scale (either may be None): a rating
        outside it is an error. Without a scale, ratings beyond +-1e9 are (module doc).
    test_fraction, split_seed : deterministic held-out share (by pair hash and seed); 0.1
        by default, as on the command line (0: everything is training data).
    split : ``"pairs"`` (that share of all pairs) or ``"users"`` (that share of each user's
        pairs, never all of them: every user keeps a training rating).
    chunk_rows : lines (rows) per chunk: bounds the memory of reading.
    progress : ``progress(stage, done, total)``, see the module docstring.
    """
    if format not in FORMATS:
        raise ConfigError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")
    check_positive_int("chunk_rows", chunk_rows)
    check_dimension("m", m)
    check_dimension("n", n)
    check_scale(rating_min, rating_max)
    overrides = {"delimiter": delimiter, "header": header, "columns": columns}
    given = [key for key, value in overrides.items() if value is not None]
    if delimiter is not None and (not delimiter or {"\n", "\r"} & set(delimiter)):
        raise ConfigError(f"the delimiter {delimiter!r} is empty or a line break; give the text "
                          "between fields (such as ',' or '::'), or leave it out for the "
                          "format's")  # fmt: skip
    if format == "parquet":
        if delimiter is not None or header is not None:
            raise ConfigError("format 'parquet' takes no delimiter or header (only columns)")
        files = Files(path, unit="row")
        chunks = read_parquet(files, None if columns is None else _three(columns), chunk_rows)
    else:
        if format == "netflix" and given:
            raise ConfigError(f"format 'netflix' is fixed: drop {', '.join(given)}")
        spec = _TEXT_FORMATS[format]
        if delimiter is not None:
            spec = replace(spec, delimiter=delimiter)
        if header is not None:
            spec = replace(spec, header=header)
        if columns is not None:
            spec = replace(spec, columns=_three(columns))
        files = Files(path, unit="line")
        chunks = read_text(files, spec, chunk_rows)
    settings = dict(format=format, delimiter=delimiter, header=header, columns=columns,
                    duplicates=duplicates, m=m, n=n, test_fraction=test_fraction, split=split,
                    split_seed=split_seed)  # fmt: skip
    source = {"kind": "file", "path": files.name, **input_identity(path, files),
              **{key: _as_attr(value) for key, value in settings.items()}}  # fmt: skip
    return ingest_chunks(
        chunks, url, files, with_scale(source, rating_min, rating_max), m, n,
        scale=(rating_min, rating_max), duplicates=duplicates, test_fraction=test_fraction,
        split_seed=split_seed, split=split, tile_rows=tile_rows, tile_cols=tile_cols,
        overwrite=overwrite, progress=progress,
    )  # fmt: skip


def ingest_arrays(
    url: str | PathLike[str],
    users: Any,
    items: Any,
    ratings: Any,
    shape: tuple[int | None, int | None] | None = None,
    *,
    duplicates: DuplicatePolicy = "error",
    rating_min: float | None = None,
    rating_max: float | None = None,
    test_fraction: float = 0.1,
    split_seed: int = 0,
    split: SplitKind = "pairs",
    tile_rows: int | None = None,
    tile_cols: int | None = None,
    overwrite: bool = False,
    chunk_rows: int = 1_000_000,
    progress: Progress | None = None,
    source: dict[str, Any] | None = None,
) -> RatingsStore:
    """Build a store from three equally long 1-D arrays (or lists) of users, items, ratings.

    Without `shape` the ids are mapped in order of first appearance (see the module
    docstring); with ``shape=(m, n)`` they are used as indices (either may be None: mapped).
    `source` is recorded in the store's attrs. Other parameters as for :func:`ingest_file`.
    """
    check_positive_int("chunk_rows", chunk_rows)
    check_scale(rating_min, rating_max)
    m, n = declared_shape(shape)
    users, items, ratings = np.asarray(users), np.asarray(items), np.asarray(ratings)
    if not (users.ndim == items.ndim == ratings.ndim == 1) or not (
        users.shape == items.shape == ratings.shape
    ):
        raise IngestError(
            "users, items and ratings must be 1-D arrays of one length; got shapes "
            f"{users.shape}, {items.shape}, {ratings.shape}"
        )
    return ingest_chunks(
        read_arrays(users, items, ratings, chunk_rows), url, Records(len(ratings)),
        with_scale(source or {"kind": "arrays"}, rating_min, rating_max), m, n,
        scale=(rating_min, rating_max), duplicates=duplicates, test_fraction=test_fraction,
        split_seed=split_seed, split=split, tile_rows=tile_rows, tile_cols=tile_cols,
        overwrite=overwrite, progress=progress, expected_nnz=len(ratings),
    )  # fmt: skip


def ingest_dataframe(
    df: pd.DataFrame,
    url: str | PathLike[str],
    user_col: Any = "user",
    item_col: Any = "item",
    rating_col: Any = "rating",
    shape: tuple[int | None, int | None] | None = None,
    **options: Any,
) -> RatingsStore:
    """Build a store from three columns of a pandas DataFrame; `options` as for ingest_arrays."""
    cols = [user_col, item_col, rating_col]
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise IngestError(
            f"the DataFrame has no column {missing[0]!r} (it has {', '.join(map(str, df.columns))})"
        )
    source = {"kind": "dataframe", "columns": [str(c) for c in cols]}
    users, items, ratings = (df[c].to_numpy() for c in cols)
    return ingest_arrays(url, users, items, ratings, shape, source=source, **options)


def ingest_scipy(matrix: Any, url: str | PathLike[str], **options: Any) -> RatingsStore:
    """Build a store from a SciPy sparse matrix or array: every stored entry is a rating.

    Rows are users and columns items, used as indices (the shape is declared). Repeated
    entries of a non-canonical matrix follow `duplicates`. `options` as for ingest_arrays.
    """
    import scipy.sparse

    if not scipy.sparse.issparse(matrix):
        raise IngestError(f"expected a scipy.sparse matrix, got {type(matrix).__name__}")
    coo = matrix.tocoo()
    source = {"kind": "scipy", "format": str(matrix.format)}
    return ingest_arrays(url, *coo.coords, coo.data, coo.shape, source=source, **options)


# ----------------------------------------------------------------------------- the pipeline


class _Axis:
    """Users or items: ids used as indices (declared size) or mapped in order of appearance."""

    def __init__(self, noun: str, letter: str, size: int | None):
        self.noun, self.letter, self.size = noun, letter, size
        self._codes: dict[Any, int] = {}
        self._new: list[np.ndarray] = []
        self._firsts: list[int] = []  # the first record number of each chunk of `_new`
        self.labels: np.ndarray | None = None

    def encode(self, ids: np.ndarray, seq: np.ndarray, records: Records) -> np.ndarray:
        """Dense int64 indices of one chunk's ids."""
        self._refuse_bools(ids, seq, records)
        if self.size is not None:
            return self._check(ids, seq, records)
        if ids.dtype.kind == "f":  # e.g. an integer column with a NaN: whole numbers only
            ids = self._whole(ids, seq, records)
        try:
            codes, uniques = pd.factorize(ids)
        except TypeError:  # an unhashable id (a list, an array); anything else is a bug
            k = next((k for k, v in enumerate(ids) if not _hashable(v)), None)
            if k is None:
                raise
            raise IngestError(
                f"{records.where(seq[k])}: the {self.noun} id {show(ids[k])} is not a "
                f"scalar (type {type(ids[k]).__name__}); ids must be scalars: numbers or text"
            ) from None
        if (codes < 0).any():
            where = records.where(seq[np.argmax(codes < 0)])
            raise IngestError(f"{where}: the {self.noun} id is missing; fix or remove it")
        labels = uniques.tolist()
        known = np.fromiter(map(self._codes.get, labels, itertools.repeat(-1)), np.int64,
                            count=len(labels))  # fmt: skip
        new = known < 0
        known[new] = np.arange(len(self._codes), len(self._codes) + int(new.sum()))
        self._codes.update(zip(uniques[new].tolist(), known[new].tolist(), strict=True))
        self._new.append(uniques[new])
        self._firsts.append(int(seq[0]) if len(seq) else 0)
        return known[codes]

    def _refuse_bools(self, ids: np.ndarray, seq: np.ndarray, records: Records) -> None:
        """A bool is not an id: True would become user 1 (Python counts True == 1)."""
        if ids.dtype.kind == "b":
            k = 0
        elif ids.dtype.kind == "O":
            is_bool = np.fromiter((isinstance(v, (bool, np.bool_)) for v in ids), bool, len(ids))
            if not is_bool.any():
                return
            k = int(np.argmax(is_bool))
        else:
            return
        raise IngestError(
            f"{records.where(seq[k])}: the {self.noun} id {show(ids[k])} is a bool; ids must "
            "be numbers or text (True would be read as the id 1)"
        )

    def _whole(self, ids: np.ndarray, seq: np.ndarray, records: Records) -> np.ndarray:
        """Float ids as int64 when each is a whole number; a fraction is refused (never
        truncated: 1.5 and 1.0 would become one user)."""
        bad = ~(np.isfinite(ids) & (ids == np.floor(ids)) & (np.abs(ids) < 2.0**63))
        if bad.any():
            k = int(np.argmax(bad))
            raise IngestError(
                f"{records.where(seq[k])}: {self.noun} id {show(ids[k])} is not a whole "
                "number; ids are integers or text (a fraction is not truncated)"
            )
        return ids.astype(np.int64)

    def _check(self, ids: np.ndarray, seq: np.ndarray, records: Records) -> np.ndarray:
        size = self.size
        idx = np.asarray(ids if ids.dtype.kind in "iu" else pd.to_numeric(ids, errors="coerce"))
        bad = ~((idx >= 0) & (idx < size) & (idx == np.floor(idx)))
        if bad.any():
            k = int(np.argmax(bad))
            raise IngestError(
                f"{records.where(seq[k])}: {self.noun} id {show(ids[k])} is not an integer in "
                f"[0, {size}) (declared {self.letter}={size}); fix the id, declare a larger "
                f"{self.letter}, or declare none to map ids"
            )
        return idx.astype(np.int64)

    def finish(self, records: Records) -> np.ndarray | None:
        """The map from indices to ids (None for a declared size); kept in `labels`."""
        if self.size is None:
            mixed = len({a.dtype for a in self._new}) > 1  # e.g. ints in one file, text in one
            ids = np.concatenate(self._new, dtype=object if mixed else None)
            origins = lambda i, j: self._origins(records, i, j)  # noqa: E731
            if records.text_ids:
                self.labels = _integer_ids(ids, self.noun, origins)
            else:
                self.labels = _stored_ids(ids, self.noun, origins)
        return self.labels

    def _origins(self, records: Records, *indices: int) -> str:
        """Where the ids of these map indices came from: the file of each (the input when
        in memory), named once when they are one."""
        ends = np.cumsum([len(a) for a in self._new])
        firsts = [self._firsts[int(np.searchsorted(ends, i, "right"))] for i in indices]
        return " and ".join(dict.fromkeys(records.origin(f) for f in firsts))

    def label(self, index: int) -> str:
        return show(self.labels[index]) if self.labels is not None else str(index)


def ingest_chunks(
    chunks: Iterable[Chunk],
    url: str | PathLike[str],
    records: Records,
    source: dict[str, Any],
    m: int | None,
    n: int | None,
    *,
    scale: Scale,
    progress: Progress | None,
    **builder_options: Any,
) -> RatingsStore:
    """The shared pipeline: check ratings, map ids, spill to the builder, finalize.

    `chunks` of raw records, numbered as `records` describes (:mod:`.readers`); m, n the
    declared sizes (None: ids mapped); builder options as for :class:`StoreBuilder`.
    """
    _check_sum_scale(builder_options.get("duplicates", "error"), scale)
    builder = StoreBuilder(str(url), m=m, n=n, **builder_options)
    users, items = _Axis("user", "m", m), _Axis("item", "n", n)
    count = 0
    try:
        for chunk in chunks:
            ratings = _ratings(chunk, records, scale)
            rows = users.encode(chunk.users, chunk.seq, records)
            cols = items.encode(chunk.items, chunk.seq, records)
            builder.add(rows, cols, ratings, seq=chunk.seq)
            count += ratings.size
            if progress:
                progress("read", chunk.done, records.total)
        if count == 0:
            hint = "" if type(records) is Records else " (an empty file, or only a header)"
            raise IngestError(f"{records.name}: no ratings found{hint}")
        row_ids, col_ids = users.finish(records), items.finish(records)
    except BaseException:
        builder.abort()
        raise

    def describe(row: int, col: int, a: int, b: int) -> str:
        return f"user {users.label(row)}, item {items.label(col)} ({records.pair(a, b)})"

    return builder.finalize(
        source=source, row_ids=row_ids, col_ids=col_ids, describe=describe, progress=progress
    )


def _check_sum_scale(duplicates: str, scale: Scale) -> None:
    """A declared scale bounds each rating, and summed repeats may pass it (3 plays of at
    most 5 make 15): 'sum' with a scale is refused rather than the sums refused or the scale
    recorded wrong."""
    if duplicates == "sum" and scale != (None, None):
        raise ConfigError(
            "duplicates='sum' (--duplicates sum) adds repeated ratings up, so a sum may leave "
            "the declared rating scale (rating_min/rating_max, --rating-min/--rating-max); "
            "declare no scale with 'sum', or choose 'last' or 'mean'"
        )


def _ratings(chunk: Chunk, records: Records, scale: Scale) -> np.ndarray:
    """The chunk's ratings as float64: finite numbers, within the declared scale if any, else
    within +-MAX_RATING; the first that is not is an error naming its line."""
    dtype = getattr(chunk.ratings, "dtype", None)
    if getattr(dtype, "kind", "") in ("c", "m", "M"):  # complex, timedelta, datetime
        raise IngestError(f"{records.origin(chunk.seq[0])}: ratings of dtype {dtype} are not real "
                          "numbers; convert them to an integer or float dtype first")  # fmt: skip
    values = _numbers(chunk.ratings)
    low, high = scale
    ok = np.isfinite(values)
    if low is None and high is None:
        ok &= np.abs(values) <= MAX_RATING
    else:
        ok &= (values >= (-np.inf if low is None else low)) & (
            values <= (np.inf if high is None else high)
        )
    if ok.all():
        return values
    k = int(np.argmax(~ok))
    where, shown = records.where(chunk.seq[k]), show(chunk.ratings[k])
    if not np.isfinite(values[k]):
        raise IngestError(f"{where}: rating {shown} is not a finite number; fix or remove it")
    if low is None and high is None:
        raise IngestError(
            f"{where}: rating {shown} is beyond +-{MAX_RATING:.0e}, the largest magnitude "
            "cumf-dask accepts (float32 training would overflow to NaN); fix or remove it, or "
            "rescale the ratings"
        )
    bounds = f"[{'-inf' if low is None else f'{low:g}'}, {'inf' if high is None else f'{high:g}'}]"
    raise IngestError(
        f"{where}: rating {shown} is outside the declared scale {bounds}; fix or remove it, or "
        "declare a wider scale (--rating-min/--rating-max)"
    )


def _numbers(ratings: Any) -> np.ndarray:
    """Ratings as float64, NaN for each that is not a number. Text is read as the formats
    write numbers: float() alone would also take '1_0' (as 10) and non-ASCII digits."""
    ratings = np.asarray(ratings)
    if ratings.dtype.kind not in "OU" or _plain_text(ratings):
        try:
            return np.asarray(ratings, dtype=np.float64)
        except (TypeError, ValueError):  # text that is not a number: found below
            pass
    return np.asarray(pd.to_numeric(ratings, errors="coerce"), dtype=np.float64)


def _plain_text(values: np.ndarray) -> bool:
    """Whether `values` are all text of ASCII characters without '_' (one fast scan)."""
    try:
        text = "".join(values)
    except TypeError:  # not all text
        return False
    return text.isascii() and "_" not in text


def input_identity(path: PathSpec, files: Files) -> dict[str, Any]:
    """What tells a later reuse of the store whether its input is still these files: the
    path resolved (the same text names another file from another working folder), how
    many files it matched, their bytes and the latest modification time (None where the
    file system keeps none)."""
    times = [modified for _, modified in files.stamps]
    modified = None if None in times else max(times).isoformat()  # None: no times kept
    return {"resolved": resolved_location(path), "files": len(files), "bytes": files.total,
            "modified": modified}  # fmt: skip


def resolved_location(path: PathSpec) -> str:
    """A rating file's path (or glob, or list of them) as it reads from any working folder:
    a local path absolute with its ``~`` expanded, a URL as it is."""
    if isinstance(path, (list, tuple)):
        return ", ".join(resolved_location(p) for p in path)
    text = normalize_url(path)
    return text if is_url(text) else os.path.abspath(text)


def _as_attr(value: Any) -> Any:
    """A setting as a store's JSON attrs keep it: NumPy numbers as Python's, columns as a list."""
    if isinstance(value, (list, tuple)):
        return [_as_attr(item) for item in value]
    return value.item() if isinstance(value, np.generic) else value


def with_scale(source: dict[str, Any], low: float | None, high: float | None) -> dict:
    """The store's provenance, with the declared scale when there is one."""
    if low is None and high is None:
        return source
    return {**source, "rating_min": low, "rating_max": high}


def _integer_ids(ids: np.ndarray, noun: str, origins: Callable[[int, int], str]) -> np.ndarray:
    """Text ids as int64 when every one is a plain integer ('17', not '017' or '1.0'); else
    as text, where one whole number written two ways ('1' and '1.0') is refused."""
    try:
        ints = ids.astype(np.int64)
    except (TypeError, ValueError, OverflowError):
        ints = None
    if ints is not None and (ints.astype(str) == ids.astype(str)).all():
        return ints
    _refuse_numbers_alike(ids, noun, origins)
    return ids


def _refuse_numbers_alike(ids: np.ndarray, noun: str, origins: Callable[[int, int], str]) -> None:
    """Refuse text ids that are one whole number written two ways ('1' and '1.0' or '1e0'):
    kept as text they would be two users (Parquet's 1 and 1.0 are one). Leading zeros
    ('017') make another id, as documented. Vectorized: ids equal as floats are compared
    exactly."""
    like = _number_like(ids)
    values = pd.to_numeric(pd.Series(ids[like], dtype=object), errors="coerce")
    same = (values.duplicated(keep=False) & values.notna()).to_numpy(bool)
    first: dict[decimal.Decimal, int] = {}
    for k in like[same].tolist():
        number = decimal.Decimal(ids[k])
        if re.match(r"[+-]?0[0-9]", ids[k]) or number != number.to_integral_value():
            continue
        i = first.setdefault(number, k)
        if i != k:
            raise IngestError(
                f"{origins(i, k)}: {noun} ids {show(ids[i])} and {show(ids[k])} are one "
                f"number written two ways, so they would be two {noun}s; write each id one "
                f"way (such as {int(number)})"
            )


def _number_like(ids: np.ndarray) -> np.ndarray:
    """Positions of the (non-empty, text) ids made only of digits, signs, points and
    exponents: a scan of all their bytes at once (a Python call per id is slow)."""
    data = np.frombuffer("\0".join(ids.tolist()).encode(), np.uint8)
    alien = np.r_[0, np.cumsum(~_NUMBER_BYTES[data], dtype=np.int64)]
    ends = np.r_[np.flatnonzero(data == 0), len(data)]
    starts = np.r_[0, ends[:-1] + 1]
    return np.flatnonzero(alien[ends] == alien[starts])


_NUMBER_BYTES = np.isin(np.arange(256), list(b"\x000123456789+-.eE"))


def _stored_ids(ids: np.ndarray, noun: str, origins: Callable[[int, int], str]) -> np.ndarray:
    """Mapped ids as the store keeps them: an object array of integers (Python or NumPy,
    not bools) as int64; other objects and bytes as text, where two ids that read alike
    (1 and '1', b'a' and 'a') would be two users of one name: refused, naming where
    (`origins` of their positions) they came from."""
    if ids.dtype.kind not in "OS":  # numbers, or text (kind U) of one type
        return ids
    kind = pd.api.types.infer_dtype(ids, skipna=False)
    if kind == "integer":
        try:
            return ids.astype(np.int64)
        except OverflowError:  # beyond int64: kept as text
            pass
    if kind == "string":
        return ids
    text = np.array([_as_text(v) for v in ids], dtype=object)
    again = pd.Index(text).duplicated()
    if again.any():
        j = int(np.argmax(again))
        i = int(np.argmax(text == text[j]))
        raise IngestError(
            f"{origins(i, j)}: {noun} ids {show(ids[i])} and {show(ids[j])} are different ids "
            f"that read alike as text ({show(text[j])}), which is how the store keeps them; "
            "give the ids one type (all numbers, or all text)"
        )
    return text


def _as_text(value: Any) -> str:
    """An id as text: bytes decoded (as zarr stores them), anything else str()."""
    return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else str(value)


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def declared_shape(shape: Any) -> tuple[Any, Any]:
    """(m, n) of a declared shape, (None, None) for none; not a pair is a usage error (the
    sizes themselves are checked by the builder)."""
    if shape is None:
        return None, None
    try:
        m, n = shape
    except (TypeError, ValueError):
        raise ConfigError(
            f"shape must be (m, n), the numbers of users and items (either None: those ids "
            f"are mapped); got {shape!r}"
        ) from None
    return m, n


def _three(columns: Sequence[Column]) -> tuple[Column, Column, Column]:
    """The user, item and rating columns; another number of them, or a negative position,
    is a usage error."""
    if isinstance(columns, str) or len(columns) != 3:
        raise ConfigError(
            f"columns must name three columns (user, item, rating), got {columns!r}; give "
            "them in that order, by name or 0-based position (--columns 0,1,2)"
        )
    negative = next((c for c in columns if re.fullmatch(r"-\d+", str(c).strip())), None)
    if negative is not None:
        raise ConfigError(
            f"columns {list(columns)!r}: position {negative} is negative; positions are "
            "0-based, from the first column (0) on"
        )
    user, item, rating = columns
    return user, item, rating
