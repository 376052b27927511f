"""A fit's live state on its cluster: X and Theta as pieces on the workers, and what can be
done with them there (export as Dask arrays, gather to this process, recommend in batches).

It holds the client, so it lives only as long as the client does; the estimator keeps it out
of its pickled state. At interpreter exit the clients of live sessions are closed before
Dask's own exit handlers close the clusters (a client's close releases what it holds), so a
client left open at exit ends without warnings about lost tasks; ``with Client(...) as
client:`` avoids the question altogether.
"""

from __future__ import annotations

import atexit
import uuid
import weakref
from contextlib import suppress
from typing import Any

import dask
import dask.array as da
import numpy as np
from dask import delayed
from distributed import Future

from ..checkpoint import chunk_ranges
from ..data.store import RatingsStore
from . import tasks
from .cluster import workers_info
from .halfstep import SUALSEngine
from .placement import Factor

_LIVE: weakref.WeakSet[Session] = weakref.WeakSet()
_AT_EXIT: list[bool] = []  # registered once, after distributed's own exit handlers


def _close_live_sessions() -> None:
    """At exit, before Dask's handlers close the local clusters: close the clients that
    still hold a fit's factors, as leaving a ``with Client(...)`` block would."""
    clients = {id(s.client): s.client for s in list(_LIVE) if s.is_open}
    for client in clients.values():
        with suppress(Exception):  # a client already shutting down
            client.close(timeout=3)


class FactorWrites:
    """A factor's pieces written into a Zarr array where they are (a
    :class:`~cumf_dask.checkpoint.ChunkWrites`): the chunks that lie within a piece by one
    task on the piece's worker, on its `threads` (a chunk per thread at a time, each copied
    to host memory as it is written: never the whole piece, nor a copy moved between
    workers); a chunk across pieces by one task more, from their rows of it. The pieces are
    referenced as they are when the save starts (futures of its own: a fit that fails
    meanwhile lets go of its own, and the save still completes)."""

    def __init__(self, factor: Factor, backend: str, threads: dict[str, int]):
        self.pieces = [(lo, hi, Future(fut.key, fut.client)) for lo, hi, fut in factor.pieces]
        self.owners, self.backend, self.threads = list(factor.owners), backend, threads
        self.shape, self.dtype = (factor.n_rows, factor.f), np.dtype(np.float32)

    def writes(self, where: str, name: str, rows: int) -> list[Any]:
        pieces, out = self.pieces, []
        chunks = chunk_ranges(self.shape[0], rows)
        for (lo, hi, piece), owner in zip(pieces, self.owners, strict=True):
            within = [c for c in chunks if lo <= c[1] and c[2] <= hi]
            if within:
                with dask.annotate(workers=[owner]):
                    out.append(delayed(tasks.store_piece, pure=False)(
                        piece, lo, where, name, within, self.backend,
                        self.threads.get(owner, 1)))  # fmt: skip
        for index, first, end in chunks:
            held = [(lo, hi, piece) for lo, hi, piece in pieces if lo < end and first < hi]
            if len(held) > 1:
                parts = [delayed(tasks.rows_on_host, pure=False)(
                    piece, max(first, lo) - lo, min(end, hi) - lo, self.backend)
                    for lo, hi, piece in held]  # fmt: skip
                out.append(delayed(tasks.store_parts, pure=False)(where, name, index, first,
                                                                 *parts))  # fmt: skip
        return out


class Session:
    """The engine of a finished fit and its factors on the workers."""

    def __init__(self, engine: SUALSEngine, X: Factor, theta: Factor):
        self.engine = engine
        self.X = X
        self.theta = theta
        self._closed = False
        if not _AT_EXIT:  # runs before the handlers registered earlier (LIFO)
            atexit.register(_close_live_sessions)
            _AT_EXIT.append(True)
        _LIVE.add(self)

    @property
    def client(self) -> Any:
        return self.engine.client

    @property
    def is_open(self) -> bool:
        """Whether the factors are still on a running cluster (not closed, client running)."""
        return not self._closed and getattr(self.client, "status", None) == "running"

    @property
    def is_usable(self) -> bool:
        """Whether work can run on the factors there: open, every piece still held (a
        ``client.restart()`` cancels them) and a worker to run on (not scaled to zero)."""
        pieces = [fut for factor in (self.X, self.theta) for *_, fut in factor.pieces]
        return (self.is_open and all(fut.status == "finished" for fut in pieces)
                and bool(workers_info(self.client)))  # fmt: skip

    def close(self) -> None:
        """Let go of the factors on the cluster (the Dask arrays given out keep their own
        pieces); the session is not used afterwards."""
        self._closed = True
        self.X.pieces, self.X.placed = [], {}
        self.theta.pieces, self.theta.placed = [], {}

    def _on_host(self, factor: Factor, copy: Any = tasks.to_host) -> list[Any]:
        """Each piece of `factor` copied to host memory on its worker by `copy` (futures)."""
        backend = self.engine.backend
        return [self.client.submit(copy, fut, backend, pure=False)
                for _, _, fut in factor.pieces]  # fmt: skip

    def _dask(self, factor: Factor) -> da.Array:
        parts = [
            da.from_delayed(part, shape=(hi - lo, factor.f), dtype=np.float32)
            for (lo, hi, _), part in zip(factor.pieces, self._on_host(factor), strict=True)
        ]
        return da.concatenate(parts, axis=0)

    def factor_writes(self) -> tuple[FactorWrites, FactorWrites]:
        """(X, Theta) as :func:`~cumf_dask.checkpoint.write_factors` writes them where they
        are (a checkpoint)."""
        backend, threads = self.engine.backend, self.engine.read_threads
        return FactorWrites(self.X, backend, threads), FactorWrites(self.theta, backend, threads)

    def factors_as_dask(self) -> tuple[da.Array, da.Array]:
        """(X, Theta) as Dask arrays of host (NumPy) chunks, still on the cluster."""
        return self._dask(self.X), self._dask(self.theta)

    def gather(self) -> tuple[np.ndarray, np.ndarray]:
        """(X, Theta) as NumPy arrays in this process: the host pieces come here directly
        (no concatenation on one worker first, as computing the Dask arrays would do),
        through the engine's watch (a worker lost meanwhile raises WorkerLost)."""
        watch, gathered = self.engine.watch, []
        for factor in (self.X, self.theta):
            parts = watch.gather(self._on_host(factor, tasks.own_host_copy))
            gathered.append(parts[0] if len(parts) == 1 else np.concatenate(parts))
        return gathered[0], gathered[1]

    def run_batches(
        self, func: Any, shared: list[np.ndarray], batches: list[tuple], name: str
    ) -> list[Any]:
        """``func(*shared, *batch, backend)`` for each batch, one task each on the workers;
        the `shared` host arrays are broadcast to every worker once."""
        client, backend = self.client, self.engine.backend.partition("+")[0]
        common = client.scatter(shared, broadcast=True, hash=False) if shared else []
        futures = []
        for i, batch in enumerate(batches):
            key = f"{name}-batch{i}-{self.engine.run}-{uuid.uuid4().hex[:6]}"
            futures.append(client.submit(func, *common, *batch, backend, key=key))
        return client.gather(futures)

    def recommend(
        self,
        user_factors: np.ndarray,
        item_factors: np.ndarray,
        chunks: list[np.ndarray],
        k: int,
        store: RatingsStore | None,
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Top-k of each chunk of users, one task per chunk on the workers (Theta broadcast)."""
        client, backend = self.client, self.engine.backend.partition("+")[0]
        # hash=False: a fresh key per call; the same array's content key would race with
        # the release of the previous call's copy ("lost dependencies")
        [theta] = client.scatter([item_factors], broadcast=True, hash=False)
        futures = [
            client.submit(
                tasks.recommend_batch, user_factors[c], theta, c, k, store, backend,
                key=f"recommend-batch{i}-{self.engine.run}-{uuid.uuid4().hex[:6]}",
            )
            for i, c in enumerate(chunks)
        ]
        return client.gather(futures)
