"""Signatures of the callbacks that long operations take, defined once for the whole library.

* ``Progress(stage, done, total)``: called as work finishes; `stage` names it ("read",
  "bands", "generate", "transpose", "update X", "train", ...); `total` is None when unknown.
* ``Log(line)``: one human-readable line.
* ``IterationCallback(record)``: the metrics record of a finished ALS iteration (a dict:
  iteration, seconds, x_seconds, theta_seconds, elapsed, and train_rmse and test_rmse, or
  an implicit model's loss).
  `x_seconds` runs from the end of the previous half-step (or the iteration's submission)
  to the end of update X, `theta_seconds` from there to the end of update Theta, as the
  workers saw them (their clocks); `seconds` is their sum. Scoring and checkpointing
  overlap the next iteration and are in `elapsed` (this process's clock); where the
  scoring's tasks run on the same GPUs between the next iteration's (they go first), the
  time they take shows in that half-step's seconds too: time iterations without evaluation
  (``evaluate=False``) where scoring is heavy (billions of ratings).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Progress = Callable[[str, int, int | None], None]
Log = Callable[[str], None]
IterationCallback = Callable[[dict[str, Any]], None]
