"""Factor files: per-iteration checkpoints and saved models, as Zarr groups in local folders.

Writing. A checkpoint is written whole under a temporary name, then renamed into place, then
the ``LATEST`` pointer is replaced atomically (``os.replace``): an interrupted write leaves
the previous checkpoint valid. A saved model is replaced the same way: the old one is renamed
aside only once the new one is complete. Factors are written by one task per Zarr chunk (their
Dask array is rechunked to the Zarr chunks first), so no chunk is written twice. Writers
exclude each other (:class:`~cumf_dask.locks.WriterLock`: a model's ``<path>.lock``, a
checkpoint folder's ``<folder>.lock``); what a killed writer left (``.tmp-*``, ``.old-*``)
is dealt with by the next writer of the same target, with a warning: a complete copy is put
back where the target is missing, the rest removed.

Integrity. Each array's digest is written with it: a CRC-32 of every chunk's bytes (chunks of
ROW_CHUNK rows, computed by the task that writes the chunk), in the group's attrs. Reading
checks every chunk against it, so a deleted chunk (which Zarr would read as zeros), a garbled
or truncated one, a missing array and unreadable metadata are each one
:class:`~cumf_dask.errors.StoreError` naming the file, never a silently wrong factor. Measured
on a 1,000,000 x 100 float32 factor (400 MB, 2-core test machine): the CRC-32s take 0.11 s
(zlib, ~3.6 GB/s on one core) of a 0.97 s write, and checking them adds 0.12 s to a 0.44 s
read. Chunks of CRC-32 are kept (not one CRC per array) so that a Dask array's chunks are
summed by the tasks that write them, in parallel, and a mismatch names its chunk file.

:meth:`Checkpointer.latest` skips a damaged newest checkpoint for the one before it (the
folder keeps two) and says so with a :class:`~cumf_dask.errors.CumfWarning`.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import shutil
import uuid
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import dask
import dask.array as da
import numpy as np
import zarr

from .errors import CumfWarning, StoreError
from .locks import WriterLock
from .paths import check_writable, local_path

MODEL_FORMAT = "cumf-dask-model"
CHECKPOINT_FORMAT = "cumf-dask-checkpoint"
MODEL_VERSION = 2  # 2: per-chunk CRC-32 digests in attrs["digests"] (1: none, read unchecked)
ROW_CHUNK = 65536
DIGEST = "crc32"
Compute = Callable[[Sequence[Any]], Sequence[Any]]  # computes Dask collections, returns results


# ----------------------------------------------------------------------------- digests


def chunk_crc(block: np.ndarray) -> int:
    """CRC-32 of one chunk's values: its bytes (numbers) or its UTF-8 text (strings)."""
    if block.dtype.kind in "OUST":
        return zlib.crc32("\x00".join(map(str, block.tolist())).encode("utf-8"))
    return zlib.crc32(memoryview(np.ascontiguousarray(block)).cast("B"))


def digests(arr: np.ndarray, rows: int = ROW_CHUNK) -> list[int]:
    """The CRC-32 of each chunk of `rows` rows."""
    return [chunk_crc(arr[lo : lo + rows]) for lo in range(0, max(len(arr), 1), rows)]


def _store_chunk(block: np.ndarray, group: str, name: str, block_info: Any = None) -> np.ndarray:
    """Write one chunk of a rechunked Dask array into array `name` of the Zarr group at
    `group` (a path: cheap to ship, where a Zarr array object is slow for Dask to traverse);
    return the chunk's CRC-32."""
    lo = block_info[0]["array-location"][0][0]
    zarr.open_array(store=group, path=name, mode="r+")[lo : lo + len(block)] = block
    return np.array([chunk_crc(block)], dtype=np.int64)


# ----------------------------------------------------------------------------- writing


def write_factors(
    path: str | Path,
    arrays: dict[str, np.ndarray | da.Array],
    attrs: dict[str, Any],
    compute: Compute | None = None,
    *,
    lock: bool = True,
    replace_any: bool = False,
    what: str = "the model",
    after_error: str = "then save it again",
) -> None:
    """Write factor arrays and attrs to a new Zarr group at `path` (see the module doc).

    An existing `path` is replaced only if it is an earlier model or checkpoint (or empty),
    or anything when `replace_any` (a checkpoint's own name inside its folder). `compute`
    runs the chunk writes of Dask arrays (default: ``dask.compute``). `lock`: take the
    target's writer lock (a checkpoint's folder lock is held by its Checkpointer instead).
    `what` and `after_error` word a full disk's message.
    """
    path = Path(local_path(path))
    check_writable(path, what)
    with WriterLock(path, what) if lock else nullcontext():
        _settle_leftovers(path)
        if not replace_any:
            _check_replaceable(path)
        tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex[:8]}")
        try:
            group = zarr.open_group(str(tmp), mode="w")
            sums = _write_arrays(group, str(tmp), arrays, compute)
            group.attrs.update({**attrs, "digests": sums, "digest": DIGEST,
                                "chunk_rows": ROW_CHUNK, "complete": True})  # fmt: skip
            _move_into_place(tmp, path)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise StoreError(_disk_full(path, arrays, what, after_error)) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _check_replaceable(path: Path) -> None:
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                found = zarr.open_group(str(path), mode="r").attrs.get("format")
        except Exception:
            found = None
        if found not in (MODEL_FORMAT, CHECKPOINT_FORMAT):
            raise StoreError(
                f"{path}: exists and is not a cumf-dask model or checkpoint; refusing to "
                "replace it (choose another path)"
            )


def _leftovers(path: Path) -> list[Path]:
    """The folders a killed writer of `path` left: ``.tmp-*`` (a write not yet in place, or
    complete but not renamed in) and ``.old-*`` (the one it replaced)."""
    if not path.parent.is_dir():
        return []
    name = glob.escape(path.name)
    return [p for prefix in (".tmp-", ".old-") for p in path.parent.glob(f"{prefix}{name}-*")]


def _is_complete(path: Path) -> bool:
    """A complete model or checkpoint (its writer marks it so last)."""
    try:
        attrs = json.loads((path / "zarr.json").read_text()).get("attributes", {})
    except (OSError, ValueError):
        return False
    formats = (MODEL_FORMAT, CHECKPOINT_FORMAT)
    return attrs.get("complete") is True and attrs.get("format") in formats


def _settle_leftovers(path: Path) -> None:
    """Deal with what a killed writer of `path` left (the caller holds the lock). When `path`
    is missing (a save killed between its two renames), the newest complete leftover is put
    back in its place (the new write before the old one); the rest is removed. Each step is
    reported with a CumfWarning."""
    found, notes = _leftovers(path), []
    if not path.exists():
        complete = [p for p in found if _is_complete(p)]
        if complete:
            best = max(complete, key=lambda p: (p.name.startswith(".tmp-"), p.stat().st_mtime))
            best.rename(path)
            found.remove(best)
            notes.append(f"put {best.name} back in its place")
    notes += [_remove(p) for p in found]
    if notes:
        warnings.warn(f"{path}: an interrupted save left folders beside it: {'; '.join(notes)}",
                      CumfWarning, stacklevel=3)  # fmt: skip


def _remove(path: Path) -> str:
    """Delete a leftover folder; 'removed NAME (SIZE)' for the warning that reports it."""
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    shutil.rmtree(path, ignore_errors=True)
    return f"removed {path.name} ({_mb(size)})"


def _write_arrays(group: Any, where: str, arrays: dict[str, Any], compute: Compute | None) -> dict:
    sums: dict[str, list[int]] = {}
    pending: list[tuple[str, Any]] = []
    for name, arr in arrays.items():
        if arr is None:
            continue
        dtype = str if arr.dtype.kind in "OUST" else arr.dtype
        chunks = (min(ROW_CHUNK, max(1, arr.shape[0])), *tuple(arr.shape[1:]))
        target = group.create_array(name, shape=arr.shape, chunks=chunks, dtype=dtype)
        if isinstance(arr, da.Array):
            blocks = arr.rechunk(chunks)
            pending.append((name, blocks.map_blocks(
                _store_chunk, where, name, dtype=np.int64, drop_axis=list(range(1, arr.ndim)),
                chunks=((1,) * blocks.numblocks[0],), name=f"store-{name}-{uuid.uuid4().hex}",
            )))  # fmt: skip
        else:
            target[...] = arr.astype(object) if dtype is str else arr
            sums[name] = digests(np.asarray(arr))
    if pending:
        results = (compute or (lambda cs: dask.compute(*cs)))([p[1] for p in pending])
        for (name, _), crcs in zip(pending, results, strict=True):
            sums[name] = [int(c) for c in np.asarray(crcs)]
    return sums


def _move_into_place(tmp: Path, path: Path) -> None:
    if path.exists():
        old = path.with_name(f".old-{path.name}-{uuid.uuid4().hex[:8]}")
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(path)


def _disk_full(path: Path, arrays: dict[str, Any], what: str, after: str) -> str:
    need = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in arrays.values() if a is not None)
    try:
        free = f", {_mb(shutil.disk_usage(path.parent).free)} free"
    except OSError:
        free = ""
    return (
        f"{path.parent}: disk full while writing {what} (it needs about {_mb(need)}{free}); "
        f"free some space there, {after}"
    )


def _mb(size: int) -> str:
    return f"{size / 1e6:,.1f} MB"


# ----------------------------------------------------------------------------- reading


def read_factors(path: str | Path, expect_format: str = MODEL_FORMAT) -> tuple[dict, dict]:
    """(attrs, {name: numpy array}) of a factor group written by write_factors, verified."""
    kind = "checkpoint" if expect_format == CHECKPOINT_FORMAT else "model"
    group, attrs = _open(path, expect_format, kind)
    sums = attrs.get("digests")
    if sums is None and int(attrs.get("version", 1)) >= 2:
        raise _damaged(path, kind, "its attrs lost the digests of its arrays")
    names = list(sums) if sums is not None else [name for name, _ in group.arrays()]
    out = {}
    for name in names:
        out[name] = _read_array(path, group, name, kind, sums[name] if sums is not None else None)
    _check_shapes(path, attrs, out, kind)
    return attrs, out


# the arrays every model and checkpoint holds: a folder with one of them is a damaged model
FACTOR_ARRAYS = ("user_factors", "item_factors")


def _open(path: str | Path, expect_format: str, kind: str) -> tuple[Any, dict]:
    where = Path(local_path(path))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            group = zarr.open_group(str(where), mode="r")
            attrs = dict(group.attrs)
    except (FileNotFoundError, zarr.errors.GroupNotFoundError):
        if where.is_dir() and any(where.iterdir()):
            if kind == "model" and not any((where / a).exists() for a in FACTOR_ARRAYS):
                raise _not_a_model(path, "a folder without saved factors") from None
            raise _damaged(path, kind, "its zarr.json (the group's metadata) is missing") from None
        left = [p.name for p in _leftovers(where) if _is_complete(p)]
        if left:
            raise StoreError(
                f"{path}: no saved model or checkpoint here, but an interrupted save left "
                f"complete copies beside it ({', '.join(sorted(left))}): rename the newest to "
                f"{where.name}, or save again (that puts one back)"
            ) from None
        raise StoreError(f"{path}: no saved model or checkpoint here") from None
    except Exception as exc:
        raise _damaged(path, kind, f"its zarr.json cannot be read ({exc})") from None
    found = attrs.get("format")
    if found == CHECKPOINT_FORMAT and expect_format == MODEL_FORMAT:
        run = where.parent.parent if where.parent.name == "checkpoints" else "runs/NAME-latest"
        raise StoreError(
            f"{path}: a training checkpoint (iteration {attrs.get('iteration')}), not a saved "
            f"model: give the run folder ({run}) or its model.zarr; a run that stopped before "
            "saving its model goes on from its checkpoints with `cumf-dask train CONFIG "
            "--resume`"
        )
    if kind == "model" and found not in (MODEL_FORMAT, CHECKPOINT_FORMAT):
        what = {"cumf-dask-ratings": "a rating store", None: "a Zarr group of no cumf-dask "
                "format"}.get(found, f"a Zarr group of format {found!r}")  # fmt: skip
        raise _not_a_model(path, what)
    if found != expect_format or not attrs.get("complete"):
        raise StoreError(
            f"{path}: not a complete {expect_format} (format {found!r}); "
            "was it written by cumf-dask, and did the write finish?"
        )
    return group, attrs


def _not_a_model(path: Any, what: str) -> StoreError:
    """A folder that is no model at all (not a damaged one): say what to give instead."""
    return StoreError(f"{path}: not a cumf-dask model ({what}); give a model folder such as "
                      "runs/NAME-latest, or its model.zarr")  # fmt: skip


def _read_array(path: Any, group: Any, name: str, kind: str, sums: list[int] | None) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            arr = group[name]
    except Exception:
        detail = f"array '{name}' is missing ({name}/zarr.json deleted?)"
        raise _damaged(path, kind, detail) from None
    try:
        data = np.asarray(arr[...])
    except Exception as exc:
        raise _damaged(path, kind, _undecodable(arr, name, exc)) from None
    if sums is None:
        return data
    rows = int(arr.chunks[0])
    found = digests(data, rows)
    if len(found) != len(sums):
        detail = f"'{name}' has {len(found)} chunks, its digest lists {len(sums)}"
        raise _damaged(path, kind, detail)
    for k, (got, want) in enumerate(zip(found, sums, strict=True)):
        if got != want:
            key = _chunk_key(name, k, arr.ndim)
            gone = not (Path(local_path(path)) / key).exists()
            detail = (
                f"chunk file {key} is missing (Zarr would read it as zeros)"
                if gone
                else f"chunk {key} does not match its checksum (changed on disk)"
            )
            raise _damaged(path, kind, detail)
    return data


def _undecodable(arr: Any, name: str, exc: Exception) -> str:
    """Which chunk of `arr` cannot be read, found by reading chunk by chunk."""
    rows = int(arr.chunks[0])
    for k, lo in enumerate(range(0, arr.shape[0], rows)):
        try:
            arr[lo : lo + rows]
        except Exception as chunk_exc:
            return (
                f"chunk {_chunk_key(name, k, arr.ndim)} cannot be decoded ({chunk_exc}): it is "
                "truncated or garbled"
            )
    return f"'{name}' cannot be read ({exc})"


def _chunk_key(name: str, k: int, ndim: int) -> str:
    return "/".join([name, "c", str(k), *["0"] * (ndim - 1)])


def _check_shapes(path: Any, attrs: dict, arrays: dict, kind: str) -> None:
    f = attrs.get("factors")
    for name, rows in (("user_factors", attrs.get("m")), ("item_factors", attrs.get("n"))):
        if name not in arrays:
            raise _damaged(path, kind, f"array '{name}' is missing")
        if rows is not None and f is not None and arrays[name].shape != (rows, f):
            raise _damaged(
                path, kind, f"'{name}' has shape {arrays[name].shape}, expected {(rows, f)}"
            )


def _damaged(path: Any, kind: str, detail: str) -> StoreError:
    advice = (
        "delete this checkpoint folder; resuming then uses the previous one"
        if kind == "checkpoint"
        else "train it again, or restore it from its run's checkpoints with `cumf-dask train "
        "CONFIG --resume`"
    )
    return StoreError(f"{path}: damaged {kind}: {detail}; {advice}")


# ----------------------------------------------------------------------------- checkpoints


def _is_checkpoint_name(name: str) -> bool:
    return name.startswith("iter-") and name[5:].isdigit()


class Checkpointer:
    """Per-iteration checkpoints in a directory: iter-00003/ ... plus an atomic LATEST file.

    The folder has one writer at a time: :meth:`locked` (``<directory>.lock``, held by a
    fit for its whole run).
    """

    def __init__(self, directory: str | Path, keep: int = 2):
        self.directory = Path(local_path(directory))
        self.keep = keep

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the folder's writer lock; a killed save's temporary folders are removed."""
        check_writable(self.directory, "checkpoints", folder=True)
        with WriterLock(self.directory, "the checkpoint folder"):
            removed = [_remove(p) for p in self.directory.glob(".tmp-*") if p.is_dir()]
            if removed:
                warnings.warn(f"{self.directory}: a killed checkpoint write left folders: "
                              f"{'; '.join(removed)}", CumfWarning, stacklevel=3)  # fmt: skip
            yield

    def name(self, iteration: int) -> str:
        return f"iter-{iteration:05d}"

    def save(
        self,
        iteration: int,
        arrays: dict[str, Any],
        attrs: dict[str, Any],
        compute: Compute | None = None,
    ) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        name = self.name(iteration)
        previous = self._pointer()
        after = (
            f"then run again with --resume (resume=True): checkpoint {previous} is intact"
            if previous
            else "then run again"
        )
        write_factors(
            self.directory / name,
            arrays,
            {**attrs, "format": CHECKPOINT_FORMAT, "version": MODEL_VERSION,
             "iteration": iteration},
            compute, lock=False, replace_any=True, what=f"checkpoint {name}", after_error=after,
        )  # fmt: skip
        pointer = self.directory / f".LATEST-{uuid.uuid4().hex[:8]}"
        pointer.write_text(name + "\n")
        os.replace(pointer, self.directory / "LATEST")
        for old in self.directory.glob("iter-*"):
            number = int(old.name[5:]) if _is_checkpoint_name(old.name) else None
            # earlier than the last `keep`, or left by a longer run: never the new one
            if number is not None and not iteration - self.keep < number <= iteration:
                shutil.rmtree(old, ignore_errors=True)

    def load(self, iteration: int) -> tuple[dict, dict]:
        """(attrs, arrays) of one checkpoint, verified."""
        return read_factors(self.directory / self.name(iteration), CHECKPOINT_FORMAT)

    def _pointer(self) -> str | None:
        try:
            return (self.directory / "LATEST").read_text().strip() or None
        except OSError:
            return None

    def names(self) -> list[str]:
        """The checkpoints' folder names, newest first."""
        found = (p.name for p in self.directory.glob("iter-*") if _is_checkpoint_name(p.name))
        return sorted(found, reverse=True)

    def latest(self) -> tuple[int, dict, dict] | None:
        """(iteration, attrs, arrays) of the last intact checkpoint, or None if there is none.

        The one LATEST names is tried first, then the earlier ones, newest first; each one
        skipped for damage is reported with a CumfWarning. None intact is a StoreError.
        """
        pointer, names = self._pointer(), self.names()
        if pointer is None and not names:
            return None
        if pointer is not None and pointer not in names:
            warnings.warn(f"{self.directory}/LATEST names {pointer[:40]!r}, not a checkpoint "
                          "there; trying the newest one", CumfWarning, stacklevel=2)  # fmt: skip
            pointer = None
        if pointer is not None:
            names = [pointer] + [n for n in names if n < pointer]
        problems = []
        for name in names:
            try:
                attrs, arrays = read_factors(self.directory / name, CHECKPOINT_FORMAT)
            except StoreError as exc:
                problems.append(str(exc))
                continue
            if problems:
                warnings.warn(
                    f"skipped {len(problems)} damaged checkpoint(s), resuming from {name}: "
                    + " | ".join(problems),
                    CumfWarning,
                    stacklevel=2,
                )
            return int(attrs["iteration"]), attrs, arrays
        raise StoreError(
            f"{self.directory}: no intact checkpoint to resume from ("
            + (" | ".join(problems) or "LATEST names no checkpoint")
            + "); run again without --resume (resume=False) to start over"
        )
