"""Waiting on a fit's tasks without ever hanging: lost workers and memory pressure.

Tasks are pinned to worker addresses (:mod:`.placement`). When a worker dies, its nanny
starts a new one under a new address, and tasks pinned to the old address would wait
forever (Dask's "no-worker" state); a worker whose memory passes Dask's pause threshold (80%
of its limit) stops running tasks. Every wait of the engine goes through :class:`Watch`,
which asks the scheduler about the placement's workers every POLL_S seconds while it waits
and raises

* :class:`WorkerLost` when a worker of the placement is gone (or a task failed because its
  worker died): :mod:`.fit` re-places the work on the workers present and goes on from its
  last complete state; the exception says whether the worker's nanny restarted it for
  exceeding its memory limit (then going on would only repeat it);
* :class:`WorkersPaused` when a worker of the placement stays paused for memory for PAUSED_S
  seconds while tasks wait for it.

Waiting is otherwise what ``distributed.as_completed`` does (same wake-ups, no busy loop).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from distributed import Client, Future, as_completed

from .cluster import direct_to_workers, workers_info

POLL_S = 0.5  # how often a wait asks the scheduler about its workers
PAUSED_S = 20.0  # a worker paused this long for memory while tasks wait: out of memory


class WorkerLost(Exception):
    """Workers of the placement are gone. `memory`: the evidence that memory killed them."""

    def __init__(self, lost: list[str], memory: str | None = None, what: str = ""):
        self.lost, self.memory, self.what = lost, memory, what
        super().__init__(f"worker(s) {', '.join(lost)} lost" + (f" ({memory})" if memory else ""))


class WorkersPaused(Exception):
    """A worker stayed paused for memory (Dask pauses at 80% of the memory limit)."""

    def __init__(self, worker: str, detail: str):
        self.worker, self.detail = worker, detail
        super().__init__(f"worker {worker} paused for memory: {detail}")


class Watch:
    """Waits on futures pinned to `workers`, failing fast instead of hanging (module doc)."""

    def __init__(self, client: Client, workers: Sequence[str]):
        self.client = client
        self.workers = list(workers)
        self._paused_since: dict[str, float] = {}
        self._memory: dict[str, tuple[int, int]] = {}  # last (process memory, limit) seen
        self._since = time.time() - 1.0  # events older than this watch are not its concern

    # ------------------------------------------------------------------ waiting
    def wait(
        self, futures: Iterable[Future], on_done: Callable[[Future], None] | None = None
    ) -> None:
        """Return when every future is done; raise a task's error, or WorkerLost/Paused."""
        futures = list(futures)
        if not futures:
            return
        done = as_completed(futures, loop=self.client.loop)
        last = time.monotonic()
        while not done.is_empty():
            with done.thread_condition:  # checked under the lock: no wake-up is missed
                if not done.has_ready():
                    done.thread_condition.wait(timeout=0.1)
            for fut in done.next_batch(block=False) if done.has_ready() else ():
                if fut.status != "finished":
                    self._failed(fut, futures)
                if on_done is not None:
                    on_done(fut)
            if time.monotonic() - last >= POLL_S and not done.is_empty():
                self.check(futures)
                last = time.monotonic()

    def gather(self, futures: Sequence[Future]) -> list[Any]:
        """wait(), then the results. A worker lost while they are fetched raises WorkerLost
        (its results are gone, and Dask would recompute them on a worker that no longer
        exists: a plain gather would wait forever)."""
        futures = list(futures)
        self.wait(futures)
        values, lost = self.client.sync(self._fetch, futures)
        if lost:
            raise WorkerLost(lost, self._memory_evidence(lost), "fetching results")
        return values

    async def _fetch(self, futures: list[Future]) -> tuple[list[Any], list[str]]:
        """(results, []) or ([], the placement workers gone while fetching), on the client's
        event loop: the gather runs while the scheduler is asked about the workers. Fetched
        from the workers themselves on a local cluster (:func:`~.cluster.direct_to_workers`)."""
        fetching = asyncio.ensure_future(self.client.gather(
            futures, asynchronous=True, direct=direct_to_workers(self.client)))  # fmt: skip
        while True:
            done, _ = await asyncio.wait({fetching}, timeout=POLL_S)
            if done:
                return fetching.result(), []
            workers = (await self.client.scheduler.identity(n_workers=-1))["workers"]
            lost = [w for w in self.workers if w not in workers]
            if lost:
                fetching.cancel()
                return [], lost

    def compute(self, collections: Sequence[Any]) -> list[Any]:
        """Compute Dask collections on the cluster under this watch; their results."""
        return self.gather(self.client.compute(list(collections)))

    def _failed(self, fut: Future, futures: list[Future]) -> None:
        """A future that erred or was cancelled: worker loss, or the task's own error."""
        self.check(futures)  # a lost worker explains it: WorkerLost
        if fut.status == "error" and type(fut.exception()).__name__ == "KilledWorker":
            raise WorkerLost([], self._memory_evidence([]), str(fut.exception()))
        fut.result()  # raises the task's exception here, with its message

    # ------------------------------------------------------------------ the scheduler's view
    def check(self, futures: Sequence[Future] = ()) -> None:
        """Raise WorkerLost if a placement worker is gone, WorkersPaused if one stays paused."""
        info = workers_info(self.client)
        lost = [w for w in self.workers if w not in info]
        if lost:  # the futures are dropped, not cancelled (cancelling tasks stuck in
            # no-worker state can break the scheduler's client stream in distributed 2026.8)
            raise WorkerLost(lost, self._memory_evidence(lost))
        now = time.monotonic()
        for w in self.workers:
            state = info[w]
            memory = int((state.get("metrics") or {}).get("memory") or 0)
            limit = int(state.get("memory_limit") or 0)
            self._memory[w] = (memory, limit)
            if state.get("status") != "paused":
                self._paused_since.pop(w, None)
                continue
            since = self._paused_since.setdefault(w, now)
            if futures and now - since >= PAUSED_S:
                raise WorkersPaused(
                    w,
                    f"its process uses {memory / 1e6:.0f} MB of its {limit / 1e6:.0f} MB "
                    f"memory limit and it has run nothing for {now - since:.0f} s",
                )

    def _memory_evidence(self, lost: list[str]) -> str | None:
        """Why `lost` (or, if empty, any worker) died, if memory did it: the nanny's
        "worker-restart-memory" event (it may arrive just after the loss: looked for twice),
        else its log line, else the last memory use seen (within 10% of the limit)."""
        for attempt in range(2):
            found = self._restarted_for_memory(lost)
            if found is not None:
                return found
            if attempt == 0:
                time.sleep(0.5)
        for w in lost:
            memory, limit = self._memory.get(w, (0, 0))
            if limit and memory >= 0.9 * limit:
                return (
                    f"it last used {memory / 1e6:.0f} MB of its {limit / 1e6:.0f} MB memory limit"
                )
        return None

    def _restarted_for_memory(self, lost: list[str]) -> str | None:
        client = self.client
        try:
            events = client.sync(client.scheduler.events, topic="worker-restart-memory",
                                 callback_timeout=10)  # fmt: skip
        except Exception:
            events = ()
        for stamp, event in events or ():
            if stamp >= self._since and (not lost or event.get("worker") in lost):
                return (
                    f"its nanny restarted it when its process used "
                    f"{int(event.get('rss', 0)) / 1e6:.0f} MB, past the memory limit's "
                    "terminate threshold"
                )
        if not lost:
            return None
        try:
            logs = client.sync(client.scheduler.worker_logs, nanny=True, callback_timeout=10)
        except Exception:
            logs = {}
        pattern = re.compile(r"Worker (\S+) .*exceeded .*memory budget")
        for lines in (logs or {}).values():
            for entry in lines:
                text = entry[1] if isinstance(entry, (list, tuple)) else str(entry)
                found = pattern.search(text)
                if found and found.group(1) in lost:
                    return f"its nanny restarted it: {text[found.start() :].strip()}"
        return None
