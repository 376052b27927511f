"""Reading 1-D Zarr v3 arrays of a store straight from their files, fast and strictly.

Why not through zarr-python: it decodes chunk by chunk through its async machinery (measured
here at 30-60M ratings/s per core on band arrays, and no faster with more threads), and it
returns the fill value for a chunk that is missing. This reader parses each array's
``zarr.json`` and each shard's index (checking its crc32c), and reads, checks and decodes
the chunks a range needs on a thread pool (``os.pread``, blosc, and crc32c over a bytes
object release the GIL, so it scales with cores). A missing file, a missing chunk, a
checksum mismatch or a chunk that decodes to other than its full chunk shape is a
:class:`~cumf_dask.errors.StoreError` naming the array and the fix, never zeros. A request
may carry an :class:`Expect`: the array's size, and the crc32c recorded at build time for
each chunk, which binds a chunk's bytes to its place (compared with the 4 bytes read
anyway; see :mod:`.integrity`).

It reads what cumf-dask writes (sharded or single-chunk 1-D arrays; little-endian ``bytes``
then any of blosc / zstd / crc32c); :func:`supported` says whether a layout is one of those,
and the store reads anything else through zarr, then validates the values. Files are local
(``os.pread``) or behind an fsspec URL (``s3://...``: a ranged read per chunk, one more for
a shard's size and one for its index, and the array's ``zarr.json`` read afresh per
request), with the same checks either way.

Decoded entries go to a :class:`Target`: NumPy arrays by default (:data:`HOST`, chunks
decoded in place), or another memory (the CuPy backend's target has each thread decode into
its own page-locked buffer and copy that to the GPU); a target with a ``lookahead`` decodes
only that many bytes ahead of its consumer.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

import fsspec
import google_crc32c
import numpy as np
from numcodecs import Blosc, Zstd

from ..errors import StoreError, StoreUnreachable
from ..paths import is_url
from ..threads import Job, gather
from ..threads import start as submit

_MISSING = np.uint64(2**64 - 1)  # a shard index entry of a chunk that was never written
_DTYPES = {"int32": "<i4", "int64": "<i8", "float32": "<f4", "float64": "<f8"}
_SHUFFLE = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}


#: the chunks' crc32c a build reads back from a remote array at once (one request each)
REMOTE_REQUESTS = 16


class Unsupported(Exception):
    """A layout this reader does not parse (the caller falls back to zarr)."""


@dataclass(frozen=True)
class Expect:
    """What a request knows of its array beforehand: its size (entries), and the crc32c
    stored with each chunk, in chunk order, as recorded at build time (None: unknown)."""

    size: int | None = None
    crcs: Sequence[int | None] | None = None


#: (path, lo, hi) or (path, lo, hi, expect): entries [lo, hi) of an array (hi None: all)
Request = tuple[Any, ...]


class Target(Protocol):
    """Where decoded entries go: the memory of the arrays a reading hands over."""

    lookahead: int | None  # bytes decoded ahead of the consumer; None: all at once

    def empty(self, size: int, dtype: np.dtype) -> Any:
        """An uninitialized 1-D output array."""
        ...

    def chunk(self, out: Any, start: int, size: int, dtype: np.dtype) -> np.ndarray:
        """Host memory that `size` decoded entries bound for out[start:] are decoded into
        (on the decoding thread; valid until its next call)."""
        ...

    def put(self, out: Any, start: int, chunk: np.ndarray) -> None:
        """Deliver a decoded :meth:`chunk` to out[start:]."""
        ...


class HostTarget:
    """NumPy arrays in host memory, decoded in place: every array at once, or `lookahead`
    bytes ahead of the consumer."""

    def __init__(self, lookahead: int | None = None):
        self.lookahead = lookahead

    def empty(self, size: int, dtype: np.dtype) -> np.ndarray:
        return np.empty(size, dtype)

    def chunk(self, out: np.ndarray, start: int, size: int, dtype: np.dtype) -> np.ndarray:
        return out[start : start + size]

    def put(self, out: np.ndarray, start: int, chunk: np.ndarray) -> None:
        """Nothing to do: the chunk was decoded in place."""


HOST = HostTarget()
#: a block's bands, decoded at most this many bytes ahead of the thread placing them: a load
#: holds the block and a few bands, not all the block's bands decoded beside it
#: (:func:`~cumf_dask.blocks.block_on_host`)
HOST_BANDS = HostTarget(lookahead=1 << 26)


def _damaged(path: str, what: str) -> StoreError:
    return StoreError(
        f"{path}: damaged store: {what}; rebuild the store (ingest or generate with --overwrite)"
    )


def _codec(spec: dict[str, Any]) -> Any:
    name, cfg = spec["name"], spec.get("configuration") or {}
    if name == "crc32c":
        return "crc32c"
    if name == "blosc":
        return Blosc(
            cname=cfg["cname"], clevel=cfg["clevel"], shuffle=_SHUFFLE[cfg["shuffle"]],
            blocksize=cfg.get("blocksize", 0),
        )  # fmt: skip
    if name == "zstd":
        return Zstd(level=cfg.get("level", 0), checksum=cfg.get("checksum", False))
    raise Unsupported(name)


class Layout:
    """The parsed ``zarr.json`` of a 1-D array: its size, dtype, files and codecs. A remote
    array's layout is made per reading and keeps the sizes and shard indexes it fetched
    (:meth:`prefetch`); a local one reads them afresh each time."""

    def __init__(self, path: str):
        try:
            meta = json.loads(whole(os.path.join(path, "zarr.json")))
        except FileNotFoundError:
            raise _damaged(path, "the array's metadata (zarr.json) is missing") from None
        except (OSError, ValueError) as exc:
            raise _damaged(path, f"the array's metadata cannot be read ({exc})") from None
        self.path = path
        self._remote = is_url(path)
        self._files: dict[int, tuple[int, np.ndarray | None, int]] = {}
        try:
            self._parse(meta)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise _damaged(path, f"the array's metadata is not a zarr v3 array's "
                           f"({exc!r})") from None  # fmt: skip

    def _parse(self, meta: Any) -> None:
        """Size, dtype, files and codecs from the parsed zarr.json (a field missing or of
        the wrong type raises one of the built-in errors Layout turns into damage)."""
        if meta.get("zarr_format") != 3 or len(meta.get("shape", ())) != 1:
            raise Unsupported("not a 1-D zarr v3 array")
        if meta["data_type"] not in _DTYPES or meta["chunk_key_encoding"]["name"] != "default":
            raise Unsupported("dtype or chunk key encoding")
        self.attributes: dict[str, Any] = meta.get("attributes") or {}
        self.size = int(meta["shape"][0])
        self.dtype = np.dtype(_DTYPES[meta["data_type"]])
        self.outer = int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
        self.sep = (meta["chunk_key_encoding"].get("configuration") or {}).get("separator", "/")
        codecs = meta["codecs"]
        self.inner: int | None = None
        if codecs[0]["name"] == "sharding_indexed":
            cfg = codecs[0]["configuration"]
            index = [c["name"] for c in cfg["index_codecs"]]
            if len(codecs) != 1 or cfg.get("index_location", "end") != "end":
                raise Unsupported("shard layout")
            if index != ["bytes", "crc32c"]:
                raise Unsupported("shard index codecs")
            self.inner = int(cfg["chunk_shape"][0])
            codecs = cfg["codecs"]
        first = codecs[0]
        if first["name"] != "bytes" or (first.get("configuration") or {}).get("endian") != "little":
            raise Unsupported("array-to-bytes codec")
        self.codecs = [_codec(c) for c in codecs[1:]]
        if self.size < 0 or self.outer < 1 or (self.inner or 1) < 1:
            raise ValueError(f"shape {self.size}, chunks {self.outer} of {self.inner}")

    @property
    def chunk_size(self) -> int:
        """Entries per stored chunk (inner chunks of a shard): every chunk decodes to this
        many, the one at the end too (zarr pads it)."""
        return self.inner or self.outer

    def chunk_crcs(self) -> list[int | None] | None:
        """The crc32c stored at the end of each chunk, in chunk order (None for a chunk
        never written), read back after a build writes the array, to be recorded; None
        when the last codec is not crc32c."""
        if not self.codecs or self.codecs[-1] != "crc32c":
            return None
        places: list[tuple[str, int] | None] = []  # where each chunk's crc32c lies
        for k, start in enumerate(range(0, self.size, self.outer)):
            path = self._file(k)
            size, index, _ = self._stored(k)
            if index is None:
                places.append((path, size - 4))
                continue
            for offset, length in index[: -(-min(self.outer, self.size - start) // self.inner)]:
                places.append(None if offset == _MISSING else (path, offset + length - 4))
        return gather(lambda place: None if place is None else _crc_at(*place), places,
                      REMOTE_REQUESTS if self._remote else 1, use="metadata")  # fmt: skip

    def _file(self, k: int) -> str:
        return os.path.join(self.path, *f"c{self.sep}{k}".split("/"))

    def _over(self, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
        """(k, start, stop) of each file holding entries of [lo, hi)."""
        for k, start in enumerate(range(0, self.size, self.outer)):
            stop = min(start + self.outer, self.size)
            if max(lo, start) < min(hi, stop):
                yield k, start, stop

    def _stored(self, k: int) -> tuple[int, np.ndarray | None, int]:
        """File k's size, its shard index (None unsharded) and where that index starts
        (else its size); a remote file's are kept, a local one's read each time."""
        if k in self._files:
            return self._files[k]
        size = _file_size(self._file(k))
        index, end = self._shard_index(size, k) if self.inner is not None else (None, size)
        stored = (size, index, end)
        if self._remote:
            self._files[k] = stored
        return stored

    def prefetch(self, lo: int, hi: int) -> None:
        """Fetch a remote array's sizes and shard indexes for entries [lo, hi) now (the
        requests of a reading are prepared together, not one round trip after another)."""
        if self._remote:
            for k, _, _ in self._over(lo, hi):
                self._stored(k)

    def jobs(
        self, out: Any, lo: int, hi: int, target: Target = HOST,
        crcs: Sequence[int | None] | None = None,
    ) -> list[Job]:
        """Work that fills `out` (made by `target`) with entries [lo, hi); the shard indexes
        are read here (or were prefetched), the chunks read and decoded by the jobs (each
        checked against its recorded crc32c in `crcs`, when given)."""
        jobs: list[Job] = []
        for k, start, stop in self._over(lo, hi):
            size, index, end = self._stored(k)
            if index is None:
                chunk = (self._file(k), 0, size, f"chunk {k}")
                jobs.append(self._job(chunk, start, stop, out, lo, hi, target, crcs))
            else:
                jobs += self._shard_jobs(index, end, k, start, stop, out, lo, hi, target, crcs)
        return jobs

    def _shard_index(self, size: int, k: int) -> tuple[np.ndarray, int]:
        """Shard k's index, checked: (offset, length) of each inner chunk; and where the
        index starts."""
        path = self._file(k)
        n_inner = -(-self.outer // self.inner)  # type: ignore[operator]
        index_bytes = 16 * n_inner
        end = size - index_bytes - 4  # where the index starts
        tail = _read(path, end, index_bytes + 4) if end >= 0 else b""
        if len(tail) != index_bytes + 4:
            raise _damaged(self.path, f"shard {k} is truncated")
        if not _intact(tail):
            raise _damaged(self.path, f"shard {k}'s index fails its checksum")
        return np.frombuffer(tail, "<u8", 2 * n_inner).reshape(-1, 2), end

    def _shard_jobs(
        self, index: np.ndarray, end: int, k: int, start: int, stop: int, out: Any, lo: int,
        hi: int, target: Target, crcs: Sequence[int | None] | None,
    ) -> list[Job]:
        path = self._file(k)
        jobs = []
        inner = self.inner or 1
        for j in range((max(lo, start) - start) // inner, -(-(min(hi, stop) - start) // inner)):
            offset, length = index[j]
            if offset == _MISSING:
                raise _damaged(self.path, f"chunk {j} of shard {k} is missing")
            if int(offset) + int(length) > end:
                raise _damaged(self.path, f"chunk {j} of shard {k} lies outside the shard")
            c0 = start + j * inner
            c1 = min(c0 + inner, stop)
            chunk = (path, int(offset), int(length), f"chunk {j} of shard {k}")
            jobs.append(self._job(chunk, c0, c1, out, lo, hi, target, crcs))
        return jobs

    def _job(
        self, chunk: tuple[str, int, int, str], c0: int, c1: int, out: Any, lo: int, hi: int,
        target: Target, crcs: Sequence[int | None] | None = None,
    ) -> Job:
        """Read and decode one stored chunk (file, offset, length, where) holding entries
        [c0, c1) into its part of out[lo:hi]; `crcs`: the recorded crc32c of every chunk."""
        path, offset, length, where = chunk
        recorded = crcs[c0 // self.chunk_size] if crcs is not None else None

        def run() -> None:
            raw = _read(path, offset, length)
            if len(raw) != length:
                raise _damaged(self.path, f"{where} is truncated")
            a, b = max(lo, c0), min(hi, c1)
            into = target.chunk(out, a - lo, b - a, self.dtype)
            self._decode(raw, where, a - c0, into, recorded)
            target.put(out, a - lo, into)

        return run

    def _decode(
        self, data: Any, where: str, first: int, into: np.ndarray, recorded: int | None = None
    ) -> None:
        """Check and decode a chunk and put entries [first, first + into.size) of it into
        `into`: decoded there straight when that is the whole chunk and the last codec is
        blosc (no allocation). It must decode to exactly the full chunk shape: one that
        brings more is another array's chunk, never cut down and used. `recorded`: the
        crc32c the build recorded for this place, compared with the one the chunk carries."""
        full = self.chunk_size
        for k in range(len(self.codecs) - 1, -1, -1):
            codec = self.codecs[k]
            if codec == "crc32c":
                if not _intact(data):
                    raise _damaged(self.path, f"{where} fails its checksum")
                if k == len(self.codecs) - 1 and recorded is not None:
                    _check_recorded(self.path, where, data, recorded)
                data = memoryview(data)[:-4]
                continue
            if k == 0 and isinstance(codec, Blosc) and len(data) >= 16:
                nbytes = _blosc_nbytes(data)
                if nbytes != full * self.dtype.itemsize:
                    raise _damaged(self.path, f"{where} holds {nbytes // self.dtype.itemsize} "
                                   f"entries, not {full}")  # fmt: skip
                if into.size == full:
                    try:
                        codec.decode(data, out=into)
                    except Exception as exc:
                        raise _damaged(self.path, f"{where} does not decode ({exc})") from None
                    return
            try:
                data = codec.decode(data)
            except Exception as exc:
                raise _damaged(self.path, f"{where} does not decode ({exc})") from None
        decoded = np.frombuffer(data, self.dtype)
        if decoded.size != full:
            raise _damaged(self.path, f"{where} holds {decoded.size} entries, not {full}")
        into[...] = decoded[first : first + into.size]


def _check_recorded(array: str, where: str, data: Any, recorded: int) -> None:
    """A sound chunk whose crc32c is not the one recorded for its place is another place's
    chunk (moved, swapped or copied there)."""
    stored = int.from_bytes(bytes(data[-4:]), "little")
    if stored != recorded:
        raise _damaged(array, f"{where} is not the chunk the build wrote there (crc32c "
                       f"{stored:08x}, recorded {recorded:08x}: moved or swapped?)")  # fmt: skip


def _crc_at(path: str, offset: int) -> int:
    """The little-endian crc32c stored at `offset` of a file."""
    return int.from_bytes(_read(path, int(offset), 4), "little")


def _blosc_nbytes(data: Any) -> int:
    """The decoded size a blosc frame's header gives (bytes 4-7, little-endian)."""
    return int(np.frombuffer(data[4:8], "<u4")[0])


_CRC32C_RESIDUE = 0x48674BC7  # crc32c of any bytes followed by their own crc32c (LE)


def _intact(data: Any) -> bool:
    """Whether the last 4 bytes are the little-endian crc32c of the rest: then the crc32c
    of the whole is the CRC's fixed residue. Computed over one bytes object, on which
    google_crc32c releases the GIL (over other buffers it holds it, and the decoding
    threads took turns: a fifth of a Netflix load)."""
    if len(data) < 4:
        return False
    return google_crc32c.value(data if isinstance(data, bytes) else bytes(data)) == _CRC32C_RESIDUE


def _file_size(path: str) -> int:
    """The size of a chunk file (local, or behind a URL)."""
    if is_url(path):
        fs, where = fsspec.core.url_to_fs(path)
        with _remote_errors(path):
            return int(fs.size(where))
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        raise _missing(path) from None


def _read(path: str, offset: int, length: int) -> bytes:
    """`length` bytes of the file from `offset` (fewer if it ends first): a local one read
    without the GIL into a bytes object, a URL's by one ranged read."""
    if is_url(path):
        fs, where = fsspec.core.url_to_fs(path)
        with _remote_errors(path):
            return bytes(fs.cat_file(where, start=offset, end=offset + length))
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise _missing(path) from None
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def whole(path: str) -> bytes:
    """A whole (metadata) file, local or behind a URL; a missing one is FileNotFoundError,
    a local one that cannot be read another OSError, a URL that cannot be reached
    StoreUnreachable."""
    if is_url(path):
        fs, where = fsspec.core.url_to_fs(path)
        try:
            return bytes(fs.cat_file(where))
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise unreachable(path, exc) from None
    with open(path, "rb") as fh:
        return fh.read()


def _missing(path: str) -> StoreError:
    return _damaged(os.path.dirname(os.path.dirname(path)), f"{path} is missing")


@contextmanager
def _remote_errors(path: str) -> Iterator[None]:
    """A URL's read failing: a missing file is damage; anything else (a lost connection,
    credentials) is one StoreError that says so, not a traceback from the filesystem."""
    try:
        yield
    except FileNotFoundError:
        raise _missing(path) from None
    except StoreError:
        raise
    except Exception as exc:
        raise unreachable(path, exc) from None


def unreachable(path: str, exc: BaseException) -> StoreUnreachable:
    """The error of a URL's read that failed for another reason than a missing file."""
    return StoreUnreachable(f"{path}: cannot be read ({type(exc).__name__}: {exc}); check the "
                            "connection and credentials, then run again")  # fmt: skip


@lru_cache(maxsize=4096)
def _layout(path: str, stamp: int) -> Layout:
    return Layout(path)


def layout(path: str) -> Layout:
    """The array's layout: a local one parsed once per version of its zarr.json, a remote
    one (whose files carry no dependable time) each time."""
    if is_url(path):
        return Layout(path)
    try:
        stamp = os.stat(os.path.join(path, "zarr.json")).st_mtime_ns
    except FileNotFoundError:
        raise _damaged(path, "the array's metadata (zarr.json) is missing") from None
    return _layout(path, stamp)


def supported(path: str) -> bool:
    """Whether this reader parses the array's layout (else read it through zarr)."""
    try:
        layout(path)
    except Unsupported:
        return False
    return True


class Reading:
    """Arrays being decoded on the pool, in request order: :meth:`get` waits for one
    array's chunks only, and hands it over (the reading forgets it, so the consumer frees it
    when done: each array is asked for once). With a target's ``lookahead``, the arrays
    after the one asked for are started while fewer bytes than that are decoded and not yet
    asked for; else all start at once. Such a consumer must not wait on the pool's own
    threads: the work it waits for is started by its own calls. `after` is called when the
    last array is handed over (before it is)."""

    def __init__(
        self, requests: Sequence[tuple[Layout, int, int, Expect | None]], threads: int,
        target: Target, on_error: Callable[[], None] | None = None,
        after: Callable[[], None] | None = None,
    ):
        self._requests, self._threads, self._target = list(requests), threads, target
        self._on_error, self._after = on_error, after
        self._left = len(self._requests)  # arrays not handed over yet
        self._outs: list[Any] = [None] * len(self._requests)
        self._pending: list[list[Future]] = [[] for _ in self._requests]
        self._bytes = [0] * len(self._requests)  # of each array started, not handed over
        self._started = self._ahead = 0
        self._lock = threading.Lock()
        with _reported(on_error):
            self._start_through(0)

    @classmethod
    def done(cls, arrays: list[np.ndarray]) -> Reading:
        """A reading of arrays already in memory (read some other way)."""
        reading = cls([], 1, HOST)
        reading._outs = list(arrays)
        reading._pending = [[] for _ in arrays]
        reading._bytes = [0] * len(arrays)
        reading._started = len(arrays)
        reading._left = 0
        return reading

    def __len__(self) -> int:
        return len(self._outs)

    def _start_through(self, k: int) -> None:
        """Start arrays through k, and more while the lookahead allows."""
        limit = self._target.lookahead
        with self._lock:
            while self._started < len(self._requests) and (
                self._started <= k or limit is None or self._ahead < limit
            ):
                n = self._started
                lay, lo, stop, expect = self._requests[n]
                out = self._target.empty(stop - lo, lay.dtype)
                self._outs[n] = out
                crcs = expect.crcs if expect is not None else None
                jobs = lay.jobs(out, lo, stop, self._target, crcs)
                self._pending[n] = submit(jobs, self._threads)
                self._bytes[n] = (stop - lo) * lay.dtype.itemsize
                self._ahead += self._bytes[n]
                self._started += 1

    def get(self, k: int) -> Any:
        """Array k once decoded (a decoding job's StoreError is raised here)."""
        with _reported(self._on_error):
            self._start_through(k)
            for future in self._pending[k]:
                future.result()
        out = self._outs[k]
        self._outs[k], self._pending[k] = None, []
        with self._lock:
            self._ahead -= self._bytes[k]
            self._bytes[k] = 0
            self._left -= 1
            last = self._left == 0
        if last and self._after is not None:
            self._after()
        return out


@contextmanager
def _reported(on_error: Callable[[], None] | None) -> Iterator[None]:
    """Call `on_error` before a StoreError goes on (it may raise a truer one instead); a
    store out of reach is that, whatever `on_error` would find."""
    try:
        yield
    except StoreUnreachable:
        raise
    except StoreError:
        if on_error is not None:
            on_error()
        raise


def start(
    requests: Sequence[Request], threads: int = 1, target: Target = HOST,
    on_error: Callable[[], None] | None = None, after: Callable[[], None] | None = None,
) -> Reading:
    """Begin decoding entries [lo, hi) of each array (path or URL, lo, hi[, expect]; hi
    None: to the end) on up to `threads` threads into arrays made by `target`, in request
    order; returns at once. `on_error` is called before any StoreError of the reading is
    raised (the store checks there whether it was replaced meanwhile), `after` once the
    last array is decoded, before it is handed over."""
    def prepare(request: Request) -> tuple[Layout, int, int, Expect | None]:
        path, lo, hi, *rest = request
        expect = rest[0] if rest else None
        lay = layout(path)
        _check_expected(lay, expect)
        stop = lay.size if hi is None else hi
        if not 0 <= lo <= stop <= lay.size:
            raise _damaged(path, f"entries [{lo}, {stop}) asked of an array of {lay.size}")
        lay.prefetch(lo, stop)
        return lay, lo, stop, expect

    remote = any(is_url(request[0]) for request in requests)
    with _reported(on_error):  # a remote reading's metadata fetched concurrently
        checked = gather(prepare, requests, threads if remote else 1, use="metadata")
    return Reading(checked, threads, target, on_error, after)


def _check_expected(lay: Layout, expect: Expect | None) -> None:
    """The array is as long as its band says, and has a recorded crc32c per chunk."""
    if expect is None:
        return
    if expect.size is not None and lay.size != expect.size:
        raise _damaged(lay.path, f"the array holds {lay.size} entries, not the {expect.size} its "
                       "band's pointer and band_nnz say")  # fmt: skip
    chunks = -(-lay.size // lay.chunk_size)
    if expect.crcs is not None and len(expect.crcs) != chunks:
        raise _damaged(lay.path, f"the array has {chunks} chunks, the build recorded "
                       f"{len(expect.crcs)}")  # fmt: skip


def read(requests: Sequence[Request], threads: int = 1) -> list[np.ndarray]:
    """Entries [lo, hi) of each array, decoded on up to `threads` threads together."""
    reading = start(requests, threads)
    return [reading.get(k) for k in range(len(reading))]


__all__ = ["HOST", "HOST_BANDS", "Expect", "HostTarget", "Reading", "Request", "Target",
           "Unsupported", "layout", "read", "start", "supported", "unreachable", "whole"]
