"""Ingestion: every format round-trips in the user's ids; bad input fails cleanly."""

from __future__ import annotations

import bz2
import functools
import gzip
import lzma
import os
import re
import signal
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path

import fsspec
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import scipy.sparse as sp

from cumf_dask.cli import main
from cumf_dask.config import DataConfig, IngestConfig
from cumf_dask.data import limits
from cumf_dask.data.ingest import (
    FORMATS,
    ingest_arrays,
    ingest_dataframe,
    ingest_file,
    ingest_scipy,
)
from cumf_dask.data.parallel import run_tasks
from cumf_dask.data.readers import Files
from cumf_dask.data.store import RatingsStore
from cumf_dask.errors import ConfigError, IngestError, PlanError, StoreError
from cumf_dask.pipeline import ingest_from_config


def make_ratings(seed, k=60, users=12, items=9, ids="str", stars=False):
    """k distinct (user, item, rating) records; ids are strings or sparse integers."""
    rng = np.random.default_rng(seed)
    flat = rng.choice(users * items, k, replace=False)
    if ids == "str":
        user_ids = [f"u{x}-{rng.integers(100)}" for x in range(users)]
        item_ids = [f"item {x}" for x in range(items)]
    else:
        user_ids = rng.choice(10**9, users, replace=False).tolist()
        item_ids = rng.choice(10**6, items, replace=False).tolist()
    vals = rng.integers(1, 6, k) if stars else rng.integers(1, 11, k) / 2
    return [
        (user_ids[f // items], item_ids[f % items], float(v))
        for f, v in zip(flat.tolist(), vals.tolist(), strict=True)
    ]


def contents(store):
    """{(user id, item id): rating} of the training and test sets, in the user's ids."""
    rows, cols = store.ids("rows"), store.ids("cols")
    rows = None if rows is None else rows.tolist()
    cols = None if cols is None else cols.tolist()
    out = {}
    for split in ("train", "test") if store.has_test else ("train",):
        for r, c, v in zip(*(a.tolist() for a in store.read_coo("row", split=split)), strict=True):
            out[(r if rows is None else rows[r], c if cols is None else cols[c])] = v
    return out


def expected(records):
    return {(u, i): r for u, i, r in records}


def write(path, lines, opener=open):
    with opener(path, "wt") as fh:
        fh.write("".join(line + "\n" for line in lines))
    return str(path)


def assert_nothing_at(url):
    assert not os.path.exists(url)
    assert_no_work_folder(url)


def assert_no_work_folder(url):
    url = Path(url)
    assert not list(url.parent.glob(f".partial-{url.name}-*"))


# ----------------------------------------------------------------------------- formats

# name: (format, extra options, line template, header line, id kind)
TEXT_CASES = {
    "csv": ("csv", {}, "{u},{i},{r},881250949", "user,item,rating,ts", "str"),
    "tsv": ("tsv", {}, "{u}\t{i}\t{r}", None, "str"),
    "pipe": ("delimited", {"delimiter": "|"}, "{u}|{i}|{r}", None, "str"),
    "double-colon": ("delimited", {"delimiter": "::"}, "{u}::{i}::{r}", None, "str"),
    "whitespace": ("delimited", {}, "  {u}   {i}\t{r} ", None, "int"),
    "movielens-100k": ("movielens-100k", {}, "{u}\t{i}\t{r:g}\t881250949", None, "int"),
    "movielens-1m": ("movielens-1m", {}, "{u}::{i}::{r:g}::978300760", None, "int"),
    "movielens-csv": (
        "movielens-csv", {}, "{u},{i},{r},1112486027", "userId,movieId,rating,timestamp", "int"
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(TEXT_CASES))
def test_text_formats_round_trip(tmp_path, case):
    fmt, options, template, header, ids = TEXT_CASES[case]
    records = make_ratings(list(TEXT_CASES).index(case), ids=ids)
    lines = [template.format(u=u, i=i, r=r) for u, i, r in records]
    path = write(tmp_path / "ratings.txt", [header, *lines] if header else lines)
    store = ingest_file(path, tmp_path / "s.zarr", fmt, **options)
    assert contents(store) == expected(records)
    assert (store.m, store.n, store.nnz + store.nnz_test) == (12, 9, 60)
    assert store.nnz_test > 0  # 10% held out by default, as on the command line
    assert store.source["format"] == fmt
    if ids == "int":
        assert store.ids("rows").dtype.kind == store.ids("cols").dtype.kind == "i"
    # ids are numbered in order of first appearance
    assert store.ids("rows").tolist()[0] == records[0][0]


def write_netflix(path, records):
    lines = []
    for movie in dict.fromkeys(i for _, i, _ in records):
        lines.append(f"{movie}:")
        lines += [f"{u},{int(r)},2005-09-06" for u, i, r in records if i == movie]
    return write(path, lines)


def test_netflix_round_trip_chunked(tmp_path):
    records = make_ratings(1, ids="int", stars=True)
    path = write_netflix(tmp_path / "combined_data_1.txt", records)
    one = ingest_file(path, tmp_path / "a.zarr", "netflix")
    small = ingest_file(path, tmp_path / "b.zarr", "netflix", chunk_rows=4)
    assert contents(one) == contents(small) == expected(records)
    assert one.ids("cols").dtype.kind == "i"


def test_netflix_glob_of_files_and_cross_file_duplicate(tmp_path):
    records = make_ratings(2, ids="int", stars=True)
    write_netflix(tmp_path / "mv_0000001.txt", records[:30])
    write_netflix(tmp_path / "mv_0000002.txt", records[30:])
    store = ingest_file(str(tmp_path / "mv_*.txt"), tmp_path / "s.zarr", "netflix")
    assert contents(store) == expected(records)
    write_netflix(tmp_path / "mv_0000003.txt", records[:1])
    with pytest.raises(IngestError) as info:
        ingest_file(str(tmp_path / "mv_*.txt"), tmp_path / "t.zarr", "netflix")
    assert "mv_0000001.txt, line 2" in str(info.value)
    assert "mv_0000003.txt, line 2" in str(info.value)
    assert_nothing_at(tmp_path / "t.zarr")


def test_netflix_rating_before_movie_line(tmp_path):
    path = write(tmp_path / "n.txt", ["5,3,2005-01-01", "1:", "6,4,2005-01-01"])
    with pytest.raises(IngestError, match=r"n\.txt, line 1: a rating line before"):
        ingest_file(path, tmp_path / "s.zarr", "netflix")


def test_parquet_round_trip_by_name_and_position(tmp_path):
    records = make_ratings(3)
    users, items, vals = zip(*records, strict=True)
    table = pa.table(
        {
            "extra": np.arange(len(records)),
            "uid": list(users),
            "iid": [len(i) * 1000 + int(i.split()[1]) for i in items],
            "stars": np.array(vals, np.float32),
        }
    )
    pq.write_table(table, tmp_path / "r.parquet", row_group_size=16)
    want = {(u, len(i) * 1000 + int(i.split()[1])): r for u, i, r in records}
    by_name = ingest_file(
        tmp_path / "r.parquet", tmp_path / "a.zarr", "parquet", columns=["uid", "iid", "stars"],
        chunk_rows=10,
    )  # fmt: skip
    by_pos = ingest_file(tmp_path / "r.parquet", tmp_path / "b.zarr", "parquet", columns=[1, 2, 3])
    assert contents(by_name) == contents(by_pos) == want
    assert by_name.ids("cols").dtype.kind == "i"


def test_parquet_columns_by_name_else_by_position(tmp_path):
    """Without columns, user, item and rating are taken by name when all three are there."""
    pq.write_table(pa.table({"rating": [5.0, 3.0], "item": [10, 20], "user": [1, 2]}),
                   tmp_path / "named.parquet")  # fmt: skip
    pq.write_table(pa.table({"u": [1, 2], "i": [10, 20], "r": [5.0, 3.0]}), tmp_path / "p.parquet")
    for name in ("named", "p"):
        store = ingest_file(tmp_path / f"{name}.parquet", tmp_path / f"{name}.zarr", "parquet")
        assert contents(store) == {(1, 10): 5.0, (2, 20): 3.0}


def test_parquet_fallback_refuses_a_misplaced_column_name(tmp_path):
    """MovieLens written column by column: the first three would read ratings as item ids."""
    pq.write_table(pa.table({"userId": [1, 2], "rating": [3.0, 4.0], "movieId": [1193, 661]}),
                   tmp_path / "ml.parquet")  # fmt: skip
    with pytest.raises(IngestError, match=r"ml\.parquet: the column 'rating' is at position 1.*"
                       r"--columns userId,movieId,rating"):  # fmt: skip
        ingest_file(tmp_path / "ml.parquet", tmp_path / "s.zarr", "parquet")
    store = ingest_file(tmp_path / "ml.parquet", tmp_path / "s.zarr", "parquet",
                        columns=["userId", "movieId", "rating"])  # fmt: skip
    assert contents(store) == {(1, 1193): 3.0, (2, 661): 4.0}


def test_parquet_repeated_column_names(tmp_path):
    table = pa.table([pa.array([1, 2]), pa.array([10, 20]), pa.array([4.0, 3.0])],
                     names=["a", "a", "b"])  # fmt: skip
    pq.write_table(table, tmp_path / "d.parquet")
    store = ingest_file(tmp_path / "d.parquet", tmp_path / "s.zarr", "parquet")
    assert contents(store) == {(1, 10): 4.0, (2, 20): 3.0}
    with pytest.raises(IngestError, match=r"d\.parquet: column 'a' appears 2 times; give the "):
        ingest_file(tmp_path / "d.parquet", tmp_path / "t.zarr", "parquet", columns=["a", 1, 2])


def test_parquet_bad_rating_names_row(tmp_path):
    table = pa.table({"u": [1, 2, 3], "i": [4, 5, 6], "r": [1.0, float("nan"), 2.0]})
    pq.write_table(table, tmp_path / "r.parquet")
    with pytest.raises(IngestError, match=r"r\.parquet, row 2: rating nan is not a finite"):
        ingest_file(tmp_path / "r.parquet", tmp_path / "s.zarr", "parquet")
    assert_nothing_at(tmp_path / "s.zarr")


@pytest.mark.parametrize(
    "users, message",
    [
        (["a", None], r"r0\.pq, row 2: the user id is missing"),
        (pa.array([7, None], pa.int64()), r"r0\.pq, row 2: the user id is missing"),
        ([[7], [8]], r"r0\.pq, row 1: the user id array\(\[7\]\) is not a scalar"),
        ([1, 2], r"r0\.pq and \S*r1\.pq: user ids 1 and '1' are different ids that read alike"),
        ([True, False], r"r0\.pq, row 1: the user id True is a bool; ids must be numbers"),
    ],
)
def test_parquet_bad_ids(tmp_path, users, message):
    """A null id is missing, text or integer (pyarrow gives an integer column's nulls as NaN);
    a list is no id; a column of integers in one file and text in the next would make two
    users of one name; a bool would be the id 1 or 0."""
    pq.write_table(pa.table({"u": users, "i": [4, 5], "r": [1.0, 2.0]}), tmp_path / "r0.pq")
    pq.write_table(pa.table({"u": ["1"], "i": [4], "r": [1.0]}), tmp_path / "r1.pq")
    with pytest.raises(IngestError, match=message):
        ingest_file([tmp_path / "r0.pq", tmp_path / "r1.pq"], tmp_path / "s.zarr", "parquet")
    assert_nothing_at(tmp_path / "s.zarr")


def test_not_parquet(tmp_path):
    path = write(tmp_path / "r.parquet", ["1,2,3"])
    with pytest.raises(IngestError, match="cannot read it as Parquet"):
        ingest_file(path, tmp_path / "s.zarr", "parquet")


@pytest.mark.parametrize("suffix, opener", [(".gz", gzip.open), (".bz2", bz2.open)])
def test_compressed_input(tmp_path, suffix, opener):
    records = make_ratings(4)
    path = write(tmp_path / f"r.csv{suffix}", [f"{u},{i},{r}" for u, i, r in records], opener)
    assert contents(ingest_file(path, tmp_path / "s.zarr")) == expected(records)


@pytest.mark.parametrize("suffix, opener", [(".gz", gzip.open), (".xz", lzma.open)])
def test_damaged_compressed_input(tmp_path, suffix, opener):
    """zlib and lzma raise errors of their own (no OSError) on damaged data."""
    path = write(tmp_path / f"r.csv{suffix}", [f"{k},{k % 7},3" for k in range(20_000)], opener)
    data = bytearray(Path(path).read_bytes())
    data[12:20] = bytes(b ^ 0xFF for b in data[12:20])
    Path(path).write_bytes(bytes(data))
    with pytest.raises(IngestError, match=r"r\.csv\.\w+: the compressed data is damaged"):
        ingest_file(path, tmp_path / "s.zarr")
    assert_nothing_at(tmp_path / "s.zarr")


def test_plain_text_named_gz(tmp_path):
    path = write(tmp_path / "r.csv.gz", ["1,10,4"])
    with pytest.raises(IngestError, match=r"r\.csv\.gz: not gzip-compressed data .* without \.gz"):
        ingest_file(path, tmp_path / "s.zarr")


def test_truncated_compressed_parquet(tmp_path):
    pq.write_table(pa.table({"u": [1, 2], "i": [3, 4], "r": [5.0, 4.0]}), tmp_path / "r.parquet")
    packed = gzip.compress((tmp_path / "r.parquet").read_bytes())
    (tmp_path / "r.parquet.gz").write_bytes(packed[: len(packed) // 2])
    with pytest.raises(IngestError, match=r"r\.parquet\.gz: the compressed data is damaged"):
        ingest_file(tmp_path / "r.parquet.gz", tmp_path / "s.zarr", "parquet")


def test_a_file_that_changes_while_it_is_read_is_refused(tmp_path):
    """Another process rewriting the file mid-read would mix two versions of it."""
    path = write(tmp_path / "r.csv", [f"{k},{k % 100},1" for k in range(3000)])

    def rewrite(stage, done, total):
        if stage == "read" and os.path.getsize(path) == total:  # once, after the first chunk
            write(path, [f"{k},{k % 100},5" for k in range(1000)])

    with pytest.raises(IngestError, match=r"r\.csv: changed while it was read \(size 28590 -> 87"):
        ingest_file(path, tmp_path / "s.zarr", chunk_rows=500, progress=rewrite)
    assert_nothing_at(tmp_path / "s.zarr")


def test_fsspec_url(tmp_path):
    records = make_ratings(5)
    fs = fsspec.filesystem("memory")
    target = f"/{tmp_path.name}/ratings.csv"
    fs.pipe(target, "".join(f"{u},{i},{r}\n" for u, i, r in records).encode())
    try:
        store = ingest_file(f"memory://{target}", tmp_path / "s.zarr")
    finally:
        fs.rm(target)
    assert contents(store) == expected(records)


def test_columns_header_and_delimiter_choices(tmp_path):
    records = make_ratings(6)
    named = write(
        tmp_path / "a.csv", ["ts,item,user,score"] + [f"7,{i},{u},{r}" for u, i, r in records]
    )
    store = ingest_file(named, tmp_path / "a.zarr", columns=["user", "item", "score"])
    assert contents(store) == expected(records)
    plain = write(tmp_path / "b.txt", [f"{r};{u};{i}" for u, i, r in records])
    store = ingest_file(
        plain, tmp_path / "b.zarr", "delimited", delimiter=";", header=False, columns=[1, 2, 0]
    )
    assert contents(store) == expected(records)
    with pytest.raises(IngestError, match="no column named 'rating'"):
        ingest_file(named, tmp_path / "c.zarr", columns=["user", "item", "rating"])
    with pytest.raises(IngestError, match="no header"):
        ingest_file(plain, tmp_path / "c.zarr", "tsv", header=False, columns=["a", "b", "c"])
    with pytest.raises(IngestError, match="no column 1: the input has 1 column"):
        ingest_file(plain, tmp_path / "c.zarr", "csv")  # wrong delimiter
    assert_nothing_at(tmp_path / "c.zarr")


# name: (lines, the user ids read)
HEADER_GUESS = {
    "quoted numbers": (['"1","10","4"', '"2","20","3"'], [1, 2]),
    "quoted rating": (['1,10,"4"', '2,20,"3"'], [1, 2]),
    "spaced numbers": (["1, 10, 4 ", "2,20,3"], [1, 2]),
    "exponent": (["1,10,1e0", "2,20,3"], [1, 2]),
    "quoted header": (['"user","item","rating"', '"1","10","4"'], [1]),
    "spaced header": ([" user , item , stars ", "1,10,4"], [1]),
    "quoted delimiter": (['"Smith, J",item1,5', '"Doe, J",item2,4'], ["Smith, J", "Doe, J"]),
}


@pytest.mark.parametrize("case", list(HEADER_GUESS))
def test_line_one_is_a_header_only_when_its_rating_reads_as_a_name(tmp_path, case):
    """Line 1 is split as every line is (quotes and all) before it is judged."""
    lines, users = HEADER_GUESS[case]
    store = ingest_file(write(tmp_path / "r.csv", lines), tmp_path / "s.zarr", test_fraction=0)
    assert store.ids("rows").tolist() == users


# name: (format, extra options, lines)
SPACED = {
    "csv": ("csv", {}, ["1 ,10 , 4 ", ' "2" ,\t20\t,3', "u , i ,r "]),
    "tsv": ("tsv", {}, ["1 \t 10 \t4 ", "2\t20 \t 3", "u\ti\tr "]),
    "double-colon": ("delimited", {"delimiter": "::"}, ["1 :: 10::4 ", "2::20 ::3", "u::i::r"]),
}


@pytest.mark.parametrize("case", list(SPACED))
def test_fields_are_stripped_on_both_sides(tmp_path, case):
    """'1 ' is user 1 (the parser strips leading whitespace only): ids stay integers."""
    fmt, options, lines = SPACED[case]
    path = write(tmp_path / "r.txt", lines[:2])
    store = ingest_file(path, tmp_path / "s.zarr", fmt, test_fraction=0, **options)
    assert contents(store) == {(1, 10): 4.0, (2, 20): 3.0}
    named = write(tmp_path / "n.txt", [lines[2], *lines[:2]])
    store = ingest_file(named, tmp_path / "n.zarr", fmt, columns=["u", "i", "r"], **options)
    assert contents(store) == {(1, 10): 4.0, (2, 20): 3.0}


def test_text_ids_stay_strings_unless_plain_integers(tmp_path):
    path = write(tmp_path / "r.csv", ["007,1,4", "8,2,3", "9,01,5"])
    store = ingest_file(path, tmp_path / "s.zarr")
    assert store.ids("rows").tolist() == ["007", "8", "9"]
    assert store.ids("cols").tolist() == ["1", "2", "01"]
    path = write(tmp_path / "q.csv", ["17,-3,4", "5,2,3"])
    store = ingest_file(path, tmp_path / "q.zarr")
    assert store.ids("rows").tolist() == [17, 5]
    assert store.ids("cols").tolist() == [-3, 2]


def test_one_number_written_two_ways_is_refused(tmp_path):
    """'1' and '1.0' kept as text would be two users (as Parquet, 1 and 1.0 are one)."""
    (tmp_path / "g").mkdir()
    write(tmp_path / "g" / "a.csv", ["1,10,4", "x,20,3"])
    write(tmp_path / "g" / "b.csv", ["1.0,10,2", "1.5,20,1"])
    with pytest.raises(IngestError, match=r"a\.csv and \S*b\.csv: user ids '1' and '1\.0' are one "
                       "number written two ways"):  # fmt: skip
        ingest_file(str(tmp_path / "g" / "*.csv"), tmp_path / "s.zarr")
    path = write(tmp_path / "c.csv", ["1e3,1,4", "x,2,3", "+1000,3,2"])
    with pytest.raises(IngestError, match=r"user ids '1e3' and '\+1000' .* \(such as 1000\)"):
        ingest_file(path, tmp_path / "s.zarr")


# ----------------------------------------------------------------------------- in memory


def test_arrays_map_ids_and_declared_shape(tmp_path):
    records = make_ratings(7, ids="int")
    users, items, vals = (np.array(x) for x in zip(*records, strict=True))
    mapped = ingest_arrays(tmp_path / "a.zarr", users, items, vals, chunk_rows=7)
    assert contents(mapped) == expected(records)
    assert mapped.ids("rows").dtype.kind == "i"
    rng = np.random.default_rng(7)
    rows, cols = rng.permutation(40)[:20] % 5, rng.permutation(20) % 8
    flat = np.unique(rows * 8 + cols)
    dense = ingest_arrays(tmp_path / "b.zarr", flat // 8, flat % 8, flat % 5 + 1.5, shape=(6, 9))
    assert dense.ids("rows") is None and dense.ids("cols") is None
    assert (dense.m, dense.n) == (6, 9)
    assert contents(dense) == {(f // 8, f % 8): f % 5 + 1.5 for f in flat.tolist()}


def test_object_arrays_of_integers_keep_integer_ids(tmp_path):
    users = np.array([3, np.int64(7), np.int32(3)], object)
    store = ingest_arrays(tmp_path / "s.zarr", users, [1, 1, 2], [1.0, 2.0, 3.0])
    assert store.ids("rows").dtype == np.int64 and store.ids("rows").tolist() == [3, 7]


def test_dataframe_and_scipy(tmp_path):
    records = make_ratings(8)
    df = pd.DataFrame(records, columns=["who", "what", "stars"])
    store = ingest_dataframe(df, tmp_path / "a.zarr", "who", "what", "stars")
    assert contents(store) == expected(records)
    assert store.source == {"kind": "dataframe", "columns": ["who", "what", "stars"]}
    with pytest.raises(IngestError, match="no column 'user'"):
        ingest_dataframe(df, tmp_path / "b.zarr")
    matrix = sp.random(
        15, 11, density=0.3, format="csr", random_state=8, data_rvs=lambda k: np.arange(1, k + 1)
    )
    store = ingest_scipy(matrix, tmp_path / "c.zarr")
    coo = matrix.tocoo()
    assert (store.m, store.n) == (15, 11)
    assert store.ids("rows") is None
    assert contents(store) == dict(zip(zip(*coo.coords, strict=True), coo.data, strict=True))


def test_arrays_errors(tmp_path):
    with pytest.raises(IngestError, match="one length"):
        ingest_arrays(tmp_path / "a.zarr", [1, 2], [1], [3.0, 4.0])
    with pytest.raises(IngestError, match=r"record 1: rating inf is not a finite"):
        ingest_arrays(tmp_path / "a.zarr", [1, 2], [1, 2], [3.0, np.inf])
    with pytest.raises(IngestError, match=r"record 1: item id 4 is not an integer in \[0, 4\)"):
        ingest_arrays(tmp_path / "a.zarr", [0, 1], [1, 4], [3.0, 2.0], shape=(2, 4))
    with pytest.raises(IngestError, match=r"user 'b', item 'x' \(records 1 and 2\)"):
        ingest_arrays(tmp_path / "a.zarr", ["a", "b", "b"], ["x", "x", "x"], [1.0, 2.0, 3.0])
    for ratings in (np.array([1 + 2j, 3]), np.array([1, 2], "m8[s]")):
        message = re.escape(f"ratings of dtype {ratings.dtype} are not real numbers")
        with pytest.raises(IngestError, match=message):
            ingest_arrays(tmp_path / "a.zarr", [0, 1], [1, 0], ratings)
    df = pd.DataFrame({"user": pd.array([3, None], "Int64"), "item": [1, 2], "rating": [1.0, 2.0]})
    with pytest.raises(IngestError, match=r"^record 1: the user id is missing"):
        ingest_dataframe(df, tmp_path / "a.zarr")
    with pytest.raises(IngestError, match=r"record 1: item id 2\.5 is not a whole number"):
        ingest_arrays(tmp_path / "a.zarr", [0, 1], [1.0, 2.5], [3.0, 2.0])
    for users, pair in (([1, "1"], "1 and '1'"), ([b"a", "a"], "b'a' and 'a'")):
        with pytest.raises(IngestError, match=f"^the input: user ids {pair} are different ids"):
            ingest_arrays(tmp_path / "a.zarr", np.array(users, object), [1, 2], [3.0, 2.0])
    with pytest.raises(IngestError, match=r"ratings of user 0, item 0 \(records 0 and 2\) sum "
                       r"to 1\.5e\+09, beyond \+-1e\+09"):  # fmt: skip
        ingest_arrays(tmp_path / "a.zarr", [0, 1, 0], [0, 0, 0], [1e9, 1.0, 5e8], duplicates="sum")
    with pytest.raises(IngestError, match=r"scipy\.sparse"):
        ingest_scipy(np.ones((2, 2)), tmp_path / "a.zarr")
    assert_nothing_at(tmp_path / "a.zarr")


# ----------------------------------------------------------------------------- shape, duplicates


def test_declared_shape_uses_ids_as_indices(tmp_path):
    path = write(tmp_path / "r.csv", ["3,0,4.5", "0,7,2", "9,2,1"])
    store = ingest_file(path, tmp_path / "s.zarr", m=10, n=8)
    assert (store.m, store.n) == (10, 8)
    assert store.ids("rows") is None and store.ids("cols") is None
    assert contents(store) == {(3, 0): 4.5, (0, 7): 2.0, (9, 2): 1.0}
    half = ingest_file(path, tmp_path / "h.zarr", m=10)  # items mapped, users not
    assert half.ids("rows") is None and half.ids("cols").tolist() == [0, 7, 2]


@pytest.mark.parametrize("policy, value", [("last", 3.5), ("mean", (2 + 5 + 3.5) / 3)])
def test_duplicate_policies(tmp_path, policy, value):
    path = write(tmp_path / "r.csv", ["a,x,2", "b,x,1", "a,x,5", "a,x,3.5"])
    store = ingest_file(path, tmp_path / "s.zarr", duplicates=policy, chunk_rows=2)
    assert contents(store) == {("a", "x"): pytest.approx(value), ("b", "x"): 1.0}


# ----------------------------------------------------------------------------- split, chunks


def test_split_deterministic_and_independent_of_chunking(tmp_path):
    records = make_ratings(9, k=400, users=40, items=30)
    path = write(tmp_path / "r.csv", [f"{u},{i},{r}" for u, i, r in records])

    def split(name, seed, chunk_rows):
        store = ingest_file(
            path, tmp_path / name, test_fraction=0.25, split_seed=seed, chunk_rows=chunk_rows
        )
        rows, cols = store.ids("rows").tolist(), store.ids("cols").tolist()
        r, c, _ = store.read_coo("row", split="test")
        return store, {(rows[a], cols[b]) for a, b in zip(r.tolist(), c.tolist(), strict=True)}

    store, test = split("a.zarr", 3, 1_000_000)
    _, same = split("b.zarr", 3, 7)
    _, other = split("c.zarr", 4, 1_000_000)
    assert test == same != other
    assert 60 <= len(test) <= 140 and store.nnz + store.nnz_test == 400
    assert contents(store) == expected(records)


def test_small_chunks_build_the_same_store(tmp_path):
    records = make_ratings(10)
    path = write(tmp_path / "r.csv", ["u,i,r"] + [f"{u},{i},{r}" for u, i, r in records] + [""])
    one = ingest_file(path, tmp_path / "a.zarr")
    many = ingest_file(path, tmp_path / "b.zarr", chunk_rows=7)
    for kind in ("row", "col"):
        for a, b in zip(one.read_coo(kind), many.read_coo(kind), strict=True):
            np.testing.assert_array_equal(a, b)
    for axis in ("rows", "cols"):
        np.testing.assert_array_equal(one.ids(axis), many.ids(axis))
    assert one.attrs["stats"] == many.attrs["stats"]


def test_progress_reports_bytes(tmp_path):
    records = make_ratings(11)
    path = write(tmp_path / "r.csv", [f"{u},{i},{r}" for u, i, r in records])
    calls = []
    ingest_file(path, tmp_path / "s.zarr", chunk_rows=5, progress=lambda *a: calls.append(a))
    reads = [c for c in calls if c[0] == "read"]
    size = os.path.getsize(path)
    assert len(reads) == 12
    assert [d for _, d, _ in reads] == sorted(d for _, d, _ in reads)
    assert reads[-1] == ("read", size, size)
    assert calls[-1][0] == "bands" and calls[-1][1] == calls[-1][2]


def test_from_config(tmp_path):
    records = make_ratings(12, ids="int")
    path = write(tmp_path / "u.data", [f"{u}\t{i}\t{r:g}\t1" for u, i, r in records])
    cfg = DataConfig(
        store=str(tmp_path / "s.zarr"), test_fraction=0.2, split_seed=1,
        ingest=IngestConfig(path=path, format="movielens-100k"),
    )  # fmt: skip
    store = ingest_from_config(cfg)
    assert store.url == cfg.store and store.nnz_test > 0
    assert contents(store) == expected(records)
    with pytest.raises(ConfigError, match=r"ingest\.path is empty"):
        ingest_from_config(DataConfig())


def test_a_file_store_records_what_built_it(tmp_path):
    """The input (resolved, its size and time) and every setting that shapes the ratings,
    as JSON numbers whatever the caller passed: what a config's reuse of it is checked on."""
    path = write(tmp_path / "r.csv", ["0,1,3", "1,0,4", "2,2,5"])
    store = ingest_file(path, tmp_path / "s.zarr", columns=(np.int64(0), 1, 2), m=np.int64(3),
                        test_fraction=0.0, split_seed=np.int64(7))  # fmt: skip
    source = store.source
    assert (source["path"], source["resolved"], source["files"], source["bytes"]) == (
        path, str(tmp_path / "r.csv"), 1, 18)  # fmt: skip
    assert source["modified"].startswith(str(time.gmtime().tm_year))
    settings = {key: source[key] for key in ("format", "delimiter", "header", "columns",
                "duplicates", "m", "n", "test_fraction", "split", "split_seed")}  # fmt: skip
    assert settings == {"format": "csv", "delimiter": None, "header": None,
                        "columns": [0, 1, 2], "duplicates": "error", "m": 3, "n": None,
                        "test_fraction": 0.0, "split": "pairs", "split_seed": 7}  # fmt: skip


# ----------------------------------------------------------------------------- bad input

GOOD = [f"u{k},i{k % 5},{k % 4 + 1}" for k in range(8)]
GOOD_INTS = ["1,10,4", "2,20,3"]
BAD_TEXT = {
    "too many fields": ([*GOOD, "a,b,3,4"], 9, "4 fields where lines have 3", {}),
    "too few fields": ([*GOOD, "a,b"], 9, "a field is missing", {}),
    "not a number": ([*GOOD, "a,b,good"], 9, "rating 'good' is not a finite number", {}),
    "nan": ([*GOOD, "a,b,NaN"], 9, "rating 'NaN' is not a finite number", {}),
    "inf": ([*GOOD, "a,b,-inf"], 9, "rating '-inf' is not a finite number", {}),
    "blank lines count": ([*GOOD[:2], "", "a,b,x"], 4, "rating 'x'", {}),
    "blank lines first": (["", " ", "u,i,r", *GOOD[:2], "a,b,x"], 6, "rating 'x'", {}),
    "empty file": ([], 1, "the file is empty", {}),
    "only blank lines": (["", "  "], 1, "the file is empty", {}),
    "NA on line 1": (["a,b,NA", *GOOD], 1, "rating 'NA' is not a finite number", {}),
    "no rating on line 1": (["a,b,", *GOOD], 1, "a field is missing", {}),
    "decimal comma": (["a;b;4,5", "c;d;3"], 1, "rating '4,5' is not a finite number",
                      {"format": "delimited", "delimiter": ";"}),
    "comment": (["# ratings of 2024", *GOOD], 1,
                "'# ratings of 2024' looks like a comment; comment lines are not supported", {}),
    "comment further on": ([*GOOD[:3], "# more", *GOOD[3:]], 4,
                           "'# more' looks like a comment", {}),
    "out of range": (["1,2,3", "0,0,1", "4,1,2"], 3, "user id '4' is not an integer in [0, 4)",
                     {"m": 4, "n": 3}),
    "not an integer": (["1,2,3", "0,1.5,1"], 2, "item id '1.5' is not an integer", {"n": 3}),
    "not a number id": (["1,2,3", "x,1,1"], 2, "user id 'x' is not an integer", {"m": 3}),
    "duplicate": ([*GOOD, "u3,i3,1"], "lines 4 and 9", "user 'u3', item 'i3'", {}),
    "duplicate with spaces": ([*GOOD, "u3 ,i3\t,1"], "lines 4 and 9", "user 'u3', item 'i3'", {}),
    "bad rating on line 1": (["1,10,5stars", *GOOD], 1, "rating '5stars' is not a finite", {}),
    "underscore in rating": ([*GOOD, "a,b,1_0"], 9, "rating '1_0' is not a finite number", {}),
    "non-ASCII digits": ([*GOOD, "a,b,\u0661\u0660"], 9, "is not a finite number", {}),
    "blank lines of whitespace": ([*GOOD[:2], " \t ", "\r", "a,b,x"], 5, "rating 'x'", {}),
    "only delimiters": ([*GOOD[:2], ",,", *GOOD[2:]], 3, "a field is missing", {}),
    "only quotes": ([*GOOD[:2], '"","",""'], 3, "a field is missing", {}),
    "only tabs": (["a\tb\t1", "\t\t", "c\td\t2"], 2, "a field is missing", {"format": "tsv"}),
    "short line, two-character delimiter": (["a::b::1", " ", "c::d"], 3, "a field is missing",
                                            {"format": "delimited", "delimiter": "::"}),
    "extra field on line 1": (["1\t10\t5\t88\t99", "2\t20\t3\t88"], 1,
                              "5 fields where lines have 4", {"format": "movielens-100k"}),
    "header shorter than data": (["user,item,rating", "1,10,5,123", "2,20,3,456"], 2,
                                 "4 fields where the header (line 1) names 3", {}),
    "header asked for on a rating": (GOOD_INTS, 1, "reads as a rating; drop --header",
                                     {"header": True}),
    "quote never closed": ([*GOOD, 'a,b,"3', *GOOD], 9,
                           'a quote (") opens a field that is never closed', {}),
    "NUL byte past the first block": ([*(f"{k},{k},3" for k in range(2000)), "5\0,2,3"], 2001,
                                      "not a text file: it holds binary data", {}),
    "quoted line break before": (['u,i,r', '"c', 'd",20,3', "", '"e', '', 'f",2,1', "3,30,x"], 8,
                                 "rating 'x'", {}),
    "quoted line break before too many fields": ([*GOOD, '"c', 'd",20,3', "", "3,30,5,6"], 12,
                                                 "4 fields where lines have 3", {}),
    "quoted line break before a quote never closed": (['"c', 'd",20,3', *GOOD, '3,30,"5'], 11,
                                                      "a quote (\") opens a field that", {}),
    "quote with a delimiter of several characters": (["a||b||1", '"c||d"||e||2'], 2,
                                                     "quotes do not keep a field together",
                                                     {"format": "delimited", "delimiter": "||"}),
    "long values cut": ([*GOOD, f"{'u' * 10**5},1,{'9' * 10**5}x"], 9, "rating '999", {}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_TEXT))
@pytest.mark.parametrize("chunk_rows", [3, 1000])
def test_bad_text_input(tmp_path, case, chunk_rows):
    lines, line, words, kwargs = BAD_TEXT[case]
    path = write(tmp_path / "bad.csv", lines)
    url = tmp_path / "s.zarr"
    with pytest.raises(IngestError) as info:
        ingest_file(path, url, chunk_rows=chunk_rows, **kwargs)
    message = str(info.value)
    where = f"line {line}" if isinstance(line, int) else line
    assert f"bad.csv, {where}" in message and words in message and len(message) < 400
    assert_nothing_at(url)


def test_quoted_line_breaks_and_blank_lines(tmp_path):
    """A quoted field holding line breaks: the rows after it keep their lines, and blank
    lines (a trailing one too) are skipped."""
    path = write(tmp_path / "q.csv", ["user,item,rating", '"c', 'd",20,3', "", "3,30,5", ""])
    for chunk_rows in (1, 1000):
        store = ingest_file(path, tmp_path / f"s{chunk_rows}.zarr", chunk_rows=chunk_rows)
        assert contents(store) == {("c\nd", 20): 3.0, ("3", 30): 5.0}


def test_text_that_is_not_utf8_names_its_line(tmp_path):
    lines = [f"{k},{k % 7},3" for k in range(1000)]
    lines[500] = "5\xe9,1,3"
    path = tmp_path / "latin.csv"
    path.write_bytes("".join(f"{line}\n" for line in lines).encode("latin-1"))
    with pytest.raises(IngestError, match=r"latin\.csv, line 501: byte 0xe9 is not UTF-8.*iconv"):
        ingest_file(path, tmp_path / "s.zarr")


def test_bad_options_and_missing_files(tmp_path):
    path = write(tmp_path / "h.csv", ["user,item,rating"])
    with pytest.raises(IngestError, match="no ratings found"):
        ingest_file(path, tmp_path / "s.zarr")
    with pytest.raises(ConfigError, match="'netflix' is fixed: drop delimiter"):
        ingest_file(path, tmp_path / "s.zarr", "netflix", delimiter=";")
    with pytest.raises(ConfigError, match="'parquet' takes no delimiter or header"):
        ingest_file(path, tmp_path / "s.zarr", "parquet", header=True)
    with pytest.raises(ConfigError, match="three columns"):
        ingest_file(path, tmp_path / "s.zarr", columns=["user", "item"])
    with pytest.raises(IngestError, match=r"nope\.csv: no such file"):
        ingest_file(tmp_path / "nope.csv", tmp_path / "s.zarr")
    with pytest.raises(IngestError, match="no file matches"):
        ingest_file(str(tmp_path / "*.nope"), tmp_path / "s.zarr")
    with pytest.raises(IngestError, match=r"is a directory, not a ratings file; .*/\*\.csv"):
        ingest_file(tmp_path, tmp_path / "s.zarr")
    with pytest.raises(ConfigError, match="unknown format 'xls'"):
        ingest_file(path, tmp_path / "s.zarr", "xls")
    os.mkfifo(tmp_path / "fifo")
    for special, kind in ((tmp_path / "fifo", "a pipe"), ("/dev/null", "a device")):
        with pytest.raises(IngestError, match=f"is {kind}, not a file .* save the ratings"):
            ingest_file(special, tmp_path / "s.zarr")
    assert_nothing_at(tmp_path / "s.zarr")


def test_globs_of_question_marks_and_brackets(tmp_path):
    write(tmp_path / "r1.csv", ["1,10,5"])
    write(tmp_path / "r2.csv", ["2,20,3"])
    for pattern in ("r?.csv", "r[12].csv"):
        store = ingest_file(str(tmp_path / pattern), tmp_path / f"{pattern}.zarr", test_fraction=0)
        assert contents(store) == {(1, 10): 5.0, (2, 20): 3.0}
    with pytest.raises(IngestError, match=r"r\[34\]\.csv: no file matches"):
        ingest_file(str(tmp_path / "r[34].csv"), tmp_path / "s.zarr")


def test_zip_archive_is_refused_by_name(tmp_path):
    """fsspec would read a .zip's first member only: refused, naming the members."""
    with zipfile.ZipFile(tmp_path / "r.zip", "w") as archive:
        archive.writestr("a.csv", "1,2,3\n")
        archive.writestr("b.csv", "2,1,4\n")
    with pytest.raises(IngestError, match=r"r\.zip: a zip archive \(holding a\.csv, b\.csv\); "
                       "unzip it and give the ratings file inside"):  # fmt: skip
        ingest_file(tmp_path / "r.zip", tmp_path / "s.zarr")
    assert_nothing_at(tmp_path / "s.zarr")


class _CtrlC:
    """A file that gets Ctrl-C (SIGINT, as from a terminal) in its second read."""

    def __init__(self, data):
        self.data, self.reads = data, 0

    def read(self, size=-1):
        self.reads += 1
        if self.reads == 2:
            signal.raise_signal(signal.SIGINT)
        return self.data.read(size)


class _InterruptedFiles(Files):
    @contextmanager
    def open(self, k):
        with super().open(k) as (data, raw):
            yield _CtrlC(data), raw


def test_ctrl_c_while_reading_is_an_interrupt(tmp_path, monkeypatch, capsys):
    """pandas drops the KeyboardInterrupt of a SIGINT in its read for a ParserError ('Calling
    read(nbytes) on source failed'): still an interrupt (exit 130), not a broken file (3)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch.setattr("cumf_dask.data.ingest.Files", _InterruptedFiles)
    path = write(tmp_path / "r.csv", [f"{k},{k % 7},3" for k in range(2000)])
    try:
        assert main(["ingest", path, "-o", str(tmp_path / "s.zarr")]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "interrupted" in capsys.readouterr().err
    assert_nothing_at(tmp_path / "s.zarr")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"test_fraction": 1.0}, r"'test_fraction' must be < 1"),
        ({"test_fraction": -0.1}, r"'test_fraction' must be >= 0"),
        ({"split_seed": -1}, r"'split_seed' must be an integer in \[0, 2\*\*63\)"),
        ({"tile_rows": 0}, r"'tile_rows' must be >= 1"),
        ({"tile_cols": 2.5}, r"'tile_cols' must be an integer"),
        ({"chunk_rows": 0}, r"'chunk_rows' must be >= 1"),
        ({"duplicates": "first"}, r"'duplicates' must be one of 'error', 'last', 'mean'"),
        ({"duplicates": "sum", "rating_min": 0}, r"duplicates='sum' .* declare no scale"),
    ],
)
def test_bad_arguments_are_config_errors(tmp_path, kwargs, match):
    """An argument out of range is a ConfigError (exit 2), named; bad data an IngestError."""
    path = write(tmp_path / "r.csv", GOOD)
    with pytest.raises(ConfigError, match=match):
        ingest_file(path, tmp_path / "s.zarr", **kwargs)
    with pytest.raises(ConfigError, match=match):
        ingest_arrays(tmp_path / "s.zarr", [0, 1], [1, 0], [1.0, 2.0], **kwargs)
    assert_nothing_at(tmp_path / "s.zarr")


@pytest.mark.parametrize("shape", [(2,), 5, (1, 2, 3)])
def test_a_shape_that_is_no_pair_is_a_config_error(tmp_path, shape):
    with pytest.raises(ConfigError, match=r"^shape must be \(m, n\)"):
        ingest_arrays(tmp_path / "s.zarr", [0, 1], [0, 1], [1.0, 2.0], shape)
    assert_nothing_at(tmp_path / "s.zarr")


def test_existing_store_survives_bad_input(tmp_path):
    records = make_ratings(13)
    good = write(tmp_path / "good.csv", [f"{u},{i},{r}" for u, i, r in records])
    url = tmp_path / "s.zarr"
    before = contents(ingest_file(good, url))
    with pytest.raises(StoreError, match="already exists"):
        ingest_file(good, url)
    bad = write(tmp_path / "bad.csv", [f"{u},{i},{r}" for u, i, r in records] + ["x,y,z"])
    with pytest.raises(IngestError, match=r"bad\.csv, line 61"):
        ingest_file(bad, url, overwrite=True)
    dup = write(tmp_path / "dup.csv", [f"{u},{i},{r}" for u, i, r in records * 2])
    with pytest.raises(IngestError, match=r"dup\.csv, lines 1 and 61"):
        ingest_file(dup, url, overwrite=True)
    assert contents(RatingsStore.open(url)) == before
    assert_no_work_folder(url)


def test_remote_store_survives_bad_input(tmp_path):
    """A remote target is built in place: what the data can fail, it fails before the old
    store there is touched."""
    url = f"memory://{tmp_path.name}/s.zarr"
    try:
        before = contents(ingest_arrays(url, [1, 2], [1, 2], [1.0, 2.0], test_fraction=0))
        for duplicates, ratings in (("error", [1.0, 2.0]), ("sum", [9e8, 9e8])):
            with pytest.raises(IngestError, match=r"duplicate rating|sum to"):
                ingest_arrays(url, [1, 1], [1, 1], ratings, duplicates=duplicates,
                              overwrite=True, test_fraction=0)  # fmt: skip
        assert contents(RatingsStore.open(url)) == before
    finally:
        fsspec.filesystem("memory").rm(f"/{tmp_path.name}", recursive=True)


def test_remote_target_that_is_not_a_store_is_never_replaced(tmp_path):
    """A URL holding a folder of files, or a file, is refused as a local path is, overwrite
    or not (zarr took it for nothing there and wrote over it); an empty folder is fine."""
    fs = fsspec.filesystem("memory")
    root = f"/{tmp_path.name}"
    fs.pipe({f"{root}/f2/keep.txt": b"keep", f"{root}/notes.txt": b"notes"})
    fs.mkdir(f"{root}/empty")
    try:
        for name in ("f2", "notes.txt"):
            with pytest.raises(StoreError, match=rf"^memory://{root}/{name}: exists and is not "
                               "a cumf-dask rating store; refusing to replace it"):  # fmt: skip
                ingest_arrays(f"memory://{root}/{name}", [1, 2], [1, 2], [1.0, 2.0],
                              overwrite=True)  # fmt: skip
        assert fs.cat(f"{root}/f2/keep.txt") == b"keep" and fs.cat(f"{root}/notes.txt") == b"notes"
        store = ingest_arrays(f"memory://{root}/empty", [1, 2], [1, 2], [1.0, 2.0], test_fraction=0)
        assert store.nnz == 2
    finally:
        fs.rm(root, recursive=True)


# ----------------------------------------------------------------------------- declared sizes


@pytest.mark.parametrize("kwargs", [{"m": 0}, {"m": -5}, {"n": 0}, {"m": 2.5}])
def test_declared_sizes_below_one_are_config_errors(tmp_path, kwargs):
    """Checked before reading: the (missing) file is never looked at."""
    name = next(iter(kwargs))
    rule = "an int" if kwargs[name] == 2.5 else ">= 1"
    with pytest.raises(ConfigError, match=f"^{name} must be {rule} "):
        ingest_file(tmp_path / "nope.csv", tmp_path / "s.zarr", **kwargs)
    shape = (kwargs.get("m"), kwargs.get("n"))
    with pytest.raises(ConfigError, match=f"^{name} must be {rule} "):
        ingest_arrays(tmp_path / "s.zarr", [0, 1], [1, 0], [1.0, 2.0], shape)
    assert_nothing_at(tmp_path / "s.zarr")


def test_shape_beyond_memory_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    path = write(tmp_path / "r.csv", ["0,1,3", "1,0,4"])
    url = tmp_path / "s.zarr"
    with pytest.raises(PlanError, match=r"m=99,999,999,999,999, n=50 cannot be built on "
                       r"this machine: .*800,000\.0 GB for 8-byte rating counts .*map the ids"):
        ingest_file(path, url, m=99_999_999_999_999, n=50)
    monkeypatch.setattr(limits, "available_memory", lambda: 1_000_000)  # 1 MB
    with pytest.raises(PlanError, match=r"m=1,000,000 cannot be built.* 0\.0 GB is available"):
        ingest_arrays(url, [0, 1], [1, 0], [1.0, 2.0], (1_000_000, None))
    with pytest.raises(PlanError, match="raise tile_rows and tile_cols"):  # bands dominate
        ingest_file(path, url, m=100_000, n=2, tile_rows=1, tile_cols=1)
    assert_nothing_at(url)
    assert not os.path.exists(f"{url}.lock")


def test_sparse_declared_shape_makes_few_bands(tmp_path):
    """A declared m far above the ratings gets taller tiles (whole spill bands merged), not
    thousands of empty bands; given tile_rows are kept."""
    rng = np.random.default_rng(3)
    m = 1 << 23
    users = rng.choice(m, 40, replace=False)
    records = [(int(u), int(k % 7), float(k % 5 + 1)) for k, u in enumerate(users)]
    path = write(tmp_path / "r.csv", [f"{u},{i},{r}" for u, i, r in records])
    store = ingest_file(path, tmp_path / "s.zarr", m=m, n=7, test_fraction=0.2)
    assert (store.m, store.tile_rows, store.n_row_tiles) == (m, 1 << 22, 2)
    assert contents(store) == expected(records)
    counts = store.counts("row")
    assert counts.sum() == store.nnz and counts[users].sum() == store.nnz
    given = ingest_file(path, tmp_path / "g.zarr", m=m, n=7, tile_rows=1 << 21)
    assert (given.tile_rows, given.n_row_tiles) == (1 << 21, 4)
    twice = write(tmp_path / "twice.csv", [f"{u},{i},{r}" for u, i, r in records * 2])
    summed = ingest_file(twice, tmp_path / "d.zarr", m=m, n=7, duplicates="sum",
                         split="users", test_fraction=0.5)  # fmt: skip
    assert summed.n_row_tiles == 2
    assert contents(summed) == {k: 2 * v for k, v in expected(records).items()}


def test_rows_of_many_ratings_get_small_bands_when_ids_are_mapped(tmp_path, monkeypatch):
    """Ids mapped (no shape declared) spill SPILL_TILE rows a band, merged up to what the
    final shape wants: rows of many ratings (default_tile below the spill tile; here made
    so with a smaller target) get bands of SPILL_TILE rows, not 65,536, so a block load
    decodes little beyond its rows."""
    from cumf_dask.data import spill
    from cumf_dask.data.store import default_tile

    monkeypatch.setattr(spill, "default_tile", functools.partial(default_tile, target=8_000))
    users = np.repeat(np.arange(3 * spill.SPILL_TILE), 4)
    items = np.tile(np.arange(4), 3 * spill.SPILL_TILE)
    store = ingest_arrays(tmp_path / "s.zarr", users * 7 + 1, items, users % 5 + 1.0,
                          test_fraction=0.0)
    assert (store.tile_rows, store.n_row_tiles) == (spill.SPILL_TILE, 3)
    np.testing.assert_array_equal(store.counts("row"), np.full(store.m, 4))
    assert store.ids("rows").tolist() == (np.arange(store.m) * 7 + 1).tolist()


@pytest.mark.parametrize("split", ["pairs", "users"])
def test_a_spill_per_chunk_builds_the_same_store(tmp_path, monkeypatch, split):
    """Ratings spilled in many files (SPILL_BUFFER of 1 byte: a file per chunk and kind, each
    sorted by spill band) build the store one spill does: a band gathered from every file,
    spill bands merged, repeats across chunks resolved by record order (the last kept)."""
    from cumf_dask.data import spill

    rng = np.random.default_rng(11)
    users = rng.integers(0, 4 * spill.SPILL_TILE, 30_000)  # mapped: ~4 spill bands, merged
    items = rng.integers(0, 5, users.size)
    ratings = rng.integers(1, 6, users.size).astype(float)
    options = dict(duplicates="last", test_fraction=0.25, split=split, chunk_rows=1_000)
    one = ingest_arrays(tmp_path / "one.zarr", users, items, ratings, **options)
    monkeypatch.setattr(spill, "SPILL_BUFFER", 1)
    many = ingest_arrays(tmp_path / "many.zarr", users, items, ratings, **options)
    assert one.n_row_tiles < -(-one.m // spill.SPILL_TILE)
    for kind, part in (("row", "train"), ("row", "test"), ("col", "train")):
        for a, b in zip(one.read_coo(kind, split=part), many.read_coo(kind, split=part),
                        strict=True):  # fmt: skip
            np.testing.assert_array_equal(a, b)
    records = zip(users.tolist(), items.tolist(), ratings.tolist(), strict=True)
    assert contents(many) == expected(records)
    assert one.attrs["stats"] == many.attrs["stats"]


def test_id_maps_shorter_than_the_ratings_use_are_refused(tmp_path):
    """Id maps given to the builder name at least every row and column the ratings use:
    a shorter one would drop ratings silently or read as a damaged store."""
    from cumf_dask.data.spill import build_store

    url = tmp_path / "s.zarr"
    rows, cols, vals = [0, 1, 5, 9], [0, 1, 2, 3], [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(IngestError, match=r"^the row ids name 3 rows, but the ratings use row "
                       r"index 9: give one id per row \(at least 10\)$"):  # fmt: skip
        build_store(url, rows, cols, vals, row_ids=np.array([10, 11, 12]), tile_rows=4)
    with pytest.raises(IngestError, match=r"^the column ids name 2 columns, but the ratings use "
                       r"column index 3: give one id per column \(at least 4\)$"):  # fmt: skip
        build_store(url, rows, cols, vals, col_ids=np.array([7, 8]))
    assert_nothing_at(url)


def test_cli_exit_codes_of_sizes_columns_and_directories(tmp_path, capsys):
    path = write(tmp_path / "r.csv", ["0,1,3", "1,0,4"])
    out = str(tmp_path / "s.zarr")
    cases = [
        (["--m", "0"], 2, "m must be >= 1"),
        (["--n", "-5"], 2, "n must be >= 1"),
        (["--columns", "0,1"], 2, "columns must name three columns"),
        (["--columns", "0,1,-1"], 2, "position -1 is negative"),
        (["--delimiter", ""], 2, "the delimiter '' is empty"),
        (["-o", ""], 2, "the output path is empty"),
        (["--m", "99999999999999", "--n", "50"], 4, "cannot be built on this machine"),
    ]
    for extra, code, message in cases:
        assert main(["ingest", path, "-o", out, *extra]) == code
        assert message in capsys.readouterr().err
    (tmp_path / "dir").mkdir()
    assert main(["ingest", str(tmp_path / "dir"), "-o", out]) == 3
    assert "is a directory, not a ratings file" in capsys.readouterr().err
    assert_nothing_at(out)


def _fail_late_or_early(k: int) -> int:
    if k == 1:
        time.sleep(0.3)
        raise IngestError("band 1")
    if k == 2:
        raise IngestError("band 2")
    return k


def test_parallel_bands_raise_the_first_error_in_band_order():
    """Bands are written on threads; the error named is the lowest band's, not the fastest."""
    assert run_tasks(None, _fail_late_or_early, [(0,), (3,)], "bands", None) == [0, 3]
    with pytest.raises(IngestError, match="band 1"):
        run_tasks(None, _fail_late_or_early, [(0,), (1,), (2,)], "bands", None)


def test_first_alone_finishes_before_the_others_start():
    """GPU bands compile their kernels in band 0, alone; progress still counts every band."""
    log: list[tuple[str, int]] = []

    def band(k: int) -> int:
        log.append(("start", k))
        time.sleep(0.01)
        log.append(("end", k))
        return k * k

    seen: list[int] = []
    out = run_tasks(None, band, [(k,) for k in range(5)], "bands",
                    lambda _s, done, total: seen.append(done), first_alone=True)  # fmt: skip
    assert out == [0, 1, 4, 9, 16]
    assert log[:2] == [("start", 0), ("end", 0)]
    assert sorted(seen) == [1, 2, 3, 4, 5]
    with pytest.raises(IngestError, match="band 2"):
        run_tasks(None, _fail_late_or_early, [(2,), (0,)], "bands", None, first_alone=True)


def test_a_ctrl_c_says_which_bands_it_waits_for(monkeypatch):
    """A band is written whole: an interrupt cancels the bands not started and says how
    many it waits for."""
    import _thread
    import threading

    import dask

    from cumf_dask.errors import CumfWarning

    threading.Timer(0.05, _thread.interrupt_main).start()  # raised once band 0 is done
    waits = r"stopping: waiting for the [12] generate task"
    with dask.config.set(num_workers=2), pytest.raises(KeyboardInterrupt), \
            pytest.warns(CumfWarning, match=waits):  # fmt: skip
        run_tasks(None, time.sleep, [(0.2,), (1.0,), (1.0,), (1.0,)], "generate", None)


def test_formats_are_described():
    assert set(FORMATS) == {
        "csv", "tsv", "delimited", "movielens-100k", "movielens-1m", "movielens-csv",
        "netflix", "parquet",
    }  # fmt: skip


def test_build_errors_name_the_target_not_its_work_folder(tmp_path, monkeypatch):
    """The hidden work folder is gone when the message is read: it names the target."""
    from cumf_dask.data import spill

    def damaged(url, band):
        raise StoreError(f"{url}: damaged store: band 'by_col/0' is out of range")

    monkeypatch.setattr(spill, "transpose_band", damaged)
    url = tmp_path / "s.zarr"
    with pytest.raises(StoreError, match=rf"^{re.escape(str(url))}: damaged store"):
        ingest_arrays(url, [0, 1, 2], [1, 0, 1], [1.0, 2.0, 3.0])
    assert not list(tmp_path.iterdir())
