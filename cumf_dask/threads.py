"""One shared thread pool per size, for work that releases the GIL (decoding, crc32c,
sorting, copying): reading and assembling blocks uses it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import lru_cache

Job = Callable[[], None]


def run(jobs: Sequence[Job], threads: int) -> None:
    """Run the jobs on a shared pool of `threads` threads (here when one, or one job);
    the first job's exception is raised after all have run (none still writes into the
    buffers the caller then frees or reuses)."""
    if threads <= 1 or len(jobs) <= 1:
        for job in jobs:
            job()
        return
    futures = [_pool(threads).submit(job) for job in jobs]
    wait(futures)
    for future in futures:
        future.result()


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
    return [_pool(threads).submit(job) for job in jobs]


@lru_cache(maxsize=8)
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cumf-io")
