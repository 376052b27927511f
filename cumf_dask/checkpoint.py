"""Factor files: per-iteration checkpoints and saved models, as Zarr groups in local folders.

A checkpoint is written whole under a temporary name, then renamed into place, then the
``LATEST`` pointer is replaced atomically (``os.replace``): an interrupted write leaves the
previous checkpoint valid. A saved model is replaced the same way: the old one is renamed
aside only once the new one is complete. Factors are written by one task per Zarr chunk
(their Dask array is rechunked to the Zarr chunks first), so no chunk is written twice.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import dask.array as da
import numpy as np
import zarr

from .errors import StoreError
from .paths import local_path

MODEL_FORMAT = "cumf-dask-model"
CHECKPOINT_FORMAT = "cumf-dask-checkpoint"
MODEL_VERSION = 1
ROW_CHUNK = 65536


def write_factors(
    path: str | Path,
    arrays: dict[str, np.ndarray | da.Array],
    attrs: dict[str, Any],
    client: Any = None,
) -> None:
    """Write factor arrays and attrs to a new Zarr group at `path` (see the module doc).

    An existing `path` is replaced only if it is an earlier model or checkpoint (or empty).
    """
    path = Path(local_path(path))
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        try:
            found = zarr.open_group(str(path), mode="r").attrs.get("format")
        except Exception:
            found = None
        if found not in (MODEL_FORMAT, CHECKPOINT_FORMAT):
            raise StoreError(
                f"{path}: exists and is not a cumf-dask model or checkpoint; refusing to "
                "replace it (choose another path)"
            )
    tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        group = zarr.open_group(str(tmp), mode="w")
        pending = []
        for name, arr in arrays.items():
            if arr is None:
                continue
            dtype = str if arr.dtype.kind in "OUS" else arr.dtype
            chunks = (min(ROW_CHUNK, max(1, arr.shape[0])), *tuple(arr.shape[1:]))
            target = group.create_array(name, shape=arr.shape, chunks=chunks, dtype=dtype)
            if isinstance(arr, da.Array):
                pending.append(arr.rechunk(chunks).store(target, lock=False, compute=False))
            else:
                target[...] = arr.astype(object) if dtype is str else arr
        if pending:
            if client is not None:
                client.compute(pending, sync=True)
            else:
                da.compute(*pending)
        group.attrs.update({**attrs, "complete": True})
        if path.exists():
            old = path.with_name(f".old-{path.name}-{uuid.uuid4().hex[:8]}")
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_factors(path: str | Path, expect_format: str = MODEL_FORMAT) -> tuple[dict, dict]:
    """(attrs, {name: numpy array}) of a factor group written by write_factors."""
    try:
        group = zarr.open_group(local_path(path), mode="r")
    except (FileNotFoundError, zarr.errors.GroupNotFoundError):
        raise StoreError(f"{path}: no saved model or checkpoint here") from None
    attrs = dict(group.attrs)
    if attrs.get("format") != expect_format or not attrs.get("complete"):
        raise StoreError(
            f"{path}: not a complete {expect_format} (format {attrs.get('format')!r}); "
            "was it written by cumf-dask, and did the write finish?"
        )
    return attrs, {name: np.asarray(arr[...]) for name, arr in group.arrays()}


class Checkpointer:
    """Per-iteration checkpoints in a directory: iter-00003/ ... plus an atomic LATEST file."""

    def __init__(self, directory: str | Path, keep: int = 2):
        self.directory = Path(local_path(directory))
        self.keep = keep

    def save(self, iteration: int, arrays: dict[str, Any], attrs: dict[str, Any], client=None):
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"iter-{iteration:05d}"
        write_factors(
            self.directory / name,
            arrays,
            {**attrs, "format": CHECKPOINT_FORMAT, "iteration": iteration},
            client,
        )
        pointer = self.directory / f".LATEST-{uuid.uuid4().hex[:8]}"
        pointer.write_text(name + "\n")
        os.replace(pointer, self.directory / "LATEST")
        for old in self.directory.glob("iter-*"):
            number = int(old.name.removeprefix("iter-")) if old.name[5:].isdigit() else None
            # earlier than the last `keep`, or left by a longer run: never the new one
            if number is not None and not iteration - self.keep < number <= iteration:
                shutil.rmtree(old, ignore_errors=True)

    def latest(self) -> tuple[int, dict, dict] | None:
        """(iteration, attrs, arrays) of the last complete checkpoint, or None."""
        pointer = self.directory / "LATEST"
        if not pointer.is_file():
            return None
        path = self.directory / pointer.read_text().strip()
        attrs, arrays = read_factors(path, CHECKPOINT_FORMAT)
        return int(attrs["iteration"]), attrs, arrays
