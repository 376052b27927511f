"""Signatures of the callbacks that long operations take, defined once for the whole library.

* ``Progress(stage, done, total)``: called as work finishes; `stage` names it ("read",
  "bands", "generate", "transpose", "update X", "train", ...); `total` is None when unknown.
* ``Log(line)``: one human-readable line.
* ``IterationCallback(record)``: the metrics record of a finished ALS iteration (a dict:
  iteration, seconds, x_seconds, theta_seconds, train_rmse, test_rmse, elapsed). `seconds`
  runs from the end of the previous iteration to the end of this one; the fit queues each
  iteration before scoring the previous one, so that scoring (and checkpointing) overlaps
  this iteration and is counted in its `x_seconds`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Progress = Callable[[str, int, int | None], None]
Log = Callable[[str], None]
IterationCallback = Callable[[dict[str, Any]], None]
