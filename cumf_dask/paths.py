"""Locations of stores, models and checkpoints: local paths or fsspec URLs, told apart once."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from os import PathLike
from pathlib import Path

from .errors import StoreError

#: fsspec's schemes of the local filesystem: written as plain paths (renamed into place, locked)
_LOCAL_SCHEMES = ("file://", "local://")


def normalize_url(url: str | PathLike[str]) -> str:
    """A location as a string: no trailing slash; ``file://`` and ``local://`` URLs become
    plain local paths, and a local path's leading ``~`` the home folder."""
    text = str(url).rstrip("/") or "/"
    for scheme in _LOCAL_SCHEMES:
        if text.startswith(scheme):
            text = text[len(scheme) :]
            break
    return expand_home(text)


def expand_home(path: str) -> str:
    """A local path with a leading ``~`` (or ``~user``) expanded, as a shell would; a URL as
    it is."""
    return os.path.expanduser(path) if path.startswith("~") else path


def is_url(url: str | PathLike[str]) -> bool:
    """True for a remote fsspec URL (``s3://...``, ``memory://...``), False for a local path."""
    return "://" in normalize_url(url)


def for_zarr(url: str | PathLike[str]) -> str | Path:
    """A location as zarr is to open it: a URL as it is, a local path as a Path (zarr 3.4
    parses a string as a URL, so a '?' or '#' in a folder's name would cut the path there)."""
    text = normalize_url(url)
    return text if is_url(text) else Path(text)


def local_path(path: str | PathLike[str], what: str = "models and checkpoints") -> str:
    """`path` as a local path; a URL is refused (`what` is written by renaming folders)."""
    text = normalize_url(path)
    if is_url(text):
        raise StoreError(
            f"{text}: {what} are written to local or mounted folders, not URLs; give a path"
        )
    return text


def check_writable(path: str | PathLike[str], what: str, *, folder: bool = False) -> None:
    """Refuse at once, before any input is read, to write `what` at a local `path` that
    cannot be written: a parent is a file, or the nearest existing folder is read-only.

    `folder`: `path` is a folder written into (a run or checkpoint folder), else a target
    created beside its siblings (a store, a model). URLs are not checked here.
    """
    text = normalize_url(path)
    if is_url(text):
        return
    target = Path(text)
    if folder and target.exists() and not target.is_dir():
        raise StoreError(f"cannot write {what} in {text}: it is a file, not a folder; "
                         "choose another path")  # fmt: skip
    existing = target if folder else target.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise StoreError(
            f"cannot write {what} at {text}: {existing} is a file, not a folder; choose "
            "another path"
        )
    if not _can_create(existing):
        raise StoreError(
            f"cannot write {what} at {text}: the folder {existing} is not writable (read-only "
            "or no permission); choose another path"
        )


def _can_create(folder: Path) -> bool:
    """Whether a file can be created in `folder` (tried for real: root ignores mode bits)."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    try:
        fd, name = tempfile.mkstemp(prefix=".cumf-write-test-", dir=folder)
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


@contextmanager
def disk_full_as(folder: str | PathLike[str], what: str, fix: str) -> Iterator[None]:
    """A full disk (ENOSPC, EDQUOT, or the short write NumPy's ``tofile`` reports) while
    writing `what` in `folder` as one StoreError naming the folder, its free space and `fix`."""
    try:
        yield
    except OSError as exc:
        short = "requested and" in str(exc) and "written" in str(exc)
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT) and not short:
            raise
        try:
            free = f" ({shutil.disk_usage(folder).free / 1e6:,.1f} MB free)"
        except OSError:
            free = ""
        raise StoreError(f"{folder}: disk full while writing {what}{free}; {fix}") from None


@contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM that arrive inside wait until it ends, then act as they would
    have: for steps that must not be cut in two (a Ctrl-C between the two renames that
    replace a folder lost both versions). Only the main thread runs Python's signal
    handlers, so elsewhere nothing needs deferring."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    held = {sig: handler for sig, handler in before.items() if handler is not None}
    for sig in held:  # None: a handler not set from Python, left as it is
        signal.signal(sig, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(caught):
            signal.raise_signal(sig)  # to the handler restored above


def replace_folder(new: Path, target: Path, old: Path) -> None:
    """Move the finished folder `new` to `target`. An existing `target` is renamed to `old`
    first and removed once the new one is in place; the two renames happen both or neither
    (a signal waits, an error puts the old one back)."""
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        new.rename(target)
        return
    try:
        with signals_deferred():  # a signal that waited is raised as this block ends
            target.rename(old)
            try:
                new.rename(target)
            except BaseException:
                old.rename(target)
                raise
    finally:
        if not new.exists():  # in place: the old one goes, whatever is raised
            shutil.rmtree(old, ignore_errors=True)


def zarr_writes_settled(timeout: float = 10.0) -> None:
    """Wait (up to `timeout` s) for the writes zarr's I/O thread still has under way: an
    interrupt ends the caller's wait for a write, not the write, so a folder removed after
    it could be written into again (a partial folder holding one zarr.json left behind)."""
    try:
        from zarr.core import sync

        loop = sync.loop[0]
    except (ImportError, AttributeError, IndexError):  # another zarr: nothing to wait for
        return
    if loop is None or not loop.is_running():
        return

    async def drain() -> None:
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)

    with suppress(Exception):
        asyncio.run_coroutine_threadsafe(drain(), loop).result(timeout + 1)
