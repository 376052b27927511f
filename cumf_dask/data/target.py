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
with a warning that says what and how much. Remote targets are not locked.
"""

from __future__ import annotations

import glob
import json
import shutil
import uuid
import warnings
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import zarr

from ..errors import CumfWarning, StoreError
from ..locks import WriterLock
from ..paths import check_writable, disk_full_as, is_url, normalize_url
from .store import FORMAT, RatingsStore

WHAT = "the rating store"


def claim(url: str) -> WriterLock:
    """Take `url`'s writer lock (checked writable first) and clear a killed build's leftovers.

    The caller releases the lock (``lock.release()``) when the build is published or failed.
    """
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
    name = glob.escape(target.name)
    old = (p for p in target.parent.glob(f".old-{name}-*") if _local_format(p) == FORMAT)
    found = [*target.parent.glob(f".partial-{name}-*"), *old]
    removed = []
    for path in found:
        if path.is_dir():
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            shutil.rmtree(path, ignore_errors=True)
            removed.append(f"{path.name} ({size / 1e6:,.1f} MB)")
    if removed:
        warnings.warn(
            f"removed what an interrupted build of {url} left: {', '.join(removed)}",
            CumfWarning,
            stacklevel=3,
        )


def check_target(url: str, overwrite: bool) -> None:
    """Refuse to replace anything but a cumf-dask store, and a store only with `overwrite`.

    Nothing there, or an empty folder, is fine; a file, a foreign folder or a foreign Zarr
    group is never deleted.
    """
    url = normalize_url(url)
    if is_url(url):
        try:
            fmt = zarr.open_group(url, mode="r").attrs.get("format")
        except Exception:
            return
    else:
        path = Path(url)
        if not path.exists() or (path.is_dir() and not any(path.iterdir())):
            return
        fmt = _local_format(path)
    if fmt != FORMAT:
        raise StoreError(
            f"{url}: exists and is not a cumf-dask rating store; refusing to replace it "
            "(choose another output path)"
        )
    if not overwrite:
        raise StoreError(f"{url}: already exists; pass overwrite=True (--overwrite) to replace")


def _local_format(path: Path) -> str | None:
    """The `format` attribute of a local Zarr v3 group folder, or None."""
    meta = path / "zarr.json"
    if not (path.is_dir() and meta.is_file()):
        return None
    try:
        return json.loads(meta.read_text()).get("attributes", {}).get("format")
    except (OSError, ValueError):
        return None


def writing(url: str) -> AbstractContextManager[None]:
    """Around a store build: a full disk under a local target is one StoreError naming it."""
    if is_url(url):
        return nullcontext()
    return disk_full_as(Path(url).parent, f"the store {Path(url).name}",
                        "free space there, or write the store elsewhere")  # fmt: skip


def work_url(url: str) -> str:
    """Where a build writes before it is complete: a new hidden folder beside a local target,
    in place for URLs."""
    return url if is_url(url) else str(_beside(Path(url), "partial"))


def _beside(target: Path, kind: str) -> Path:
    return target.with_name(f".{kind}-{target.name}-{uuid.uuid4().hex[:8]}")


def discard(work: str) -> None:
    """Remove a failed local build; a remote one stays where it is, never marked complete."""
    if not is_url(work):
        shutil.rmtree(work, ignore_errors=True)


def publish(work: str, url: str) -> RatingsStore:
    """Move a finished local build into place (the old store goes only now) and open it."""
    if work != url:
        _replace_dir(work, url)
    return RatingsStore.open(url)


def _replace_dir(src: str, dst: str) -> None:
    """Move a finished store into place; the old one is removed only once the new one is whole."""
    target = Path(dst)
    if target.exists():
        trash = _beside(target, "old")
        target.rename(trash)
        Path(src).rename(target)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        Path(src).rename(target)
