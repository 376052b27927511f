"""The one place where the implicit estimator's users and items become dense indices.

Every public method of :class:`~cumf_dask.implicit.model.ImplicitALS` takes and returns the
data's own user and item ids, like the explicit estimator's: :class:`IdLayer` maps them to
dense indices (row i of ``user_factors_``, row j of ``item_factors_``) and back through the
estimator's id maps (:class:`~cumf_dask.ids.IdMap`, from the store's ``ids/rows`` and
``ids/cols``; the identity when the data's ids were the indices).

:func:`interactions_block` reads the interactions of users given by the caller (a SciPy
sparse matrix, or COO arrays), for folding in users and filtering their items.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..blocks import Block, coo_to_block
from ..checks import check_columns_match
from ..errors import ConfigError
from ..ids import IdMap
from ..model import ALS


class IdLayer:
    """The estimator's users and items, own ids in and out (see the module doc)."""

    def __init__(self, users: IdMap, items: IdMap):
        self._users, self._items = users, items

    def users(self, ids: Any) -> np.ndarray:
        """Dense user indices of `ids` (an unknown id is a ConfigError)."""
        return self._users.indices(ids)

    def items(self, ids: Any) -> np.ndarray:
        """Dense item indices of `ids` (an unknown id is a ConfigError)."""
        return self._items.indices(ids)

    def item_ids(self, index: np.ndarray) -> np.ndarray:
        """The own ids of dense item indices (-1, an empty place, stays -1; None for text)."""
        return self._items.ids(index)

    def user_ids(self, index: np.ndarray) -> np.ndarray:
        """The own ids of dense user indices."""
        return self._users.ids(index)


def interactions_block(user_items: Any, n_rows: int | None, n_items: int) -> Block:
    """A CSR block of `n_rows` users' interactions over all items.

    `user_items`: a SciPy sparse matrix of shape (n_rows, n_items) (what implicit takes), or
    ``(rows, items, counts)`` arrays with rows in [0, n_rows) (one row per requested user;
    `n_rows` None: as many as the highest row needs). A pair given more than once is one
    interaction with the sum of its counts, as SciPy and implicit read it.
    """
    if hasattr(user_items, "tocoo"):
        coo = user_items.tocoo()
        if n_rows is None:
            n_rows = coo.shape[0]
        if coo.shape != (n_rows, n_items):
            raise ConfigError(
                f"user_items is {coo.shape[0]} x {coo.shape[1]}; it needs one row per user "
                f"asked for and one column per item: {n_rows} x {n_items}"
            )
        rows, cols, vals = coo.row, coo.col, coo.data
    elif isinstance(user_items, (tuple, list)) and len(user_items) == 3:
        rows, cols, vals = user_items
    else:
        raise ConfigError("user_items must be a SciPy sparse matrix or (rows, items, counts)")
    rows = ALS._as_indices(rows, "user_items row")
    cols = ALS._as_indices(cols, "user_items item")
    vals = np.asarray(vals, np.float64)
    check_columns_match("user_items", "rows, items and counts", rows, cols, vals)
    if n_rows is None:
        n_rows = int(rows.max()) + 1 if rows.size else 0
    if rows.size and (rows.min() < 0 or rows.max() >= n_rows):
        raise ConfigError(f"user_items rows must be in [0, {n_rows}): one per user asked for")
    if cols.size and (cols.min() < 0 or cols.max() >= n_items):
        raise ConfigError(f"user_items items must be indices in [0, {n_items})")
    if vals.size and (not np.isfinite(vals).all() or vals.min() < 0):
        raise ConfigError("user_items counts must be finite and >= 0")
    pairs, at = np.unique(rows * np.int64(n_items) + cols, return_inverse=True)
    vals = np.bincount(at, weights=vals, minlength=pairs.size)  # repeated pairs summed
    rows, cols = pairs // n_items, pairs % n_items
    return coo_to_block(rows, cols, vals.astype(np.float32), 0, 0, n_rows, n_items)
