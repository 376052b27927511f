"""Factor files: per-iteration checkpoints and saved models, as Zarr groups in local folders.

Writing. A checkpoint is written whole under a temporary name, then renamed into place, then
the ``LATEST`` pointer is replaced atomically (``os.replace``): an interrupted write leaves
the previous checkpoint valid. A saved model is replaced the same way: the old one is renamed
aside only once the new one is complete. Each Zarr chunk is written once, numbers by a
pool of threads (the writes and CRCs release the GIL): here for arrays in this process, and
on the workers for a fit's factors (:class:`ChunkWrites`: each worker writes the chunks
within its pieces, each thread copying one chunk at a time to host memory). Writers
exclude each other (:class:`~cumf_dask.locks.WriterLock`: a model's ``<path>.lock``, a
checkpoint folder's ``<folder>.lock``); what a killed writer left (``.tmp-*``, ``.old-*``)
is dealt with by the next writer of the same target, with a warning: a complete copy is put
back where the target is missing, the rest removed.

Integrity. Each array's digest is written with it: a CRC-32 of every chunk's bytes (chunks of
ROW_CHUNK rows, computed by the thread that writes the chunk), in the group's attrs. Reading
checks every chunk against it, so a deleted chunk (which Zarr would read as zeros), a garbled
or truncated one, a missing array and unreadable metadata are each one
:class:`~cumf_dask.errors.StoreError` naming the file, never a silently wrong factor. Measured
on a 1,000,000 x 100 float32 factor (400 MB, 2-core test machine): the CRC-32s take 0.11 s
(zlib, ~3.6 GB/s on one core) of a 0.97 s write, and checking them adds 0.12 s to a 0.44 s
read (through zarr, on one thread, before reads went straight to the chunk files on
SAVE_THREADS threads: 6.3 GB in 0.5 s on the H100 machine, RESULTS.md). Chunks of CRC-32 are
kept (not one CRC per array) so that chunks are summed by the threads that write or read
them, in parallel, and a mismatch names its chunk file.

:meth:`Checkpointer.latest` skips a damaged newest checkpoint for the one before it (the
folder keeps two) and says so with a :class:`~cumf_dask.errors.CumfWarning`.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
import uuid
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from contextlib import contextmanager, nullcontext, suppress
from functools import partial
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import dask
import numpy as np
import zarr

from .errors import StoreError, warn
from .locks import WriterLock
from .paths import check_writable, for_zarr, local_path, replace_folder, zarr_writes_settled
from .threads import run as threads_run

MODEL_FORMAT = "cumf-dask-model"
CHECKPOINT_FORMAT = "cumf-dask-checkpoint"
MODEL_VERSION = 2  # 2: per-chunk CRC-32 digests in attrs["digests"] (1: none, read unchecked)
ROW_CHUNK = 65536
DIGEST = "crc32"
SUFFIX = "[0-9a-f]{8}"  # a temporary name's random part: uuid4().hex[:8]
Compute = Callable[[Sequence[Any]], Sequence[Any]]  # computes Dask collections, returns results
SAVE_THREADS = min(16, os.cpu_count() or 1)  # threads writing an array held here


# ----------------------------------------------------------------------------- digests


def chunk_crc(block: np.ndarray) -> int:
    """CRC-32 of one chunk's values: its bytes (numbers) or its UTF-8 text (strings)."""
    if block.dtype.kind in "OUST":
        return zlib.crc32("\x00".join(map(str, block.tolist())).encode("utf-8"))
    return zlib.crc32(memoryview(np.ascontiguousarray(block).reshape(-1)).cast("B"))


def digests(arr: np.ndarray, rows: int = ROW_CHUNK) -> list[int]:
    """The CRC-32 of each chunk of `rows` rows (numbers: SAVE_THREADS at a time)."""
    ranges = chunk_ranges(len(arr), rows)
    if arr.dtype.kind in "OUST":
        return [chunk_crc(arr[a:b]) for _, a, b in ranges]
    crcs = [0] * len(ranges)

    def job(index: int, first: int, end: int) -> None:
        crcs[index] = chunk_crc(arr[first:end])

    threads_run([partial(job, *chunk) for chunk in ranges], SAVE_THREADS, use="save")
    return crcs


def chunk_ranges(n_rows: int, rows: int = ROW_CHUNK) -> list[tuple[int, int, int]]:
    """(index, first row, end row) of each chunk of `rows` rows of an array of `n_rows`
    (one empty chunk when it has none: what :func:`digests` sums)."""
    return [(k, lo, min(lo + rows, n_rows)) for k, lo in enumerate(range(0, max(n_rows, 1), rows))]


def store_rows(where: str, name: str, first: int, block: np.ndarray) -> int:
    """Write `block` as rows first.. (whole chunks) of array `name` of the Zarr group at
    `where` (a path: cheap to ship to a worker); its CRC-32."""
    zarr.open_array(store=for_zarr(where), path=name, mode="r+")[first : first + len(block)] = block
    return chunk_crc(block)


def store_chunks(
    where: str, name: str, rows_of: Callable[[int, int], np.ndarray],
    chunks: Sequence[tuple[int, int, int]], threads: int,
) -> dict[int, int]:  # fmt: skip
    """Write the `chunks` (:func:`chunk_ranges`) of array `name`, `threads` at a time, each
    from ``rows_of(first, end)`` (rows on the host, made as the chunk is written: a factor
    is never whole in host memory); {chunk index: CRC-32}. The writes and CRCs release the
    GIL: 16 threads wrote 8.5 GB/s where one wrote 1.2 (H100 machine, RESULTS.md)."""
    crcs: dict[int, int] = {}

    def job(index: int, first: int, end: int) -> None:
        crcs[index] = store_rows(where, name, first, rows_of(first, end))

    threads_run([partial(job, *chunk) for chunk in chunks], threads, use="save")
    return crcs


@runtime_checkable
class ChunkWrites(Protocol):
    """An array held elsewhere (a fit's factor on its workers) that writes its own chunks
    into a group :func:`write_factors` made."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def writes(self, where: str, name: str, rows: int) -> list[Any]:
        """Dask collections that write every chunk of `rows` rows of array `name` at
        `where`, each computing to {chunk index: CRC-32} of those it wrote."""
        ...


# ----------------------------------------------------------------------------- writing


def write_factors(
    path: str | Path,
    arrays: dict[str, np.ndarray | ChunkWrites | None],
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
    runs the chunk writes of arrays held elsewhere (:class:`ChunkWrites`; default:
    ``dask.compute``). `lock`: take the
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
            group = zarr.open_group(for_zarr(tmp), mode="w")
            sums = _write_arrays(group, str(tmp), arrays, compute)
            group.update_attributes({**attrs, "digests": sums, "digest": DIGEST,
                                "chunk_rows": ROW_CHUNK, "complete": True})  # fmt: skip
            replace_folder(tmp, path, path.with_name(f".old-{path.name}-{uuid.uuid4().hex[:8]}"))
        except BaseException as exc:
            zarr_writes_settled()  # an interrupted write could create files in tmp again
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreError(_disk_full(path, arrays, what, after_error)) from None
            raise


def _check_replaceable(path: Path) -> None:
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                found = zarr.open_group(for_zarr(path), mode="r").attrs.get("format")
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
    mine = re.compile(rf"\.(tmp|old)-{re.escape(path.name)}-{SUFFIX}")
    return sorted(p for p in path.parent.iterdir() if mine.fullmatch(p.name))


def interrupted_copies(path: Path) -> list[str]:
    """The names of the complete copies an interrupted save of `path` left beside it."""
    return sorted(p.name for p in _leftovers(path) if _is_complete(p))


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
        warn(f"{path}: an interrupted save left folders beside it: {'; '.join(notes)}")


def _remove(path: Path) -> str:
    """Delete a leftover folder or file; 'removed NAME (SIZE)' for the warning that reports
    it."""
    if not path.is_dir():
        size = path.stat().st_size
        path.unlink(missing_ok=True)
    else:
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        shutil.rmtree(path, ignore_errors=True)
    return f"removed {path.name} ({_mb(size)})"


def _write_arrays(
    group: Any, where: str, arrays: dict[str, np.ndarray | ChunkWrites | None],
    compute: Compute | None,
) -> dict:  # fmt: skip
    sums: dict[str, list[int]] = {}
    pending: list[tuple[str, int, list[Any]]] = []
    for name, arr in arrays.items():
        if arr is None:
            continue
        dtype = str if arr.dtype.kind in "OUST" else arr.dtype
        chunks = (min(ROW_CHUNK, max(1, arr.shape[0])), *tuple(arr.shape[1:]))
        # uncompressed: Zstd saves ~7% of a factor's random-looking floats, and it took 5x
        # the time of the write (a 48,000 x 100 factor: 100 ms, where 19 ms without)
        target = group.create_array(name, shape=arr.shape, chunks=chunks, dtype=dtype,
                                    compressors=None)  # fmt: skip
        ranges = chunk_ranges(arr.shape[0], ROW_CHUNK)
        if isinstance(arr, ChunkWrites):
            pending.append((name, len(ranges), arr.writes(where, name, ROW_CHUNK)))
        elif not isinstance(arr, np.ndarray):
            raise TypeError(f"write_factors: {name} is a {type(arr).__name__}, not a NumPy "
                            "array or ChunkWrites")  # fmt: skip
        elif dtype is str:
            target[...] = arr.astype(object)
            sums[name] = digests(arr, ROW_CHUNK)
        else:
            crcs = store_chunks(where, name, lambda a, b, arr=arr: arr[a:b], ranges,
                                SAVE_THREADS)  # fmt: skip
            sums[name] = [crcs[k] for k in range(len(ranges))]
    collections = [c for _, _, writes in pending for c in writes]
    if collections:
        results = iter((compute or (lambda cs: dask.compute(*cs)))(collections))
        for name, count, writes in pending:
            crcs = {}
            for _ in writes:
                crcs.update(next(results))
            sums[name] = [int(crcs[k]) for k in range(count)]
    return sums


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
    _check_attrs(path, attrs, kind)
    names = list(sums) if sums is not None else [name for name, _ in group.arrays()]
    out = {}
    for name in names:
        out[name] = _read_array(path, group, name, kind, sums[name] if sums is not None else None)
    _check_arrays(path, attrs, out, kind)
    return attrs, out


# the arrays every model and checkpoint holds: a folder with one of them is a damaged model
FACTOR_ARRAYS = ("user_factors", "item_factors")
ID_KINDS = "iuOUT"  # the dtype kinds of id arrays (factors are float32)

_NUMBER, _NONE = (int, float), type(None)
# what reading relies on in a model's or checkpoint's attrs: name -> (its types, the types of
# its items for a list or dict, else None); hand-edited attrs are a damaged model, not a
# traceback
ATTR_TYPES: dict[str, tuple[tuple[type, ...], tuple[type, ...] | None]] = {
    **dict.fromkeys(("factors", "m", "n", "iterations", "seed", "cg_steps", "iteration"),
                    ((int,), None)),
    **dict.fromkeys(("regularization", "alpha", "eps"), (_NUMBER, None)),
    **dict.fromkeys(("kind", "solver", "precision", "confidence", "regularization_mode"),
                    ((str,), None)),
    "init_scale": ((*_NUMBER, _NONE), None),
    "store": ((str, _NONE), None),
    "metrics": ((list,), (dict,)),
    "ratings": ((dict,), _NUMBER),
    "store_ratings": ((dict, _NONE), _NUMBER),
    "ids": ((dict,), (int, _NONE)),
    "data": ((dict,), (str, _NONE)),
}  # fmt: skip
REQUIRED_ATTRS = ("factors", "regularization", "iterations", "seed", "m", "n")
IMPLICIT_ATTRS = ("alpha", "confidence", "eps", "regularization_mode")


def _check_attrs(path: Any, attrs: dict, kind: str) -> None:
    """Every attr reading needs is there, and every known one of its type (ATTR_TYPES)."""
    need = [*REQUIRED_ATTRS, *(["iteration"] if kind == "checkpoint" else []),
            *(IMPLICIT_ATTRS if attrs.get("kind") == "implicit" else [])]  # fmt: skip
    missing = [name for name in need if name not in attrs]
    if missing:
        raise _damaged(path, kind, f"its attrs lack {', '.join(missing)}")
    for name, (types, items) in ATTR_TYPES.items():
        value = attrs.get(name)
        if name in attrs and not _typed(value, types, items):
            raise _damaged(path, kind, f"its attr {name!r} is {str(value)[:60]!r}, not "
                           f"{' or '.join(t.__name__ for t in types)}")  # fmt: skip


def _typed(value: Any, types: tuple[type, ...], items: tuple[type, ...] | None) -> bool:
    """`value` is of `types` (a bool is no number), and so are its items (`items`)."""
    if isinstance(value, bool) or not isinstance(value, types):
        return False
    if items is None or value is None:
        return True
    return all(_typed(v, items, None) for v in (value.values() if isinstance(value, dict)
                                                  else value))  # fmt: skip


def _open(path: str | Path, expect_format: str, kind: str) -> tuple[Any, dict]:
    where = Path(local_path(path))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            group = zarr.open_group(for_zarr(where), mode="r")
            attrs = dict(group.attrs)
    except (FileNotFoundError, zarr.errors.GroupNotFoundError):
        if where.is_dir() and any(where.iterdir()):
            if kind == "model" and not any((where / a).exists() for a in FACTOR_ARRAYS):
                raise _not_a_model(path, "a folder without saved factors") from None
            raise _damaged(path, kind, "its zarr.json (the group's metadata) is missing") from None
        left = interrupted_copies(where)
        if left:
            from .records import how_to_resume

            raise StoreError(
                f"{path}: no saved model or checkpoint here, but an interrupted save left "
                f"complete copies beside it ({', '.join(left)}): rename the newest to "
                f"{where.name}, or save again (that puts one back; a run's model: "
                f"{how_to_resume(where.parent)})"
            ) from None
        raise StoreError(f"{path}: no saved model or checkpoint here") from None
    except Exception as exc:
        raise _damaged(path, kind, f"its zarr.json cannot be read ({exc})") from None
    found = attrs.get("format")
    if found == CHECKPOINT_FORMAT and expect_format == MODEL_FORMAT:
        raise _checkpoint_as_model(path, where, attrs)
    if kind == "model" and found not in (MODEL_FORMAT, CHECKPOINT_FORMAT):
        raise _not_a_model(path, _format_name(found))
    if found != expect_format or not attrs.get("complete"):
        raise StoreError(
            f"{path}: not a complete {expect_format} (format {found!r}); "
            "was it written by cumf-dask, and did the write finish?"
        )
    return group, attrs


def _checkpoint_as_model(path: Any, where: Path, attrs: dict) -> StoreError:
    """A checkpoint given where a model goes: name its run folder, and how the run goes on."""
    from .records import resume_advice

    run = where.parent.parent
    shown = run if where.parent.name == "checkpoints" else "runs/NAME-latest"
    return StoreError(
        f"{path}: a training checkpoint (iteration {attrs.get('iteration')}), not a saved "
        f"model: give the run folder ({shown}) or its model.zarr; {resume_advice(run)}"
    )


def _format_name(found: Any) -> str:
    """What a Zarr group of format `found` (its attrs' "format") is, in words."""
    names = {"cumf-dask-ratings": "a rating store", MODEL_FORMAT: "a saved model",
             CHECKPOINT_FORMAT: "a checkpoint", None: "a Zarr group of no cumf-dask format"}
    return names.get(found, f"a Zarr group of format {found!r}")  # fmt: skip


def _describe(path: Path) -> str:
    """What the Zarr group at `path` is, in words (from its zarr.json)."""
    try:
        meta = json.loads((path / "zarr.json").read_text())
        found = meta.get("attributes", {}).get("format")
    except (OSError, ValueError, AttributeError):
        found = None
    return _format_name(found if isinstance(found, str) else None)


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
        data, found = (_read_chunks(arr, Path(local_path(path)) / name) if sums is not None
                       else (np.asarray(arr[...]), []))  # fmt: skip
    except Exception as exc:
        raise _damaged(path, kind, _undecodable(arr, name, exc)) from None
    if sums is None:
        return data
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


def _read_chunks(arr: Any, folder: Path) -> tuple[np.ndarray, list[int]]:
    """The array and its chunks' CRC-32s; numbers read a chunk per job on SAVE_THREADS
    threads (the reads and CRCs release the GIL), each summed as it lands. Chunks stored as
    their rows' plain bytes (how factors are written) are read from their files straight
    into the array (:func:`_raw_chunk_bytes`), else through zarr."""
    rows = int(arr.chunks[0])
    if np.dtype(arr.dtype).kind not in "biuf":
        data = np.asarray(arr[...])
        return data, digests(data, rows)
    data = np.empty(arr.shape, np.dtype(arr.dtype))
    ranges = chunk_ranges(arr.shape[0], rows)
    crcs = [0] * len(ranges)
    raw = _raw_chunk_bytes(folder, data)

    def job(index: int, first: int, end: int) -> None:
        if raw:
            key = _chunk_key(folder.name, index, data.ndim)
            _read_raw(folder.parent / key, data[first:end], raw)
        else:
            data[first:end] = arr[first:end]
        crcs[index] = chunk_crc(data[first:end])

    threads_run([partial(job, *chunk) for chunk in ranges], SAVE_THREADS, use="load")
    return data, crcs


def _raw_chunk_bytes(folder: Path, data: np.ndarray) -> int:
    """The size of each chunk file of the array at `folder` if its chunks hold whole rows
    as their plain little-endian bytes (no compressor) and a missing chunk is zeros, else
    0 (read it through zarr)."""
    try:
        meta = json.loads((folder / "zarr.json").read_text())
        chunk = meta["chunk_grid"]["configuration"]["chunk_shape"]
        plain = (
            meta["codecs"] == [{"name": "bytes", "configuration": {"endian": "little"}}]
            and meta["chunk_key_encoding"] == {"name": "default",
                                               "configuration": {"separator": "/"}}
            and meta["chunk_grid"]["name"] == "regular" and not meta.get("storage_transformers")
            and meta["fill_value"] == 0 and list(meta["shape"]) == list(data.shape)
            and list(chunk[1:]) == list(data.shape[1:])
            and data.dtype.byteorder in "=<|" and np.little_endian
        )  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return 0
    return int(np.prod(chunk)) * data.dtype.itemsize if plain else 0


def _read_raw(path: Path, rows: np.ndarray, size: int) -> None:
    """Fill `rows` from the chunk file at `path` (`size` bytes, its first ones the rows';
    absent: zeros, as Zarr reads it); OSError for a file of another size."""
    into = memoryview(rows.reshape(-1)).cast("B")
    try:
        with open(path, "rb", buffering=0) as fh:
            found = os.fstat(fh.fileno()).st_size
            if found != size:
                raise OSError(f"chunk file {path} holds {found} bytes, not {size}")
            done = 0
            while done < len(into):
                got = fh.readinto(into[done:])
                if not got:
                    raise OSError(f"chunk file {path} ended early")
                done += got
    except FileNotFoundError:
        rows[...] = 0


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


def _check_arrays(path: Any, attrs: dict, arrays: dict, kind: str) -> None:
    """Both factors are there, of the shape the attrs say, and every array of its dtype
    (a dtype edited in an array's zarr.json reads its bytes as other numbers)."""
    f = attrs["factors"]
    for name, rows in (("user_factors", attrs["m"]), ("item_factors", attrs["n"])):
        if name not in arrays:
            raise _damaged(path, kind, f"array '{name}' is missing")
        if arrays[name].shape != (rows, f):
            raise _damaged(
                path, kind, f"'{name}' has shape {arrays[name].shape}, expected {(rows, f)}"
            )
    for name, arr in arrays.items():
        factor = name in FACTOR_ARRAYS
        if (arr.dtype != np.float32) if factor else (arr.dtype.kind not in ID_KINDS):
            wanted = "float32" if factor else "integer or text ids"
            raise _damaged(path, kind, f"'{name}' holds {arr.dtype}, not {wanted}")


def _damaged(path: Any, kind: str, detail: str) -> StoreError:
    """A damaged model or checkpoint, with the way on: --resume only where it restores it."""
    from .records import how_to_resume, resumable

    model = Path(local_path(path))
    if kind == "checkpoint":
        advice = "delete this checkpoint folder; resuming then uses the previous one"
    elif resumable(model):
        advice = ("train it again, or restore it from its run's checkpoints: "
                  f"{how_to_resume(model.parent)}")  # fmt: skip
    else:
        advice = "train it again"
    return StoreError(f"{path}: damaged {kind}: {detail}; {advice}")


# ----------------------------------------------------------------------------- checkpoints


def _is_checkpoint_name(name: str) -> bool:
    return name.startswith("iter-") and name[5:].isdigit()


# what a checkpoint folder holds: checkpoints, LATEST, a replaced one a killed save set aside
OWN = re.compile(rf"iter-\d+|LATEST|\.old-iter-\d+-{SUFFIX}")
# what a killed checkpoint save leaves there: a checkpoint not yet renamed in, a pointer
LEFTOVER = re.compile(rf"\.tmp-iter-\d+-{SUFFIX}|\.LATEST-{SUFFIX}")


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
        """Hold the folder's writer lock; a killed save's temporary folders and pointers
        are removed. A folder holding anything else is refused (it is not one to write in)."""
        check_writable(self.directory, "checkpoints", folder=True)
        self._check_own()
        with WriterLock(self.directory, "the checkpoint folder"):
            left = [p for p in self._entries() if LEFTOVER.fullmatch(p.name)]
            removed = [_remove(p) for p in left]
            if removed:
                warn(f"{self.directory}: a killed checkpoint write left: "
                     f"{'; '.join(removed)}")  # fmt: skip
            yield

    def _entries(self) -> list[Path]:
        return sorted(self.directory.iterdir()) if self.directory.is_dir() else []

    def _check_own(self) -> None:
        """StoreError unless the folder holds only checkpoints, LATEST and what a killed
        save left: checkpoint_dir given a store, a model or a folder of other files would
        have them written over (and its temporary folders removed)."""
        other = [p.name for p in self._entries()
                 if not (OWN.fullmatch(p.name) or LEFTOVER.fullmatch(p.name))]  # fmt: skip
        if not other:
            return
        if "zarr.json" in other:
            what = _describe(self.directory)
        else:
            what = f"other files: {', '.join(other[:3])}{', ...' if len(other) > 3 else ''}"
        raise StoreError(
            f"{self.directory}: not a checkpoint folder ({what}); give checkpoints a folder "
            "of their own (checkpoint_dir; a run's checkpoints are in its run folder)"
        )

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
        # the newest `keep` up to this one stay (a fit skips iterations while it saves);
        # later ones were left by a longer run
        found = sorted((int(p.name[5:]), p) for p in self.directory.glob("iter-*")
                       if _is_checkpoint_name(p.name))  # fmt: skip
        kept = [path for number, path in found if number <= iteration][-self.keep :]
        for _, path in found:
            if path not in kept:
                shutil.rmtree(path, ignore_errors=True)

    def load(self, iteration: int) -> tuple[dict, dict]:
        """(attrs, arrays) of one checkpoint, verified."""
        return self._read(self.name(iteration))

    def _read(self, name: str) -> tuple[dict, dict]:
        """(attrs, arrays) of checkpoint `name`, verified; one whose attrs disagree with
        its folder's iteration (or count another number of iterations' metrics) is damaged."""
        path = self.directory / name
        attrs, arrays = read_factors(path, CHECKPOINT_FORMAT)
        number, metrics = int(name[5:]), attrs.get("metrics")
        if attrs["iteration"] != number or (metrics is not None and len(metrics) != number):
            count = "" if metrics is None else f", {len(metrics)} iterations' metrics"
            raise _damaged(path, "checkpoint",
                           f"its attrs say iteration {attrs['iteration']}{count}")  # fmt: skip
        return attrs, arrays

    def _pointer(self) -> str | None:
        """The name LATEST holds (undecodable bytes replaced: a garbled pointer names no
        checkpoint), or None without one."""
        try:
            text = (self.directory / "LATEST").read_bytes().decode("utf-8", "replace")
        except OSError:
            return None
        return text.strip() or None

    def store_url(self) -> str | None:
        """Where the store is that the checkpoint LATEST names was made on (its attrs'
        ``data.url``), read without its factors; None when that cannot be read."""
        name = self._pointer()
        if name is None:
            return None
        try:
            meta = json.loads((self.directory / name / "zarr.json").read_text())
            url = meta["attributes"]["data"]["url"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return url if isinstance(url, str) else None

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
            warn(f"{self.directory}/LATEST names {pointer[:40]!r}, not a checkpoint "
                 "there; trying the newest one")  # fmt: skip
            pointer = None
        if pointer is not None:
            names = [pointer] + [n for n in names if n < pointer]
        problems = []
        for name in names:
            try:
                attrs, arrays = self._read(name)
            except StoreError as exc:
                problems.append(str(exc))
                continue
            if problems:
                warn(f"skipped {len(problems)} damaged checkpoint(s), resuming from {name}: "
                     + " | ".join(problems))
            return attrs["iteration"], attrs, arrays
        raise StoreError(
            f"{self.directory}: no intact checkpoint to resume from ("
            + (" | ".join(problems) or "LATEST names no checkpoint")
            + "); run again without --resume (resume=False) to start over"
        )


class BackgroundSaves:
    """A fit's checkpoints, written on a thread of their own while the fit goes on.

    A save copies the factors to host memory and writes them: 0.16-0.19 s for a Netflix
    fit on an H100, where an iteration takes 0.077 s. Saved in the fit's own thread, or
    after every iteration, it set the fit's pace (at x0.1: 0.27 s per iteration). So one save
    runs at a time, and an iteration that ends while it runs is not saved (:meth:`busy`),
    but for the last one, which waits for it. Nor is one whose save would still be written
    when the fit's last iteration ends (:meth:`worth_starting`): the last one would wait for
    it. A failed save's error is raised at the next save (one iteration later at most).
    `complete` is the newest iteration whose checkpoint is written: the one a recovery goes
    back to.
    """

    def __init__(self, checkpointer: Checkpointer, compute: Compute, complete: int | None):
        self.checkpointer, self.compute, self.complete = checkpointer, compute, complete
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cumf-checkpoint")
        self._saving: tuple[int, Future] | None = None
        self.seconds: float | None = None  # how long the last save took

    def busy(self) -> bool:
        """Whether a save is still being written."""
        return self._saving is not None and not self._saving[1].done()

    def worth_starting(self, remaining: float) -> bool:
        """Whether a save started now would be written before the fit's last iteration
        ends, `remaining` seconds from now (as long as the last save took), and none is
        under way."""
        return not self.busy() and (self.seconds is None or self.seconds <= remaining)

    def start(self, iteration: int, arrays: dict[str, Any], attrs: dict[str, Any]) -> None:
        """Save `iteration` once the save before it is complete."""
        self.wait()
        save = self._pool.submit(self._timed, iteration, arrays, attrs)
        self._saving = (iteration, save)

    def _timed(self, iteration: int, arrays: dict[str, Any], attrs: dict[str, Any]) -> None:
        began = time.perf_counter()
        self.checkpointer.save(iteration, arrays, attrs, self.compute)
        self.seconds = time.perf_counter() - began

    def wait(self) -> int | None:
        """Wait for the save under way (its error is raised here); the newest complete
        iteration."""
        if self._saving is not None:
            iteration, save = self._saving
            try:
                save.result()
            finally:  # a Ctrl-C in the wait leaves a save not written to wait for again
                if save.done():
                    self._saving = None
                    if save.exception() is None:
                        self.complete = iteration
        return self.complete

    def settle(self) -> int | None:
        """wait() in a fit that failed or was stopped: the save under way ends before the
        folder's lock is let go, through any more Ctrl-Cs (another writer would take the
        lock and remove the save still being written as a killed one's); one that takes
        more than a second says so. The fit's own error is the one to report, not the
        save's."""
        if self._saving is not None:
            iteration, save = self._saving
            with suppress(KeyboardInterrupt):
                wait_for([save], timeout=1)
            if not save.done():
                warn(f"finishing the checkpoint of iteration {iteration} before stopping "
                     "(its folder stays locked until it is written)")  # fmt: skip
        while True:
            try:
                with suppress(Exception):
                    self.wait()
                return self.complete
            except KeyboardInterrupt:
                continue

    def close(self) -> None:
        self.settle()
        self._pool.shutdown()
