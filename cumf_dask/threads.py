"""Shared thread pools, one per size and use, for work that releases the GIL (decoding,
crc32c, sorting, copying): reading blocks uses the ``io`` pools; assembling them the
``assemble`` pools, whose jobs wait for decoding they start themselves (a reading with a
lookahead), so they must never occupy the threads that decoding needs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import lru_cache, partial
from typing import Any, TypeVar

Job = Callable[[], None]
T = TypeVar("T")
R = TypeVar("R")


def run(jobs: Sequence[Job], threads: int, use: str = "io") -> None:
    """Run the jobs on the shared pool of `threads` threads for `use` (here when one, or one
    job); the first job's exception is raised after all have run (none still writes into
    the buffers the caller then frees or reuses)."""
    if threads <= 1 or len(jobs) <= 1:
        for job in jobs:
            job()
        return
    futures = [_pool(threads, use).submit(job) for job in jobs]
    wait(futures)
    for future in futures:
        future.result()


def gather(fn: Callable[[T], R], items: Sequence[T], threads: int, use: str = "io") -> list[R]:
    """fn(item) of each item, in order, run as :func:`run` runs jobs (here when one thread:
    callers pass 1 where the work is local, and several where each item waits on a URL)."""
    out: list[Any] = [None] * len(items)

    def one(k: int, item: T) -> None:
        out[k] = fn(item)

    run([partial(one, k, item) for k, item in enumerate(items)], threads, use)
    return out


def start(jobs: Sequence[Job], threads: int) -> list[Future]:
    """Submit the jobs to the pool and return at once (with one thread: run them now)."""
    if threads <= 1:
        done = []
        for job in jobs:
            future: Future = Future()
            job()
            future.set_result(None)
            done.append(future)
        return done
    return [_pool(threads, "io").submit(job) for job in jobs]


@lru_cache(maxsize=16)
def _pool(threads: int, use: str) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"cumf-{use}")
