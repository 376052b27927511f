"""benchmarks/report.py: tidy records -> JSON, PNG plot and a Markdown table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from report import table, write_results

RECORDS = [
    {"gpus": 1, "data": "netflix", "seconds_per_iteration": 1.23456},
    {"gpus": 2, "data": "netflix", "seconds_per_iteration": 0.7},
    {"gpus": 1, "data": "yahoomusic", "seconds_per_iteration": 3.0, "note": "cold"},
]


def test_write_results(tmp_path):
    text = write_results(
        "scaling", RECORDS, x="gpus", y="seconds_per_iteration", series="data", directory=tmp_path
    )
    document = json.loads((tmp_path / "scaling.json").read_text())
    assert document["records"] == RECORDS
    assert (document["x"], document["y"], document["series"]) == (
        "gpus",
        "seconds_per_iteration",
        "data",
    )
    assert (tmp_path / "scaling.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scaling.json", "scaling.png"]
    assert text == table(RECORDS)


def test_table_is_markdown_with_every_key():
    lines = table(RECORDS).splitlines()
    assert lines[0] == "| gpus | data       | seconds_per_iteration | note |"
    assert lines[1] == "| ---: | ---------- | --------------------: | ---- |"
    assert lines[2] == "|    1 | netflix    |                 1.235 |      |"
    assert lines[4].endswith("|                     3 | cold |")


def test_plot_without_series_and_log_axes(tmp_path):
    records = [{"nnz": 10**k, "seconds": 0.1 * k} for k in (5, 6, 7)]
    write_results("size", records, "nnz", "seconds", logx=True, directory=tmp_path)
    assert (tmp_path / "size.png").stat().st_size > 0


def test_missing_keys_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"records \[1\] have no 'gpus'"):
        write_results("bad", [{"gpus": 1, "s": 1.0}, {"s": 2.0}], "gpus", "s", directory=tmp_path)
    with pytest.raises(ValueError, match="no records"):
        write_results("bad", [], "gpus", "s", directory=tmp_path)
