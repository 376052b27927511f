"""Benchmark results: tidy records -> ``results/<name>.json``, ``results/<name>.png`` and a table.

A benchmark script collects one flat dict per measurement and calls :func:`write_results`
once at the end, e.g.::

    from report import write_results

    records = [{"gpus": 1, "data": "netflix", "seconds_per_iteration": 1.9}, ...]
    print(write_results("scaling", records, x="gpus", y="seconds_per_iteration", series="data"))

The table is Markdown, ready for ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(
    name: str,
    records: Sequence[dict[str, Any]],
    x: str,
    y: str,
    *,
    series: str | None = None,
    title: str | None = None,
    logx: bool = False,
    logy: bool = False,
    directory: str | Path = RESULTS,
) -> str:
    """Write ``<directory>/<name>.json`` and ``.png`` (y against x, one line per `series`).

    Returns the records as a Markdown table.
    """
    if not records:
        raise ValueError(f"{name}: no records to write")
    for key in filter(None, (x, y, series)):
        missing = [i for i, r in enumerate(records) if key not in r]
        if missing:
            raise ValueError(f"{name}: records {missing} have no '{key}'")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    document = {
        "name": name,
        "written": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "x": x,
        "y": y,
        "series": series,
        "records": list(records),
    }
    tmp = directory / f"{name}.json.tmp"
    tmp.write_text(json.dumps(document, indent=1, default=str) + "\n")
    tmp.replace(directory / f"{name}.json")
    plot(records, x, y, directory / f"{name}.png", series=series, title=title or name,
         logx=logx, logy=logy)  # fmt: skip
    return table(records)


def plot(
    records: Sequence[dict[str, Any]],
    x: str,
    y: str,
    path: Path,
    *,
    series: str | None = None,
    title: str = "",
    logx: bool = False,
    logy: bool = False,
) -> None:
    """A line plot of y against x, one line (sorted by x) per value of `series`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    groups: dict[Any, list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault(record[series] if series else None, []).append(record)
    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    for label, group in groups.items():
        group = sorted(group, key=lambda r: r[x])
        ax.plot([r[x] for r in group], [r[y] for r in group], "o-", label=label)
    ax.set(xlabel=x.replace("_", " "), ylabel=y.replace("_", " "), title=title)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    if all(isinstance(r[x], int) for r in records):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # GPUs, workers: no 1.5
    if series is not None:
        ax.legend(title=series)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(records: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of the records: every key that occurs, in order of first appearance."""
    columns = list(dict.fromkeys(key for record in records for key in record))
    rows = [[_cell(record.get(key, "")) for key in columns] for record in records]
    widths = [max(3, len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(columns)]
    numeric = [all(_is_number(r.get(c)) for r in records if c in r) for c in columns]

    def line(cells: Sequence[str]) -> str:
        padded = [c.rjust(w) if num else c.ljust(w)
                  for c, w, num in zip(cells, widths, numeric, strict=True)]  # fmt: skip
        return "| " + " | ".join(padded) + " |"

    rule = ["-" * (w - 1) + ":" if num else "-" * w for w, num in zip(widths, numeric, strict=True)]
    return "\n".join([line(columns), line(rule), *(line(row) for row in rows)])


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _cell(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
