"""Reductions of partial Hermitians when p > 1 (paper section "parallel reduction").

Every strategy is here, as pure functions that take what they need:

* ``scatter`` (default): reduce-scatter. Each worker first sums the partials of its own
  parts; each batch's rows are cut into one slice per worker holding parts; worker k
  receives slice k of every worker's sum and adds them up, so all workers reduce at once
  and each moves 1/W of the data (paper Fig. "parallel reduction" (a)).
* ``two-phase``: topology-aware. Partials are first summed inside each group of workers
  (same NVLink island / PCIe switch / NUMA node), then the group sums go to the worker of
  the slice (paper Fig. (b)). Groups come from ``plan.groups`` or from NVML.
* ``one``: everything to one worker, the baseline for benchmarks only.

What moves is always the packed lower triangle, f(f+1)/2 floats per row. The final sum
and the solve of a slice are one task (``tasks.reduce_solve``), on the worker of the slice.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from distributed import Future

from . import tasks
from .plan import balanced_bounds

Submit = Callable[..., Future]  # a Pinned submitter: submit(func, *args, key=, worker=)


def slice_bounds(rows: int, p: int, workers: int, reduction: str) -> list[tuple[int, int]]:
    """A batch's rows [0, rows) cut into the slices reduced separately: one for 'one', else
    one per worker that holds parts (each worker sums its parts first: min(p, workers))."""
    slices = 1 if reduction == "one" else min(p, workers)
    return list(itertools.pairwise(balanced_bounds(rows, slices)))


def final_inputs(
    partials: list[Future],
    sources: list[int],
    target: int,
    reduction: str,
    groups: list[list[int]] | None,
    workers: list[str],
    submit: Submit,
    tag: str,
) -> list[Future]:
    """The inputs of the final sum of one slice on worker `target`.

    `partials[i]` is the slice of one worker's sum of its parts' partial (A, B), held by
    worker `sources[i]`.
    scatter and one: the partials themselves. two-phase: one sum per group of workers, on
    the target when it is in the group, else on the group's first worker; a partial from a
    worker in no group goes to the final sum as it is (never dropped).
    """
    if reduction != "two-phase" or not groups or len(groups) < 2:
        return list(partials)
    inputs: list[Any] = [
        fut for fut, src in zip(partials, sources, strict=True) if all(src not in g for g in groups)
    ]
    for g, members in enumerate(groups):
        mine = [fut for fut, src in zip(partials, sources, strict=True) if src in members]
        if len(mine) <= 1:
            inputs.extend(mine)
            continue
        home = target if target in members else members[0]
        key = f"reduce-group{g}-{tag}"
        inputs.append(submit(tasks.sum_partials, *mine, key=key, worker=workers[home]))
    return inputs
