"""Where a store build writes and how it is published: one safety rule for every builder.

A build never replaces anything but a cumf-dask store, and a store only when asked
(:func:`check_target`). A local build writes beside its target (:func:`work_url`) and is
moved into place only once complete (:func:`publish`), so an interrupted build leaves the
old store whole; a remote (fsspec URL) build writes in place and is marked complete last.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import zarr

from ..errors import StoreError
from ..paths import is_url, normalize_url
from .store import FORMAT, RatingsStore


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


def work_url(url: str) -> str:
    """Where a build writes before it is complete: beside a local target, in place for URLs."""
    return url if is_url(url) else f"{url}.partial"


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
        trash = Path(f"{dst}.old")
        shutil.rmtree(trash, ignore_errors=True)
        target.rename(trash)
        Path(src).rename(target)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        Path(src).rename(target)
