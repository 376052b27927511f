"""Signatures of the callbacks that long operations take, defined once for the whole library.

* ``Progress(stage, done, total)``: called as work finishes; `stage` names it ("read",
  "bands", "generate", "transpose", "update X", "train", ...); `total` is None when unknown.
* ``Log(line)``: one human-readable line.
* ``IterationCallback(record)``: the metrics record of a finished ALS iteration (a dict:
  iteration, seconds, x_seconds, theta_seconds, train_rmse, test_rmse, elapsed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Progress = Callable[[str, int, int | None], None]
Log = Callable[[str], None]
IterationCallback = Callable[[dict[str, Any]], None]
