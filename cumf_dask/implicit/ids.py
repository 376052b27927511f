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
from ..errors import ConfigError
from ..ids import IdMap


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


def interactions_block(user_items: Any, n_rows: int, n_items: int) -> Block:
    """A CSR block of `n_rows` users' interactions over all items.

    `user_items`: a SciPy sparse matrix of shape (n_rows, n_items) (what implicit takes), or
    ``(rows, items, counts)`` arrays with rows in [0, n_rows) (one row per requested user).
    """
    if hasattr(user_items, "tocoo"):
        coo = user_items.tocoo()
        if coo.shape != (n_rows, n_items):
            raise ConfigError(
                f"user_items is {coo.shape[0]} x {coo.shape[1]}; it needs one row per user "
                f"asked for and one column per item: {n_rows} x {n_items}"
            )
        rows, cols, vals = coo.row, coo.col, coo.data
    elif isinstance(user_items, (tuple, list)) and len(user_items) == 3:
        rows, cols, vals = (np.asarray(a) for a in user_items)
    else:
        raise ConfigError("user_items must be a SciPy sparse matrix or (rows, items, counts)")
    rows = np.asarray(rows, np.int64)
    cols = np.asarray(cols, np.int64)
    if rows.size and (rows.min() < 0 or rows.max() >= n_rows):
        raise ConfigError(f"user_items rows must be in [0, {n_rows}): one per user asked for")
    if cols.size and (cols.min() < 0 or cols.max() >= n_items):
        raise ConfigError(f"user_items items must be indices in [0, {n_items})")
    vals = np.asarray(vals, np.float32)
    if vals.size and (not np.isfinite(vals).all() or vals.min() < 0):
        raise ConfigError("user_items counts must be finite and >= 0")
    return coo_to_block(rows, cols, vals, 0, 0, n_rows, n_items)
