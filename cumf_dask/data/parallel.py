"""Band tasks run in parallel: on a Dask client's workers, or on a thread pool here.

The generator (:mod:`.synthetic`) and the spilling builder (:mod:`.spill`) write their bands
this way: each band is one task that sorts, encodes and writes (NumPy's sorts, blosc and
crc32c release the GIL, so threads scale).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import dask

from ..errors import warn

Progress = Callable[[str, int, int], None]


def run_tasks(
    client: Any,
    fn: Callable[..., Any],
    tasks: Sequence[tuple[Any, ...]],
    stage: str,
    progress: Progress | None,
    first_alone: bool = False,
) -> list[Any]:
    """fn(*args) for every args in `tasks`, in parallel; results in task order.

    `first_alone` runs the first task on its own before the thread pool starts the rest:
    for GPU tasks, whose CuPy kernels then compile once, not in every thread at the same
    time (on a machine without CuPy's kernel cache, 16 threads made a Netflix-sized
    ``generate`` take 173 s).

    On an error the tasks not started are cancelled; running threads are waited for (a
    distributed worker's running task cannot be stopped and finishes on its own). On the
    thread pool the error raised is the first failed task's in task order, whichever failed
    first: tasks start in order, so the same input always gives the same message.
    """
    results: list[Any] = [None] * len(tasks)

    def report(done: int) -> None:
        if progress is not None:
            progress(stage, done, len(tasks))

    if client is None:
        start = 0
        if first_alone and tasks:
            results[0] = fn(*tasks[0])
            start = 1
            report(1)
        workers = dask.config.get("num_workers", None) or os.cpu_count() or 1
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(fn, *tasks[i]): i for i in range(start, len(tasks))}
            try:
                for done, future in enumerate(as_completed(futures), start + 1):
                    results[futures[future]] = future.result()
                    report(done)
            except Exception:
                for future in futures:
                    future.cancel()
                failed = [f for f in futures if not f.cancelled() and f.exception() is not None]
                if not failed:  # the error was this thread's own (a progress callback's)
                    raise
                raise min(failed, key=futures.__getitem__).exception() from None
            except BaseException:
                for future in futures:
                    future.cancel()
                running = sum(not f.done() for f in futures)
                if running:  # the pool's exit waits for them: say why a Ctrl-C takes a while
                    warn(f"stopping: waiting for the {running} {stage} task(s) under way to "
                         "end (a band is written whole)")  # fmt: skip
                raise
        return results
    from distributed import as_completed as completed

    futures = [client.submit(fn, *args, pure=False) for args in tasks]
    index = {f.key: i for i, f in enumerate(futures)}
    try:
        for done, future in enumerate(completed(futures, loop=client.loop), 1):
            results[index[future.key]] = future.result()
            report(done)
    except BaseException:
        client.cancel(futures)
        raise
    return results
