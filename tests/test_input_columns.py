"""Which columns are users, items and ratings: a header or a DataFrame whose names say so
is read by name or refused, never misread by position; input of the wrong layout (another
format, no rating column, a folder) says what to give instead."""

from __future__ import annotations

import re

import dask.dataframe as dd
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cumf_dask.cli import main
from cumf_dask.data.ingest import ingest_file
from cumf_dask.data.inputs import ingest_input
from cumf_dask.errors import ConfigError, IngestError

RECORDS = [(1, 10, 5.0), (1, 20, 3.0), (2, 10, 4.0), (3, 30, 1.0)]


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def contents(store):
    """{(user id, item id): rating} of the store, in the input's ids."""
    rows, cols = store.ids("rows").tolist(), store.ids("cols").tolist()
    r, c, v = (a.tolist() for a in store.read_coo("row", split="train"))
    return {(rows[i], cols[j]): x for i, j, x in zip(r, c, v, strict=True)}


EXPECTED = {(u, i): r for u, i, r in RECORDS}


# ----------------------------------------------------------------------------- headers


@pytest.mark.parametrize("header", [None, True])
@pytest.mark.parametrize("fmt", ["csv", "tsv"])
def test_a_header_naming_user_item_and_rating_is_read_by_name(tmp_path, fmt, header):
    sep = "," if fmt == "csv" else "\t"
    lines = [sep.join(["item", "user", "rating"])] + [f"{i}{sep}{u}{sep}{r}" for u, i, r in RECORDS]
    store = ingest_file(write(tmp_path / "r.txt", lines), tmp_path / "s.zarr", fmt,
                        header=header, test_fraction=0)  # fmt: skip
    assert contents(store) == EXPECTED


def test_a_header_whose_names_are_out_of_place_is_refused(tmp_path):
    """MovieLens columns moved: the first three would read timestamps as users."""
    lines = ["timestamp,userId,movieId,rating"] + [f"97830,{u},{i},{r}" for u, i, r in RECORDS]
    path = write(tmp_path / "r.csv", lines)
    for header in (None, True):
        with pytest.raises(IngestError, match=r"r\.csv, line 1: the column 'userId' is at "
                           r"position 1, so the first three columns .* would misread it; give "
                           r"the columns \(--columns userId,movieId,rating\)$"):  # fmt: skip
            ingest_file(path, tmp_path / "s.zarr", header=header)
    store = ingest_file(path, tmp_path / "s.zarr", columns=["userId", "movieId", "rating"],
                        test_fraction=0)  # fmt: skip
    assert contents(store) == EXPECTED
    by_position = ingest_file(path, tmp_path / "p.zarr", columns=[1, 2, 3], test_fraction=0)
    assert contents(by_position) == EXPECTED


def test_cli_refuses_a_header_out_of_place(tmp_path, capsys):
    path = write(tmp_path / "r.csv", ["item,user,score"] + [f"{i},{u},{r}" for u, i, r in RECORDS])
    assert main(["ingest", path, "-o", str(tmp_path / "s.zarr")]) == 3
    assert "--columns USER,ITEM,RATING" in capsys.readouterr().err
    assert not (tmp_path / "s.zarr").exists()


def test_a_header_in_place_or_without_roles_is_read_by_position(tmp_path):
    for header in ("userId,movieId,rating,timestamp", "who,what,stars,when"):
        lines = [header] + [f"{u},{i},{r},97830" for u, i, r in RECORDS]
        store = ingest_file(write(tmp_path / "r.csv", lines), tmp_path / "s.zarr",
                            test_fraction=0, overwrite=True)  # fmt: skip
        assert contents(store) == EXPECTED


# ----------------------------------------------------------------------------- DataFrames


@pytest.mark.parametrize("kind", ["pandas", "dask"])
def test_a_dataframe_whose_names_are_out_of_place_is_refused(tmp_path, kind):
    users, items, ratings = zip(*RECORDS, strict=True)
    df = pd.DataFrame({"movieId": items, "userId": users, "rating": ratings})
    data = df if kind == "pandas" else dd.from_pandas(df, npartitions=2)
    with pytest.raises(ConfigError, match=r"^the column 'movieId' is at position 0, .* "
                       r"when the DataFrame lacks .* reorder them "
                       r"\(df\[\['userId', 'movieId', 'rating'\]\]\) or rename them user, "
                       r"item, rating$"):  # fmt: skip
        ingest_input(data, tmp_path / "s.zarr")
    named = df.rename(columns={"movieId": "item", "userId": "user"})
    store = ingest_input(named, tmp_path / "s.zarr", test_fraction=0)
    assert contents(store) == EXPECTED


# ----------------------------------------------------------------------------- layouts


def test_movielens_1m_speaks_of_four_fields_separated_by_double_colons(tmp_path):
    csv = write(tmp_path / "r.csv", [f"{u},{i},{r}" for u, i, r in RECORDS])
    with pytest.raises(IngestError, match=r"r\.csv, line 1: a field is missing \(lines have 4 "
                       r"fields separated by '::'\); fix or remove the line$"):  # fmt: skip
        ingest_file(csv, tmp_path / "s.zarr", "movielens-1m")
    extra = write(tmp_path / "x.dat", ["1::1193::5::978300760", "1::661::3::978302109::9"])
    with pytest.raises(IngestError, match=r"x\.dat, line 2: 5 fields where lines have 4"):
        ingest_file(extra, tmp_path / "s.zarr", "movielens-1m")


@pytest.mark.parametrize("fmt", ["csv", "delimited"])
def test_double_colons_in_another_format_suggest_movielens_1m(tmp_path, fmt):
    path = write(tmp_path / "ratings.dat", ["1::1193::5::978300760", "1::661::3::978302109"])
    with pytest.raises(IngestError, match=r"ratings\.dat, line 1: the fields of this line "
                       r"\('1::1193::5::978300760'\) are separated by '::', as in MovieLens "
                       r"1M/10M ratings\.dat; use --format movielens-1m$"):  # fmt: skip
        ingest_file(path, tmp_path / "s.zarr", fmt)


def test_two_columns_ask_for_a_rating_column(tmp_path):
    message = (
        r"line 1: the input has 2 columns and no rating column; add a third column with the "
        r"rating \(for implicit feedback, a count: 1 for each interaction\)$"
    )
    path = write(tmp_path / "r.csv", [f"{u},{i}" for u, i, _ in RECORDS])
    with pytest.raises(IngestError, match=r"r\.csv, " + message):
        ingest_file(path, tmp_path / "s.zarr")
    pq.write_table(pa.table({"user": [1, 2], "item": [10, 20]}), tmp_path / "r.parquet")
    with pytest.raises(IngestError, match=r"r\.parquet: the input has 2 columns and no rating"):
        ingest_file(tmp_path / "r.parquet", tmp_path / "s.zarr", "parquet")
    with pytest.raises(IngestError, match="no column 3: the input has 3 column"):
        ingest_file(write(tmp_path / "t.csv", ["1,10,5"]), tmp_path / "s.zarr",
                    columns=[0, 1, 3])  # fmt: skip


@pytest.mark.parametrize(
    "files, fmt, glob",
    [
        ([], "parquet", "*.parquet"),
        ([], "csv", "*.csv"),
        (["part-0.parquet", "part-1.parquet", "_SUCCESS", ".part-0.parquet.crc"], "parquet",
         "*.parquet"),
        (["a.csv.gz", "b.csv.gz", "README.md"], "csv", "*.csv.gz"),
        (["mv_1.txt", "mv_2.txt", "movie_titles.csv"], "netflix", "*.txt"),
    ],
)  # fmt: skip
def test_a_folder_names_a_glob_of_its_files(tmp_path, files, fmt, glob):
    folder = tmp_path / "data"
    folder.mkdir()
    for name in files:
        (folder / name).write_bytes(b"")
    message = (
        "data: is a directory, not a ratings file; give a file in it, or a glob of its files "
        f"(such as '{folder}/{glob}')"
    )
    with pytest.raises(IngestError, match=re.escape(message) + "$"):
        ingest_file(folder, tmp_path / "s.zarr", fmt)
