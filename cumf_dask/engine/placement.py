"""Placement: which worker holds what, decided in this one place.

* A block R^(ij) of a half-step lives on the worker of its batch j when p == 1 (model
  parallelism: batches spread over workers) and on the worker of its part i when p > 1
  (data parallelism: part i of the fixed factor and its blocks stay together).
* Piece k of a factor (a range of its rows) lives on worker k mod W.
* Slice k of a reduce-scatter is summed and solved on worker k mod W (reduce-to-one: the
  first worker).

Tasks are submitted pinned to their worker (``workers=[addr]``, no stealing), so large data
does not move: :class:`Pinned` does that, with task keys unique to the run.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from distributed import Client, Future

from .plan import HalfStepPlan

Piece = tuple[int, int, Future]  # rows [start, stop) of a factor, as a future on a worker
# rows [lo, hi) of a factor as the pieces that hold them, assembled by the task that uses them
Rows = tuple[int, int, list[Piece]]
COMPUTE = "cumf-compute"  # the worker resource that compute tasks take one unit of


@dataclass
class Factor:
    """A factor held on the workers as row pieces (start, stop, future) covering [0, n_rows)."""

    n_rows: int
    f: int
    pieces: list[Piece]
    placed: dict[Any, Future] = field(default_factory=dict)  # gathered copies, by (rows, worker)
    version: str = field(default_factory=lambda: uuid.uuid4().hex[:6])  # unique in task keys
    owners: list[str] = field(default_factory=list)  # the worker of each piece
    checks: list[Future] = field(default_factory=list)  # tasks.check_finite, one per owner

    def rows(self, lo: int, hi: int) -> Rows:
        """Rows [lo, hi) as the pieces that hold them (only those move to a task's worker)."""
        return lo, hi, [p for p in self.pieces if p[0] < hi and lo < p[1]]


class Placement:
    """The rules above, over worker addresses in a stable order."""

    def __init__(self, workers: list[str]):
        if not workers:
            raise ValueError("no workers to place tasks on")
        self.workers = workers

    def index(self, worker: str) -> int:
        return self.workers.index(worker)

    def block(self, h: HalfStepPlan, part: int, batch: int) -> str:
        """Where block (part, batch) of a half-step lives."""
        return self.workers[(batch if h.p == 1 else part) % len(self.workers)]

    def piece(self, k: int) -> str:
        """Where piece k of a factor lives."""
        return self.workers[k % len(self.workers)]

    def reduced_slice(self, k: int, reduction: str) -> str:
        """Where slice k of a reduction is summed and solved."""
        return self.workers[0] if reduction == "one" else self.workers[k % len(self.workers)]


class Pinned:
    """Submit tasks pinned to one worker, with keys ``<key>-<run>`` unique to this run.

    ``compute`` tasks take one unit of the COMPUTE resource where the workers declare it
    (local clusters made by cumf-dask do), so a worker loads its next block while it
    computes on this one, but never runs two computations at once.
    """

    def __init__(self, client: Client, run: str, compute_slots: bool):
        self.client = client
        self.run = run
        self.compute_slots = compute_slots

    def __call__(
        self,
        func: Callable[..., Any],
        *args: Any,
        key: str,
        worker: str,
        compute: bool = True,
        priority: int = 0,
    ) -> Future:
        """`priority` > 0: ahead of tasks submitted earlier that are ready at the same time
        (scoring iteration it before iteration it + 1, already queued, goes on)."""
        return self.client.submit(
            func,
            *args,
            key=f"{key}-{self.run}",
            workers=[worker],
            allow_other_workers=False,
            pure=False,
            priority=priority,
            resources={COMPUTE: 1} if compute and self.compute_slots else None,
        )
