"""Reductions of partial Hermitians for p > 1 (paper section "parallel reduction").

* ``scatter`` (default): reduce-scatter. Each batch's rows are cut into p slices; worker k
  receives slice k of every partial and sums it, so all workers reduce at once and each
  moves 1/p of the data (paper Fig. "parallel reduction" (a)).
* ``two-phase``: topology-aware. Partials are first summed inside each group of workers
  (same NVLink island / PCIe switch / NUMA node), then the group sums go to worker k
  (paper Fig. (b)). Groups come from config (``plan.groups``) or from NVML.
* ``one``: everything to one worker, the baseline for benchmarks only.

What moves is always the packed lower triangle, f(f+1)/2 floats per row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distributed import Future

from . import tasks

if TYPE_CHECKING:
    from ..plan import HalfPlan
    from .graph import SUALSEngine


def reduce_slices(
    engine: SUALSEngine, h: HalfPlan, partials: list[Future], target: str, tag: str
) -> list[Future]:
    """The inputs of the final sum on `target`: the partials, or their per-group sums."""
    groups = engine.plan.groups
    if engine.plan.reduction != "two-phase" or not groups or len(groups) < 2:
        return list(partials)
    index = {w: n for n, w in enumerate(engine.workers)}
    target_n = index[target]
    inputs = []
    for g, members in enumerate(groups):
        mine = [fut for i, fut in enumerate(partials) if i % len(engine.workers) in members]
        if not mine:
            continue
        if len(mine) == 1:
            inputs.append(mine[0])
            continue
        home = target_n if target_n in members else members[0]
        inputs.append(
            engine.client.submit(
                tasks.sum_partials,
                *mine,
                key=f"reduce-group{g}-{h.label}-{tag}-{engine.run}",
                workers=[engine.workers[home]],
                allow_other_workers=False,
                pure=False,
            )
        )
    return inputs

