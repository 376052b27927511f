"""Where a store build writes and how it is published: one safety rule for every builder.

A build never replaces anything but a cumf-dask store, and a store only when asked
(:func:`check_target`). A local build writes beside its target (:func:`work_url`) and is
moved into place only once complete (:func:`publish`), so an interrupted build leaves the
old store whole; a remote (fsspec URL) build writes in place and is marked complete last
(the builder checks all of its data before it writes there, so only a failure while writing
leaves an incomplete store in place of the old one).

A build holds its target's writer lock (:func:`claim`: ``<store>.lock``, checked writable
before any input is read); under it, what a killed build of the same target left (its
work folder ``.partial-<store>-<id>`` and the old store set aside, ``.old-<store>-<id>``,
both hidden and named afresh by each build, so never a folder of the user's) is removed,
with a warning that says what and how much. Remote targets are not locked. A local target
that is a symbolic link is built, locked and published where the link points
(:func:`resolve_target`): the store is replaced there and the link kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from pathlib import Path
from typing import Any

import fsspec

from ..errors import ConfigError, CumfError, StoreError, warn
from ..locks import WriterLock
from ..paths import (
    check_writable,
    disk_full_as,
    is_url,
    normalize_url,
    replace_folder,
    zarr_writes_settled,
)
from .store import FORMAT, RatingsStore

WHAT = "the rating store"
#: hex digits of the id that names a build's work folder and set-aside store (:func:`_beside`)
_ID_DIGITS = 8


def resolve_target(url: str) -> str:
    """Where a build of `url` is written: a local target that is a symbolic link is the path
    it points to (so the store is replaced there, on that disk, and the link kept, and one
    lock covers both names); any other target as it is."""
    path = Path(url)
    if is_url(url) or not path.is_symlink():
        return url
    try:
        return str(path.resolve())
    except (RuntimeError, OSError) as exc:  # a loop of links
        raise StoreError(f"{url}: a symbolic link that cannot be followed ({exc}); point it at "
                         "a folder, or give another path") from None


def claim(url: str) -> WriterLock:
    """Take `url`'s writer lock (checked writable first) and clear a killed build's leftovers.

    The caller releases the lock (``lock.release()``) when the build is published or failed.
    """
    url = resolve_target(url)
    check_writable(url, WHAT)
    lock = WriterLock(url, WHAT).acquire()
    try:
        if not is_url(url):
            clear_leftovers(url)
    except BaseException:
        lock.release()
        raise
    return lock


def clear_leftovers(url: str) -> None:
    """Remove the work folders and set-aside stores killed builds of `url` left (the caller
    holds the lock, so no live build owns them), saying what was removed."""
    target = Path(url)
    if not target.parent.is_dir():
        return
    found = sorted(p for p in target.parent.iterdir() if _is_leftover(p, target))
    removed = [what for what in map(_remove, found) if what]
    if removed:
        warn(f"removed what an interrupted build of {url} left: {', '.join(removed)}")


def _is_leftover(path: Path, target: Path) -> bool:
    """Whether `path` is a killed build's work folder or set-aside store of `target`: its name
    exactly as :func:`_beside` makes them (``.partial-a-b-<id>`` belongs to a build of
    ``a-b``, never of ``a``), and a set-aside store only where it is one."""
    name = re.escape(target.name)
    found = re.fullmatch(rf"\.(partial|old)-{name}-[0-9a-f]{{{_ID_DIGITS}}}", path.name)
    if found is None:
        return False
    return found.group(1) == "partial" or _local_format(path) == FORMAT


def _remove(path: Path) -> str | None:
    """Remove a leftover (a symbolic link: the link alone) and say what was removed; None
    where nothing was (not a folder or a link, or it could not be removed)."""
    if path.is_symlink():
        what = f"{path.name} (a link to {os.readlink(path)})"
        with suppress(OSError):
            path.unlink()
    elif path.is_dir():
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        what = f"{path.name} ({size / 1e6:,.1f} MB)"
        shutil.rmtree(path, ignore_errors=True)
    else:
        return None
    return None if os.path.lexists(path) else what


def check_target(url: str, overwrite: bool) -> None:
    """Refuse to replace anything but a cumf-dask store, and a store only with `overwrite`.

    Nothing there, or an empty folder, is fine; a file, a foreign folder or a foreign Zarr
    group is never deleted, at a local path or a URL.
    """
    url = normalize_url(url)
    fmt = _remote_occupant(url) if is_url(url) else _local_occupant(Path(url))
    if fmt is None:
        return
    if fmt != FORMAT:
        raise StoreError(
            f"{url}: exists and is not a cumf-dask rating store; refusing to replace it "
            "(choose another output path)"
        )
    if not overwrite:
        raise StoreError(f"{url}: already exists; pass overwrite=True (--overwrite) to replace")


def _local_occupant(path: Path) -> str | None:
    """What is at a local target: None for nothing (or an empty folder), else the `format`
    attribute of the Zarr group there ("" for anything else)."""
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return None
    return _local_format(path) or ""


def _remote_occupant(url: str) -> str | None:
    """What is at a URL target, as :func:`_local_occupant` says it, asked of its filesystem:
    only FileNotFoundError means nothing is there (a network or permission error is raised,
    never taken for an empty target that may be written over)."""
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:  # a scheme fsspec does not know, or lacks a package
        raise ConfigError(
            f"{url}: cannot write there ({exc}); install the filesystem package its scheme "
            "needs (such as s3fs or gcsfs), or give a local path"
        ) from None
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return None
    if info["type"] != "directory":
        return ""
    if not fs.ls(path, detail=False):
        return None
    try:
        meta = json.loads(fs.cat_file(f"{path}/zarr.json"))
    except (FileNotFoundError, ValueError):
        return ""
    return _format_of(meta) or ""


def _local_format(path: Path) -> str | None:
    """The `format` attribute of a local Zarr v3 group folder, or None."""
    meta = path / "zarr.json"
    if not (path.is_dir() and meta.is_file()):
        return None
    try:
        return _format_of(json.loads(meta.read_text()))
    except (OSError, ValueError):
        return None


def _format_of(meta: Any) -> str | None:
    """The `format` attribute in a group's zarr.json document, or None."""
    attributes = meta.get("attributes") if isinstance(meta, dict) else None
    return attributes.get("format") if isinstance(attributes, dict) else None


def writing(url: str) -> AbstractContextManager[None]:
    """Around a store build: a full disk under a local target is one StoreError naming it."""
    if is_url(url):
        return nullcontext()
    return disk_full_as(Path(resolve_target(url)).parent, f"the store {Path(url).name}",
                        "free space there, or write the store elsewhere")  # fmt: skip


@contextmanager
def naming_target(work: str, url: str) -> Iterator[None]:
    """Around a build in `work`: a cumf-dask error, or an operating system's about a file,
    names the user's target `url`, not the hidden work folder (which is removed by the time
    the message is read)."""
    try:
        yield
    except CumfError as exc:
        exc.args = tuple(a.replace(work, url) if isinstance(a, str) else a for a in exc.args)
        raise
    except OSError as exc:
        for name in ("filename", "filename2"):
            if isinstance(getattr(exc, name), str):
                setattr(exc, name, getattr(exc, name).replace(work, url))
        raise


def work_url(url: str) -> str:
    """Where a build writes before it is complete: a new hidden folder beside a local target,
    in place for URLs."""
    return url if is_url(url) else str(_beside(Path(resolve_target(url)), "partial"))


def _beside(target: Path, kind: str) -> Path:
    """A new hidden name beside `target`, ``.<kind>-<name>-<id>`` (see :func:`_is_leftover`)."""
    return target.with_name(f".{kind}-{target.name}-{uuid.uuid4().hex[:_ID_DIGITS]}")


def discard(work: str) -> None:
    """Remove a failed local build; a remote one stays where it is, never marked complete."""
    if not is_url(work):
        zarr_writes_settled()  # an interrupted write could create files in it again
        shutil.rmtree(work, ignore_errors=True)


def publish(work: str, url: str) -> RatingsStore:
    """Move a finished local build into place (the old store goes only now) and open it."""
    if work != url:
        target = Path(resolve_target(url))
        replace_folder(Path(work), target, _beside(target, "old"))
    return RatingsStore.open(url)
