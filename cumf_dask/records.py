"""Run folders: resolved config, plan, per-iteration metrics (JSON lines), model, RMSE plot.

Every run of a config that saves its model also points ``<output.dir>/<output.name>-latest``
at its folder (a relative symlink, replaced atomically), so ``runs/netflix-latest`` names the
newest Netflix model whatever its timestamp; commands that take a model take a run folder
too.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import re
import shlex
import shutil
import threading
import time
import uuid
from contextlib import AbstractContextManager, suppress
from pathlib import Path
from typing import Any

import yaml

from .checkpoint import MODEL_FORMAT, interrupted_copies
from .config import Config, load_config
from .engine.plan import Plan
from .errors import ConfigError, StoreError, warn
from .paths import disk_full_as, local_path

STAMP = r"-\d{8}-\d{6}(-\d+)?"  # a run folder's name: <output.name><STAMP>


class RunFolder:
    """``<output.dir>/<output.name>-<timestamp>/`` and what a training run writes into it.

    `after_error` ends the message of a full disk while the record is written: what to do
    once space is freed (the training pipeline sets it to the command that resumes).
    """

    def __init__(self, path: str | Path, after_error: str = "then run again"):
        self.path = Path(path)
        self.after_error = after_error

    @classmethod
    def create(cls, config: Config) -> RunFolder:
        """A new folder named by the time; ``-2``, ``-3``... for runs started in the same
        second (made with an exclusive mkdir: two runs never share one)."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = runs_dir(config) / f"{config.output.name}-{stamp}"
        path, n = base, 1
        while True:
            try:
                path.mkdir(parents=True)
                return cls(path)
            except FileExistsError:
                n += 1
                path = base.with_name(f"{base.name}-{n}")

    def make_latest(self, config: Config) -> Path | None:
        """Point ``<output.name>-latest`` here: once the model is saved, so a run that
        fails never takes the link from the last good one. The link, or None where none
        was made."""
        link = self.latest_link(config)
        return link if link_latest(self.path, link) else None

    @staticmethod
    def latest_link(config: Config) -> Path:
        """``<output.dir>/<output.name>-latest``: the newest run folder of this config."""
        return runs_dir(config) / f"{config.output.name}-latest"

    @classmethod
    def latest(cls, config: Config) -> RunFolder | None:
        """The newest run folder of this config's name that has checkpoints (for --resume)."""
        found = newest_run(runs_dir(config), config.output.name)
        return cls(found) if found else None

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def model(self) -> Path:
        return self.path / "model.zarr"

    def discard_if_empty(self) -> None:
        """Remove this run folder if no iteration finished in it (no metrics, no checkpoint):
        a fit that failed before its first iteration leaves nothing worth keeping (its
        config.yaml is the config given), and an empty folder only hides the runs that did."""
        if not (self.path / "metrics.jsonl").exists() and not any(self.checkpoints.glob("*")):
            shutil.rmtree(self.path, ignore_errors=True)

    def write_config(self, config: Config) -> None:
        self._write("config.yaml", yaml.safe_dump(config.to_dict(), sort_keys=False))

    def write_plan(self, plan: Plan) -> None:
        self._write("plan.txt", plan.table() + "\n")
        self._write("plan.json", json.dumps(plan.to_dict(), indent=1, allow_nan=False))

    def append_metrics(self, record: dict[str, Any]) -> None:
        """Add an iteration's line while the fit runs (progress to watch); lines of that
        iteration or later (left by a run that went on past the checkpoint it is resumed
        from) are dropped first. :meth:`write_metrics` puts the fit's own list in at the end."""
        path = self.path / "metrics.jsonl"
        with self._recording(path.name):
            text = path.read_text() if path.exists() else ""
            lines = text.splitlines()
            whole = lines if text.endswith("\n") else lines[:-1]  # a line cut short by a kill
            kept = [line for line in whole if _iteration(line) < record["iteration"]]
            if len(kept) == len(lines):
                with open(path, "a") as fh:
                    fh.write(json.dumps(record) + "\n")
                return
        self._write(path.name, "".join(f"{line}\n" for line in [*kept, json.dumps(record)]))

    def write_metrics(self, metrics: list[dict[str, Any]]) -> None:
        """metrics.jsonl as the fitted model holds them, one line per iteration: iterations
        whose line was lost (a Ctrl-C or a failure between a checkpoint and its line, then
        --resume from that checkpoint) are back, in order."""
        self._write("metrics.jsonl", "".join(json.dumps(r) + "\n" for r in metrics))

    def restore_metrics(self) -> None:
        """metrics.jsonl back to the saved model's iterations after a resume that failed or
        was stopped: the lines it appended describe iterations that the run's model,
        summary, config and plot do not have (a later --resume puts them back from the
        checkpoints). Kept as it is when there is no complete model; a failure to write is
        dropped, so the fit's own error is the one reported."""
        attrs = self._saved_model_attrs()
        if attrs is not None and isinstance(attrs.get("metrics"), list):
            with suppress(StoreError, OSError):
                self.write_metrics(attrs["metrics"])

    def clear_damaged_model(self) -> str | None:
        """Remove a model.zarr that is not a complete model (a save cut short, or damaged
        metadata), so that a resumed run can write it again; say what was removed."""
        if not self.model.exists() or self._saved_model_attrs() is not None:
            return None
        shutil.rmtree(self.model, ignore_errors=True)
        return f"removed the incomplete or damaged {self.model}; it is written again"

    def _saved_model_attrs(self) -> dict[str, Any] | None:
        """The attrs of the run's model.zarr when it is a complete model (read from its
        zarr.json alone), else None."""
        try:
            attrs = json.loads((self.model / "zarr.json").read_text())["attributes"]
            complete = attrs.get("format") == MODEL_FORMAT and attrs.get("complete")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        return attrs if complete else None

    def write_summary(self, summary: dict[str, Any]) -> None:
        self._write("summary.json", json.dumps(summary, indent=1))

    def plot(self, metrics: list[dict[str, Any]], title: str = "") -> Path | None:
        """rmse.png: train/test RMSE against iteration and against time (loss.png, the
        loss, for an implicit model's metrics); None if there is nothing to plot."""
        name = "loss.png" if _plotted(metrics) == ["loss"] else "rmse.png"
        return plot_rmse(metrics, self.path / name, title)

    def _write(self, name: str, text: str) -> None:
        """Write one file of the run record whole: a temporary file renamed over it, so a
        reader (or a failure midway) never sees half of it."""
        path = self.path / name
        tmp = path.with_name(f".{name}-{uuid.uuid4().hex[:8]}.tmp")
        try:
            with self._recording(name):
                tmp.write_text(text)
                os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def _recording(self, name: str) -> AbstractContextManager[None]:
        """A full disk while writing `name` of the run record: one StoreError naming the
        run folder, its free space and `after_error`."""
        return disk_full_as(self.path, f"the run record ({name})",
                            f"free some space there, {self.after_error}")  # fmt: skip


def runs_dir(config: Config) -> Path:
    """``output.dir``: a local folder (``file://`` read as one; a URL refused, since run
    folders are renamed into place and linked, which object stores cannot do)."""
    return Path(local_path(config.output.dir, "run folders"))


def newest_run(root: Path, name: str) -> Path | None:
    """The newest run folder of `name` in `root` that has checkpoints (what --resume takes)."""
    mine = re.compile(re.escape(name) + STAMP)
    found = sorted(
        (
            p
            for p in root.glob(f"{glob.escape(name)}-*")
            if mine.fullmatch(p.name) and (p / "checkpoints").is_dir()
        ),
        key=lambda p: p.stat().st_mtime,
    )
    return found[-1] if found else None


def resumable(model: Path) -> bool:
    """Whether resuming its run (``--resume``) writes `model` again: it is the
    model.zarr of the newest run of its name, and that run has a checkpoint."""
    run = model.absolute().parent.resolve()
    named = re.fullmatch(rf"(.+){STAMP}", run.name)
    return (
        model.name == "model.zarr"
        and named is not None
        and newest_run(run.parent, named.group(1)) == run
        and any(run.glob("checkpoints/iter-*"))
    )


def resume_advice(run: Path) -> str:
    """The way on for `run` when it stopped before saving its model: its checkpoints."""
    return ("a run that stopped before saving its model goes on from its checkpoints: "
            f"{how_to_resume(run)}")  # fmt: skip


def how_to_resume(run: Path) -> str:
    """The command that resumes `run`: ``cumf-dask train RUN/config.yaml --resume`` where
    that config resumes this very run from here (its output.dir and data.store are as they
    were given, often relative to the folder it was trained in), else the command that
    started it (not known here), with --resume."""
    path = run / "config.yaml"
    try:
        config = load_config(path)
        found = RunFolder.latest(config)
    except (ConfigError, StoreError, OSError):
        found = None
    if found is not None and found.path.resolve() == run.resolve():
        # a resume never rebuilds the store its checkpoints were made on
        rebuilds = config.data.overwrite and config.data.source != "store"
        keep = ["--set", "data.overwrite=false"] if rebuilds else []
        command = shlex.join(["cumf-dask", "train", str(path), "--resume", *keep])
        return f"`{command}` (or the command that started the run, with --resume)"
    return "run the command that started it again, with --resume"


def link_latest(run: Path, link: Path) -> bool:
    """Point `link` at `run` (relative, so the runs folder can move); atomic replace. False
    when no link was made: `link` is something else (kept, with a CumfWarning), or this
    file system has no symlinks."""
    if link.exists() and not link.is_symlink():
        warn(f"{link} is not a link (a copy of a run? `cp -rL` copies links as folders), so it "
             f"does not name this run and keeps naming an older model; remove it to have it "
             "follow the newest run again")
        return False
    tmp = link.with_name(f".{link.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.symlink(run.name, tmp, target_is_directory=True)
        os.replace(tmp, link)
    except OSError:  # no symlinks here (some Windows setups): the timestamped name still works
        tmp.unlink(missing_ok=True)
        return False
    return True


def model_path(path: str | Path) -> str:
    """A saved model's path: `path` itself, or the model.zarr of the run folder `path`
    (``runs/netflix-latest``)."""
    folder = Path(path)
    inside = folder / "model.zarr"
    if inside.is_dir():
        return str(inside)
    if folder.is_symlink() and not folder.exists():
        raise StoreError(
            f"{path} is a link to {os.readlink(folder)}, which is gone (deleted or moved); "
            "give another run folder or model, or train again"
        )
    if folder.is_dir() and not (folder / "zarr.json").exists():
        runs = sorted(p.name for p in folder.glob("*-latest"))
        if runs:
            raise StoreError(
                f"{path} is a folder of runs, not a model: give a run folder or its "
                f"model.zarr, e.g. {folder / runs[0]}"
            )
        if interrupted_copies(inside):  # its save was interrupted: opening it says so
            return str(inside)
        if (folder / "config.yaml").is_file():
            way_on = (f"; {resume_advice(folder)}" if (folder / "checkpoints" / "LATEST").is_file()
                      else ": give another run, or train again")  # fmt: skip
            raise StoreError(
                f"{path} is a run folder without a saved model (the run failed, or is still "
                f"running){way_on}"
            )
        if (folder / "LATEST").is_file():
            raise StoreError(
                f"{path} is a run's checkpoints folder, not a model: give the run folder "
                f"({folder.parent}) once its model is saved; {resume_advice(folder.parent)}"
            )
    return str(path)


def warm_plotting() -> threading.Thread:
    """Import matplotlib (Agg) in a background thread, so that the plot at the end of a run
    does not wait for it: the import overlaps the iterations, whose NumPy work releases
    the GIL. plot_rmse's own import then finds it loaded (or waits for it to finish)."""

    def load() -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot

    thread = threading.Thread(target=load, name="cumf-warm-plotting", daemon=True)
    thread.start()
    return thread


def _plotted(metrics: list[dict[str, Any]]) -> list[str]:
    """The metrics' keys a plot draws: the RMSEs, else an implicit model's loss."""
    first = metrics[0] if metrics else {}
    keys = [k for k in ("train_rmse", "test_rmse") if k in first]
    return keys or (["loss"] if "loss" in first else [])


def plot_rmse(metrics: list[dict[str, Any]], path: Path, title: str = "") -> Path | None:
    """Two panels, RMSE by iteration and by training seconds (the loss where the metrics
    have no RMSE: an implicit model's); None if there is nothing to plot.

    Training seconds add up the iterations' own times, so a resumed run's curve continues
    where the checkpoint left it (``elapsed`` restarts with each process). A plot that
    cannot be written leaves no part of it behind.
    """
    keys = _plotted(metrics)
    if not keys:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = [r["iteration"] for r in metrics]
    secs = list(itertools.accumulate(r["seconds"] for r in metrics))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for ax, xs, label in ((axes[0], its, "iteration"), (axes[1], secs, "training seconds")):
        for key, style in zip(keys, ("o-", "s--"), strict=False):
            ax.plot(xs, [r[key] for r in metrics], style, label=key.replace("_", " "))
        ax.set_xlabel(label)
        ax.set_ylabel("loss" if keys == ["loss"] else "RMSE")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title or "cumf-dask training")
    try:
        fig.savefig(path, dpi=100)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
    return path


def _iteration(line: str) -> int:
    try:
        return int(json.loads(line).get("iteration", 0))
    except (ValueError, AttributeError, TypeError):
        return 0
