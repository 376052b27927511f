"""The ``cumf-dask`` command: generate, ingest, info, plan, train, evaluate, recommend, bench.

Exit codes a script can rely on: 0 success; 2 bad usage or config; 3 bad data, store or
model file (or an operating-system error no command worded); 4 no plan fits, or a worker
or this machine ran out of memory; 130 interrupted; 143 terminated (SIGTERM, cleaned up as
after a Ctrl-C); 141 the reader of stdout exited first (``| head``: nothing more is printed);
1 anything else.
``--json`` prints one JSON document on stdout and nothing else there (on any failure
``{"error": ..., "exit_code": ...}``); ``--quiet`` prints only errors. Both may come before
or after the command. Progress bars and log lines go to stderr; bars only on a terminal.

This module is the parser and the exit codes; the commands are in :mod:`.commands`, what
they print in :mod:`.output`.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .data.formats import FORMATS
from .errors import (
    ConfigError,
    CumfError,
    CumfWarning,
    DeviceMemoryError,
    IngestError,
    NotFittedError,
    NumericalError,
    PlanError,
    StoreError,
)
from .output import Output, discard_stdout

EXIT = {
    ConfigError: 2,
    NotFittedError: 2,
    StoreError: 3,
    IngestError: 3,
    NumericalError: 3,
    PlanError: 4,
    DeviceMemoryError: 4,
}
SIGPIPE_EXIT = 141  # 128 + SIGPIPE: how a shell reports a writer whose reader went away
PRESETS = "netflix, yahoomusic, hugewiki, sparkals, factorbird, facebook"
# Dask's loggers whose errors and warnings the commands replace with their own one line
WORKER_LOGGERS = ("distributed.worker", "distributed.worker.state_machine")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's '(default: X)' after each option's help, except where there is no
    default to show (None, False of a flag, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        nothing = action.default is None or action.default is False or action.default == []
        if nothing or action.help is None:
            return action.help
        return super()._get_help_string(action)


def _modes(p: argparse.ArgumentParser, default: Any) -> None:
    p.add_argument("--quiet", "-q", action="store_true", default=default, help="print only errors")
    p.add_argument("--json", action="store_true", default=default,
                   help="print one JSON document on stdout")  # fmt: skip


def _store_layout(
    p: argparse.ArgumentParser, held_out: str = "share of the ratings held out for testing"
) -> None:
    p.add_argument("-o", "--output", required=True, help="store path or URL to write")
    p.add_argument("--test-fraction", type=float, default=0.1, help=f"{held_out} (0: none)")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the train/test split")
    p.add_argument("--tile-rows", type=int, help="rows per tile (default: from the shape)")
    p.add_argument("--tile-cols", type=int, help="columns per tile (default: from the shape)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing store")


def _generate(g: argparse.ArgumentParser) -> None:
    g.add_argument("--preset", help=f"a paper data set's shape: {PRESETS}")
    g.add_argument("--scale", type=float, default=1.0, help="the preset's ratings x scale, its "
                   "m and n x sqrt(scale): density and aspect kept")  # fmt: skip
    for name, text in (("m", "rows (users)"), ("n", "columns (items)"),
                       ("nnz", "ratings, train and test")):  # fmt: skip
        g.add_argument(f"--{name}", type=int, help=f"{text}; overrides the preset")
    g.add_argument("--rank", type=int,
                   help="rank of the planted model, at most min(m, n) (default: 10, or min(m, n) "
                   "when smaller)")  # fmt: skip
    g.add_argument("--noise", type=float, default=0.1, help="sigma of the Gaussian noise "
                   "(unclipped ratings must stay within +-1e9)")  # fmt: skip
    g.add_argument("--skew", type=float, default=0.8, help="Zipf exponent of the row degrees; "
                   "columns are drawn from the same law without replacement, so their degrees "
                   "follow it only for skew below about 1 (about 1/skew above)")  # fmt: skip
    g.add_argument("--rating-min", type=float, help="clip ratings below (within +-1e9)")
    g.add_argument("--rating-max", type=float, help="clip ratings above (within +-1e9)")
    g.add_argument("--round", action="store_true", help="round ratings to integers, then clip "
                   "them to the integers between --rating-min and --rating-max (there must "
                   "be one)")  # fmt: skip
    g.add_argument("--allow-empty", action="store_true", help="rows/columns may have no rating")
    g.add_argument("--seed", type=int, default=0, help="seed of the planted model and ratings")
    _store_layout(g, "share of the ratings held out for testing, not counting the max(m, n) "
                  "that give every row and column one (they stay in training; none with "
                  "--allow-empty)")  # fmt: skip


def _ingest(i: argparse.ArgumentParser) -> None:
    i.add_argument("file", help="input path, glob or fsspec URL (.gz/.bz2/.xz are decompressed)")
    formats = "; ".join(f"{key}: {text}" for key, text in FORMATS.items())
    i.add_argument("--format", default="csv", choices=list(FORMATS),
                   help=formats)  # fmt: skip
    i.add_argument("--delimiter", help="field separator (format delimited: default whitespace; "
                   "overrides csv's and tsv's)")  # fmt: skip
    i.add_argument("--header", action=argparse.BooleanOptionalAction, default=None,
                   help="the first line is a header (default: guessed)")  # fmt: skip
    i.add_argument("--columns", help="user,item,rating columns: names or 0-based positions")
    i.add_argument("--duplicates", choices=["error", "last", "mean", "sum"], default="error",
                   help="what a repeated (user, item) pair does (sum: add counts)")  # fmt: skip
    i.add_argument("--split", choices=["pairs", "users"], default="pairs",
                   help="hold out a share of all pairs, or of each user's (keeps every user)")
    i.add_argument("--rating-min", type=float, help="declared scale: a rating below is an error")
    i.add_argument("--rating-max", type=float, help="declared scale: a rating above is an error")
    i.add_argument("--m", type=int, help="declared rows: ids are indices in [0, m)")
    i.add_argument("--n", type=int, help="declared columns: ids are indices in [0, n)")
    _store_layout(i)


def _job(p: argparse.ArgumentParser, own: dict[str, Any], train: bool) -> None:
    p.add_argument("config", nargs="?", help="YAML config (default: the embedded quickstart, "
                   "or with --store settings for your own data; every key: "
                   "configs/reference.yaml)")  # fmt: skip
    p.add_argument("--store", metavar="PATH", help="train on this existing store; without a "
                   f"config: f={own['factors']}, lambda={own['regularization']}, "
                   f"{own['iterations']} iterations, the run named after the "
                   "store")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set model.factors=64")  # fmt: skip
    if train:
        p.add_argument("--resume", action="store_true", help="continue the latest run of "
                       "this config from its checkpoint")  # fmt: skip
        p.add_argument("--force", action="store_true", help="run a CPU job even when it is "
                       "forecast to take over an hour")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    from . import commands as c  # Dask, Zarr and the engine: main catches a Ctrl-C meanwhile

    parser = argparse.ArgumentParser(
        prog="cumf-dask",
        description="ALS matrix factorization on Dask, on CPUs and GPUs.",
        epilog="exit codes: 0 success, 2 bad usage or config, 3 bad data, store or model "
        "file, 4 no plan fits or out of memory, 130 interrupted, 143 terminated (SIGTERM), 141 "
        "the output's reader exited first (| head), 1 anything else",
        formatter_class=HelpFormatter,
    )
    _modes(parser, False)
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, func: Callable[..., None], text: str, epilog: str | None = None):
        p = sub.add_parser(name, help=text, description=text, epilog=epilog,
                           formatter_class=HelpFormatter)  # fmt: skip
        _modes(p, argparse.SUPPRESS)  # after the command too, without resetting the global flag
        p.set_defaults(func=func)
        return p

    _generate(add("generate", c.cmd_generate, "write a synthetic planted-model store"))
    _ingest(add("ingest", c.cmd_ingest, "read a ratings file into a store"))
    i = add("info", c.cmd_info, "describe a store")
    i.add_argument("store", help="store path or URL")
    i.add_argument("--verify", action="store_true", help="read every chunk and check that the "
                   "store's ratings, counts and both orientations agree")  # fmt: skip
    _job(add("plan", c.cmd_plan, "print the plan and time forecast of a config (on a local "
             "machine without starting a cluster)", epilog="data to generate is not built: "
             "it is planned from its shape; a file to ingest is read into its store first "
             "when that store does not exist yet; an existing store is never rebuilt "
             "(data.overwrite rebuilds it in train)"), c.OWN_DATA, train=False)  # fmt: skip
    _job(add("train", c.cmd_train, "run a configured training job"), c.OWN_DATA, train=True)

    model_help = "a saved model, or a run folder such as runs/quickstart-latest"
    e = add("evaluate", c.cmd_evaluate, "RMSE and ranking metrics of a saved model")
    e.add_argument("model", help=model_help)
    e.add_argument("store", nargs="?", help="store to evaluate on (default: the model's "
                   "training store, whose held-out ratings are the test set)")  # fmt: skip
    e.add_argument("-k", type=int, help=f"length of the ranked lists (@k; default: {c.K})")
    e.add_argument("--threshold", type=float, help="held-out ratings >= this are relevant "
                   "(explicit models; implicit: every positive count)")  # fmt: skip
    e.add_argument("--users", type=int, help=f"users sampled for ranking (default: "
                   f"{c.USERS:,}; explicit models: implicit ones rank every user)")  # fmt: skip

    r = add("recommend", c.cmd_recommend, "top-k items for a user (in the user's own ids)")
    r.add_argument("model", help=model_help)
    r.add_argument("--user", required=True, help="the user's own id, as in the input file")
    r.add_argument("-k", type=int, default=10, help="how many items")
    r.add_argument("--store", help="the training store, whose items the user rated are left "
                   "out (default: the one the model names)")  # fmt: skip
    r.add_argument("--include-rated", action="store_true", help="rank the items the user "
                   "already rated too (no training store is read)")  # fmt: skip

    found = c.available_benchmarks()
    listed = ", ".join(found) if found else "none here: benchmarks/ is part of a source checkout"
    b = add("bench", c.cmd_bench, "run benchmarks/bench_NAME.py (it prints its own output)",
            epilog=f"available benchmarks: {listed}")  # fmt: skip
    b.add_argument("--dir", default=str(c.BENCHMARKS), help="folder of bench_*.py scripts")
    b.add_argument("name", help=f"which benchmark: {listed}")
    b.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    return parser


@contextmanager
def _warnings_as_log_lines(out: Output) -> Iterator[None]:
    """cumf-dask's own warnings (a damaged checkpoint skipped, a lost worker replaced,
    leftovers removed) as one 'warning:' line each on stderr, every time they happen."""
    shown = warnings.showwarning

    def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        if issubclass(category, CumfWarning):
            out.log(f"warning: {message}")
        else:
            shown(message, category, *args, **kwargs)

    with warnings.catch_warnings(), _env_default("PYTHONWARNINGS", "ignore", out.quiet):
        if out.quiet:  # also the libraries' warnings, in worker processes too
            warnings.simplefilter("ignore")
        else:
            warnings.simplefilter("always", CumfWarning)
        warnings.showwarning = show
        yield  # then the filters, showwarning and the environment are as they were


@contextmanager
def _env_default(name: str, value: str, when: bool) -> Iterator[None]:
    """Environment variable `name` set to `value` while the command runs (`when`, and the
    user has not set it), for the processes it starts; removed after, since main() may be
    called from a longer-lived process (a notebook, the tests)."""
    added = when and name not in os.environ
    if added:
        os.environ[name] = value
    try:
        yield
    finally:
        if added:
            os.environ.pop(name, None)


class Terminated(KeyboardInterrupt):
    """SIGTERM (`timeout`, a batch scheduler, `docker stop`), raised like Ctrl-C so that the
    same cleanup runs: a run folder with nothing in it removed, its lock released."""


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises Terminated in the main thread while a command runs (elsewhere, e.g.
    main() called from another thread, signals cannot be handled and are left alone)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: Any) -> None:
        raise Terminated()

    before = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


@contextmanager
def _dask_logs(quiet: bool) -> Iterator[None]:
    """Dask workers' own error and warning logs off while a command runs (all of Dask's
    below errors with --quiet), in this process and in the worker processes it starts.

    The engine turns a task's failure into the command's one error line; the worker's
    "Compute Failed" traceback, or its CancelledError lines after a Ctrl-C, only buried it.
    Worker processes read DASK_LOGGING when they start; one the user set is kept.
    """
    levels = {name: logging.CRITICAL for name in WORKER_LOGGERS}
    if quiet:
        levels["distributed"] = logging.ERROR
    loggers = {name: logging.getLogger(name) for name in levels}
    before = {name: logger.level for name, logger in loggers.items()}
    env = {} if any(k.startswith("DASK_LOGGING") for k in os.environ) else {
        "DASK_LOGGING": repr({name: logging.getLevelName(level) for name, level in levels.items()})
    }  # fmt: skip
    os.environ.update(env)
    for name, logger in loggers.items():
        logger.setLevel(levels[name])
    try:
        yield
    finally:
        for name, logger in loggers.items():
            logger.setLevel(before[name])
        for key in env:
            os.environ.pop(key, None)


def _os_error(exc: OSError, command: str) -> str:
    """An operating-system error no command worded itself (theirs are CumfErrors): the path
    and the reason, in one line."""
    where = f"{exc.filename}: " if exc.filename else ""
    reason = exc.strerror or str(exc) or type(exc).__name__
    return (f"{where}{reason} during `{command}`; check that path (its permissions, and the "
            "free space on its disk), then run the command again")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line `argv` (default: this process's own) and return its exit code.

    Run as the process's own command, a Ctrl-C once the command is done and reported ends
    the process with the command's exit code: while the interpreter exits (Dask's threads
    and atexit handlers, then its modules) it turned a finished run's exit 0 into 130.
    """
    own = argv is None and threading.current_thread() is threading.main_thread()
    if own:  # registered before Dask's atexit handlers, so run after them: the last step
        atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN)
    code = _main(argv)
    if own:
        try:
            sys.stdout.flush()
        except BrokenPipeError:  # the reader exited before the last of the output
            discard_stdout()
            code = code or SIGPIPE_EXIT
        sys.stderr.flush()
        signal.signal(signal.SIGINT, lambda signum, frame: os._exit(code))
    return code


def _main(argv: Sequence[str] | None) -> int:
    try:
        parser = build_parser()
    except KeyboardInterrupt:  # while the commands' libraries were being imported
        words = sys.argv[1:] if argv is None else argv
        Output(False, "--json" in words).error("interrupted", 130)
        return 130
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # train's advice repeats it
    out = Output(args.quiet, args.json)
    try:
        with _sigterm_as_interrupt(), _warnings_as_log_lines(out), _dask_logs(args.quiet):
            args.func(args, out)
    except CumfError as exc:
        code = next((code for kind, code in EXIT.items() if isinstance(exc, kind)), 1)
        out.error(str(exc), code)
        return code
    except MemoryError as exc:  # the host's (a device's is a DeviceMemoryError, above)
        detail = f": {exc}" if str(exc) else ""
        out.error(f"this machine ran out of memory during `{args.command}` (MemoryError"
                  f"{detail}); free memory or use a machine with more. Nothing half-written "
                  "was kept", 4)  # fmt: skip
        return 4
    except KeyboardInterrupt as exc:
        code = 143 if isinstance(exc, Terminated) else 130
        out.error("terminated (SIGTERM)" if code == 143 else "interrupted", code)
        return code
    except BrokenPipeError:  # stdout's reader exited (`| head`): nothing went wrong here
        discard_stdout()
        return SIGPIPE_EXIT
    except OSError as exc:
        out.error(_os_error(exc, args.command), 3)
        return 3
    except Exception as exc:  # a bug: its traceback follows, and --json still gets its document
        if out.as_json:
            out.error(f"{type(exc).__name__}: {exc}", 1)
        raise
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
