"""A plain float64 ALS, one row at a time: the ground truth for every plan and backend.

The math (cuMF paper, eq. 2-3, weighted-lambda regularization)::

    x_u = (sum_v theta_v theta_v^T + lambda * n_u * I)^-1  sum_v r_uv theta_v

Rows with no ratings keep a zero factor.
"""

from __future__ import annotations

import numpy as np


def half_step(rows, cols, vals, n_rows, fixed, lam):
    """Solve every row of one side from the fixed other side (float64)."""
    f = fixed.shape[1]
    out = np.zeros((n_rows, f))
    order = np.argsort(rows, kind="stable")
    rows, cols, vals = rows[order], cols[order], vals[order]
    starts = np.searchsorted(rows, np.arange(n_rows + 1))
    for u in range(n_rows):
        lo, hi = starts[u], starts[u + 1]
        if hi == lo:
            continue
        G = fixed[cols[lo:hi]]
        A = G.T @ G + lam * (hi - lo) * np.eye(f)
        out[u] = np.linalg.solve(A, G.T @ vals[lo:hi])
    return out


def reference_als(rows, cols, vals, shape, theta0, lam, iterations):
    """ALS from a given initial Theta; returns (X, Theta) in float64."""
    m, n = shape
    rows, cols = np.asarray(rows, np.int64), np.asarray(cols, np.int64)
    vals = np.asarray(vals, np.float64)
    theta = np.asarray(theta0, np.float64)
    x = np.zeros((m, theta.shape[1]))
    for _ in range(iterations):
        x = half_step(rows, cols, vals, m, theta, lam)
        theta = half_step(cols, rows, vals, n, x, lam)
    return x, theta
