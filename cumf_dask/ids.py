"""The map between a data set's own ids and dense indices (the rows of a factor), both ways.

Ingestion numbers ids 0, 1, ... in order of first appearance and keeps the list (``labels``);
data without ids of its own (a declared shape, a SciPy matrix) has the indices as its ids.
"""

from __future__ import annotations

from numbers import Real
from typing import Any

import numpy as np

from .errors import ConfigError


class IdMap:
    """One axis: ``labels[i]`` is the own id of index i (None: the ids are 0..size-1)."""

    def __init__(self, noun: str, labels: np.ndarray | None, size: int):
        self.noun, self.labels, self.size = noun, labels, size
        self._index: Any = None  # a pandas Index of the labels, built on first use

    def indices(self, ids: Any) -> np.ndarray:
        """Dense int64 indices of own ids; an id that is not there is a ConfigError."""
        ids = np.atleast_1d(np.asarray(ids))
        if ids.ndim > 1:
            raise ConfigError(f"{self.noun} ids must be a 1-d list or array, got shape {ids.shape}")
        if self.labels is None:
            if ids.dtype.kind in "iu":
                idx = ids.astype(np.int64)
                bad = (idx < 0) | (idx >= self.size)
            else:  # each id on its own: 2.5 or "a" is not an index, 2.0 and object 2 are
                value = _numbers(ids)
                bad = ~((value >= 0) & (value < self.size) & (value == np.floor(value)))
                idx = np.where(bad, -1, value).astype(np.int64)
        else:
            if self._index is None:
                import pandas as pd

                self._index = pd.Index(self.labels)
            idx = np.asarray(self._index.get_indexer(ids), np.int64)
            bad = idx < 0
        if bad.any():
            first = ids[int(np.argmax(bad))]
            first = first.item() if isinstance(first, np.generic) else first
            known = (f"ids are the indices 0..{self.size - 1}" if self.labels is None
                     else f"e.g. {self.labels[:3].tolist()}")  # fmt: skip
            raise ConfigError(
                f"{self.noun} id {first!r} is not in the model's {self.noun} ids ({known})"
            )
        return idx

    def ids(self, indices: np.ndarray) -> np.ndarray:
        """Own ids of dense indices; a -1 placeholder (no item in that place) stays -1, or
        None where the ids are text."""
        if self.labels is None:
            return indices
        indices = np.asarray(indices)
        missing = indices < 0
        out = self.labels[np.where(missing, 0, indices)]
        if missing.any():
            out = out.astype(object) if out.dtype.kind in "OUST" else out.copy()
            out[missing] = None if out.dtype == object else -1
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_index": None}


def _numbers(ids: np.ndarray) -> np.ndarray:
    """`ids` as float64, NaN for each id that is not a real number (text, a bool, None)."""
    if ids.dtype.kind == "f":
        return ids.astype(np.float64)
    if ids.dtype.kind != "O":
        return np.full(ids.shape, np.nan)
    real = [isinstance(v, Real) and not isinstance(v, bool) for v in ids]
    return np.array([float(v) if ok else np.nan for v, ok in zip(ids, real, strict=True)])
