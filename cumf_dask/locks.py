"""Writer locks and owner records: one writer per store, model or checkpoint folder.

A lock is a file beside its target (``<target>.lock``) created with ``O_CREAT | O_EXCL``,
which is atomic on local file systems (and NFS v3+). It holds its owner: pid, host, process
start time, command line and a random token. A second writer finds the file and gets one
:class:`~cumf_dask.errors.StoreError` at once, naming the owner. A lock left by a process
that died (same host, pid gone or reused since) is stale and taken over; one from another
host cannot be checked from here, and the message says how to remove it.

Locks exclude processes and threads: a thread may take a lock it already holds again
(re-entrant), so a pipeline can hold a folder's lock while the fit it runs takes the same
lock; another thread of the same process is refused like another process. Remote (fsspec
URL) targets are not locked: object stores have no exclusive create that works everywhere.

The same owner records mark temporary folders (ingest's spill folders, the stores of fits on
in-memory data) so that the next run can tell a dead run's leftovers from a live run's files
(:func:`owned_folder`, :func:`clear_dead_folders`).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
from contextlib import suppress
from pathlib import Path
from typing import Any

from .errors import StoreError, warn
from .paths import check_writable, is_url, normalize_url

OWNER = "owner.json"  # an owned folder's owner record
_TOKEN = uuid.uuid4().hex  # this process's token (a forked child gets a new pid, not a token)
_HELD: dict[str, list[int]] = {}  # lock path -> [the thread holding it, times it took it]
_THREADS = threading.Lock()  # guards _HELD and the lock files' creation and removal
_GUARD_STALE_S = 30.0  # a take-over guard older than this was left by a dead process
_EMPTY_STALE_S = 5.0  # a lock naming no owner this long was left by a writer killed at once


def owner_record() -> dict[str, Any]:
    """Who this process is: pid, host, start time, command line, token."""
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": _process_start(os.getpid()),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:200] if sys.argv else "",
        "token": _TOKEN,
        "time": time.time(),
    }


def _process_start(pid: int) -> float | None:
    try:
        import psutil

        return float(psutil.Process(pid).create_time())
    except Exception:
        return None


def owner_is_dead(owner: dict[str, Any]) -> bool:
    """True only when the owner ran on this host and its process is gone (or the pid now
    belongs to a process started after the owner wrote its record)."""
    if owner.get("host") != socket.gethostname():
        return False
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, another user's
    started, now = owner.get("started"), _process_start(pid)
    return started is not None and now is not None and abs(now - started) > 1.0


def read_owner(path: Path) -> dict[str, Any] | None:
    """The owner record in a lock or owner file; None if it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _ours(owner: dict[str, Any]) -> bool:
    return owner.get("token") == _TOKEN and owner.get("pid") == os.getpid()


def owned_folder(prefix: str, parent: str | None = None) -> Path:
    """A fresh folder named `prefix`<pid>-... in `parent` (default: the temp folder) with
    this process's owner record in it."""
    path = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))
    (path / OWNER).write_text(json.dumps(owner_record()))
    return path


def clear_dead_folders(prefix: str, what: str, parent: str | None = None) -> None:
    """Remove the folders `prefix`* in `parent` whose owner died (a killed run's), saying
    so: "removed N `what` in <parent> (MB): names".

    Folders of live owners, of other hosts, or without an owner record are left alone.
    Two runs starting together may clear the same folder: what the other removed first
    is skipped, never an error.
    """
    root = Path(parent or tempfile.gettempdir())
    removed, total = [], 0
    for folder in root.glob(f"{prefix}*"):
        owner = read_owner(folder / OWNER)
        if owner is None or not owner_is_dead(owner):
            continue
        total += _bytes_under(folder)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder.name)
    if removed:
        warn(f"removed {len(removed)} {what} in {root} ({total / 1e6:,.1f} MB): "
             f"{', '.join(removed)}")


def _bytes_under(folder: Path) -> int:
    """Bytes of the files under `folder`; what vanishes meanwhile counts nothing (another
    run starting now may be clearing the same dead folder)."""
    total = 0
    for parent, _, files in os.walk(folder):  # a folder removed meanwhile lists nothing
        for name in files:
            with suppress(OSError):
                total += os.stat(os.path.join(parent, name)).st_size
    return total


def lock_path(target: str | os.PathLike[str]) -> Path:
    """The lock file of a target: ``<target>.lock`` beside it."""
    text = normalize_url(target)
    return Path(f"{text}.lock")


class WriterLock:
    """``with WriterLock(target, "the rating store"):`` one writer of `target` at a time.

    `path` overrides where the lock file goes (default :func:`lock_path`). Nothing is locked
    for a URL target.
    """

    def __init__(self, target: str | os.PathLike[str], what: str, path: Path | None = None):
        self.target = normalize_url(target)
        self.what = what
        self.path = None if is_url(self.target) else (path or lock_path(self.target))
        self.beside = path is None  # the lock file lives beside the target
        self.held = False

    def __enter__(self) -> WriterLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> WriterLock:
        if self.path is None or self.held:
            return self
        with _THREADS:  # the threads of this process take and count locks one at a time
            return self._acquire(str(self.path.absolute()))

    def _acquire(self, key: str) -> WriterLock:
        """acquire(), _THREADS held; `key`: the lock file's absolute path."""
        if key in _HELD:
            if _HELD[key][0] != threading.get_ident():
                raise StoreError(f"{self.target}: {self.what} is being written by another "
                                 "thread of this process; wait for it to finish or write "
                                 "elsewhere")  # fmt: skip
            _HELD[key][1] += 1
            self.held = True
            return self
        if self.beside:
            check_writable(self.target, self.what)
        else:
            check_writable(self.path.parent, self.what, folder=True)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            if self._create():
                _HELD[key] = [threading.get_ident(), 1]
                self.held = True
                return self
            owner = read_owner(self.path)
            if owner is None:  # being written this instant, or emptied: look again
                time.sleep(0.05)
                owner = read_owner(self.path)
            if self._stale(owner):
                self._take_over(owner)
                continue
            if owner is not None and _ours(owner):
                # ours, from a lock object that was not released (an interrupted `with`)
                _HELD[key] = [threading.get_ident(), 1]
                self.held = True
                return self
            raise StoreError(self._busy(owner))
        owner, guard = read_owner(self.path), Path(f"{self.path}.takeover")
        if self._stale(owner) and guard.exists():  # a take-over under way, or one killed
            raise StoreError(
                f"{self.target}: {self.what} is locked by a writer that is no longer running, "
                f"and another process is taking its lock over ({guard} exists); run again in "
                f"a few seconds, or if no cumf-dask process runs, delete {guard}"
            )
        raise StoreError(self._busy(owner))

    def release(self) -> None:
        if self.path is None or not self.held:
            return
        self.held = False
        key = str(self.path.absolute())
        with _THREADS:
            held = _HELD.get(key, [0, 1])
            held[1] -= 1
            if held[1] > 0:
                return
            _HELD.pop(key, None)
            owner = read_owner(self.path)
            if owner is not None and _ours(owner):
                self.path.unlink(missing_ok=True)

    def _create(self) -> bool:
        path = Path(str(self.path))
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except OSError as exc:
            raise StoreError(
                f"cannot write {self.what} at {self.target}: cannot create its lock file "
                f"{path} ({exc.strerror}); choose a writable location"
            ) from None
        with os.fdopen(fd, "w") as fh:
            json.dump(owner_record(), fh)
        return True

    def _stale(self, owner: dict[str, Any] | None) -> bool:
        """The lock file was left by a dead writer: its `owner` is dead, or it names none
        and is older than _EMPTY_STALE_S (killed between creating it and naming itself)."""
        if owner is not None:
            return owner_is_dead(owner)
        try:
            age = time.time() - Path(str(self.path)).stat().st_mtime
        except FileNotFoundError:
            return False
        return age > _EMPTY_STALE_S

    def _take_over(self, stale: dict[str, Any] | None) -> None:
        """Remove a dead owner's lock (`stale`; None: an owner-less one), unless someone
        else took it over first."""
        path = Path(str(self.path))
        guard = Path(f"{path}.takeover")
        try:
            if time.time() - guard.stat().st_mtime > _GUARD_STALE_S:
                guard.unlink(missing_ok=True)
        except FileNotFoundError:
            pass
        try:
            fd = os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return  # another process is taking it over: the next attempt sees its lock
        os.close(fd)
        try:
            if read_owner(path) == stale and self._stale(stale):
                path.unlink(missing_ok=True)
                who = (
                    f"pid {stale.get('pid')} ({stale.get('command') or 'cumf-dask'}), which is "
                    "no longer running"
                    if stale is not None
                    else "a writer killed before it named itself (the lock file is empty)"
                )
                warn(f"{self.target}: took over the lock left by {who}")
        finally:
            guard.unlink(missing_ok=True)

    def _busy(self, owner: dict[str, Any] | None) -> str:
        if owner is None:
            return (
                f"{self.target}: {self.what} is locked by another writer ({self.path} exists "
                f"but names no owner); if no cumf-dask process writes it, delete {self.path} "
                "and run again"
            )
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("time", 0)))
        who = f"pid {owner.get('pid')} on {owner.get('host')}, since {since}" + (
            f": `{owner['command']}`" if owner.get("command") else ""
        )
        here = owner.get("host") == socket.gethostname()
        stale = (
            f"if pid {owner.get('pid')} is not a cumf-dask process any more"
            if here
            else f"if no cumf-dask process runs on {owner.get('host')}"
        )
        return (
            f"{self.target}: {self.what} is being written by another cumf-dask process ({who}); "
            f"wait for it to finish or write elsewhere ({stale}, the lock is stale: delete "
            f"{self.path} and run again)"
        )
