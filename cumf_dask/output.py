"""How the command line talks: rich on stderr for people, JSON on stdout for scripts, and
the tables and lines the commands print (store, plan forecast, recommendations, RMSE)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .config import size_text


class PipeConsole(Console):
    """rich's Console, whose reader going away (``| head``) is a BrokenPipeError for the
    command line to end with (exit 141), not rich's own SystemExit(1)."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError("the reader of the output went away")


def discard_stdout() -> None:
    """Send what is left for stdout to /dev/null once its reader has gone (``| head``):
    Python's own way, so that the interpreter's last flush does not fail again. A stdout
    that is no file (captured by a caller) is left as it is."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


class Output:
    """Where the command talks: rich on stderr for people, JSON on stdout for scripts.

    Log lines go through the same console as the progress bars, so a line printed while a
    bar is live appears above the bars instead of tearing them.
    """

    def __init__(self, quiet: bool, as_json: bool, console: Console | None = None):
        self.quiet, self.as_json = quiet, as_json
        self.console = console or PipeConsole(stderr=True, quiet=quiet, soft_wrap=True)

    def log(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False)

    def result(self, data: dict[str, Any], human: Callable[[], None]) -> None:
        if self.as_json:  # strict JSON: a NaN or Infinity here is a bug, not output
            print(json.dumps(data, default=str, allow_nan=False))
        elif not self.quiet:
            human()

    def error(self, message: str, code: int) -> None:
        """The error on stderr (also when quiet), and as the JSON document in --json mode."""
        try:
            PipeConsole(stderr=True, soft_wrap=True).print(
                f"[bold red]error:[/] {escape(message)}", highlight=False
            )
            if self.as_json:
                print(json.dumps({"error": message, "exit_code": code}))
        except BrokenPipeError:  # the reader went away (`| head`): nothing more to say
            discard_stdout()

    @contextmanager
    def progress(self) -> Iterator[Callable[[str, int, int | None], None]]:
        """A progress callback (stage, done, total) drawing one bar per stage on a terminal."""
        bars = Progress(
            TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), console=self.console,
            disable=self.quiet or not self.console.is_terminal,
        )  # fmt: skip
        tasks: dict[str, Any] = {}

        def update(stage: str, done: int, total: int | None) -> None:
            if stage not in tasks:
                tasks[stage] = bars.add_task(stage, total=total)
            bars.update(tasks[stage], completed=done, total=total)

        with bars:
            yield update


# ----------------------------------------------------------------------------- stores


def store_info(store: Any) -> dict[str, Any]:
    """Shape, density, degree skew, tiles, size on disk and provenance of a store."""
    rows, cols = store.counts("row"), store.counts("col")

    def skew(c: Any) -> dict[str, float]:
        mean = float(c.mean()) if c.size else 0.0
        return {"mean": mean, "max": int(c.max()) if c.size else 0,
                "max_over_mean": float(c.max() / mean) if mean else 0.0,
                "empty": int((c == 0).sum())}  # fmt: skip

    return {
        "url": store.url, "m": store.m, "n": store.n, "nnz": store.nnz,
        "nnz_test": store.nnz_test, "density": store.nnz / (store.m * store.n),
        "rows": skew(rows), "cols": skew(cols),
        "tiles": {"rows": store.tile_rows, "cols": store.tile_cols,
                  "row_tiles": store.n_row_tiles, "col_tiles": store.n_col_tiles},
        "ratings": store.stats, "bytes_on_disk": store.size_on_disk(),
        "has_ids": bool(store.attrs.get("has_ids")), "source": store.source,
    }  # fmt: skip


def report_store(store: Any, out: Output, verified: dict[str, Any] | None = None) -> None:
    """The store's description: a table for people, store_info as JSON for scripts; with
    what :func:`~cumf_dask.data.verify.verify_store` read, when it was asked for."""
    info = store_info(store)
    if verified is not None:
        info["verified"] = verified

    def human() -> None:
        table = Table(title=f"rating store {escape(info['url'])}", show_header=False)
        table.add_row("shape", f"{info['m']:,} x {info['n']:,}")
        table.add_row("ratings", f"{info['nnz']:,} train, {info['nnz_test']:,} held out "
                                 f"(density {info['density']:.2e})")  # fmt: skip
        for axis in ("rows", "cols"):
            d = info[axis]
            table.add_row(f"{axis} degree", f"mean {d['mean']:.1f}, max {d['max']:,} "
                          f"({d['max_over_mean']:.1f}x mean), {d['empty']:,} empty")  # fmt: skip
        t = info["tiles"]
        table.add_row("tiles", f"{t['rows']:,} x {t['cols']:,} ({t['row_tiles']} x "
                               f"{t['col_tiles']})")  # fmt: skip
        r = info["ratings"]
        table.add_row("values", f"min {r['min']:.3g}, max {r['max']:.3g}, mean {r['mean']:.3g}, "
                                f"std {r['std']:.3g}")  # fmt: skip
        if info["bytes_on_disk"] is not None:
            table.add_row("on disk", size_text(info["bytes_on_disk"]))
        table.add_row("ids", "the input's own ids, kept" if info["has_ids"] else "dense indices")
        source = ", ".join(f"{key} {_short(value)}" for key, value in info["source"].items())
        table.add_row("source", escape(source))
        if verified is not None:
            rate = (verified["bytes_on_disk"] or 0) / max(verified["seconds"], 1e-9)
            table.add_row("verified", f"every chunk read and checked in {verified['seconds']:.1f} s"
                          + (f" ({size_text(rate)}/s)" if rate else ""))  # fmt: skip
        PipeConsole().print(table)

    out.result(info, human)


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# ----------------------------------------------------------------------------- results


def rmse_line(summary: dict[str, Any]) -> str | None:
    """'final test RMSE 0.3233' and, on generated data, what to compare it with: the noise
    sigma (the floor when ratings are neither clipped nor rounded), else the planted
    X* Theta*^T's RMSE, labelled as before clipping/rounding."""
    rmse = summary.get("test_rmse")
    if rmse is None:
        return None
    line = f"final test RMSE {rmse:.4f}"
    noise, planted = summary.get("noise"), summary.get("planted_test_rmse")
    changed = " and ".join(w for w in ("clipping", "rounding") if summary.get(w[:-3] + "ed"))
    if noise is None:
        return line
    if not changed:
        return f"{line} (the floor: noise sigma {noise:.4g})"
    planted_text = f"planted X* Theta*^T before {changed} {planted:.4f}, " if planted else ""
    return (
        f"{line} ({planted_text}noise sigma {noise:.4g}; {changed} the ratings is a part "
        "of them a fitted model learns and the planted one does not, so it may score below "
        "both)"
    )


def recommend_table(user: Any, items: Sequence[Any], scores: Sequence[float]) -> str:
    """A header line and one aligned line per item: rank, item (the user's own ids), score."""
    rows = [(f"{rank}", str(item), f"{score:.4f}")
            for rank, (item, score) in enumerate(zip(items, scores, strict=True), 1)]  # fmt: skip
    header = ("rank", "item", "score")
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(3)]

    def line(row: tuple[str, str, str]) -> str:
        return f"{row[0]:>{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:>{widths[2]}}".rstrip()

    return "\n".join([f"top {len(rows)} for user {user}", line(header), *map(line, rows)])
