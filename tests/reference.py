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


# ----------------------------------------------------------------------------- implicit
# Hu, Koren, Volinsky: p_uv = 1 where r_uv > 0, c_uv = 1 + alpha r_uv (or 1 + alpha
# log(1 + r_uv / eps)); per row (Y^T Y + Y_u^T (C_u - I) Y_u + reg_u I) x_u = Y_u^T C_u p_u,
# reg_u = lam (plain) or lam n_u (weighted). CG: implicit 0.7.3's recurrence (its
# cpu/_als.pyx), warm-started from the previous factors. Float64, one row at a time.


def confidence(vals, alpha, form="linear", eps=1.0):
    r = np.maximum(np.asarray(vals, np.float64), 0)
    return 1 + alpha * (r if form == "linear" else np.log1p(r / eps))


def _rows(rows, cols, vals, n_rows):
    order = np.argsort(rows, kind="stable")
    rows, cols, vals = rows[order], cols[order], np.asarray(vals, np.float64)[order]
    return cols, vals, np.searchsorted(rows, np.arange(n_rows + 1))


def implicit_half_step(rows, cols, vals, n_rows, fixed, lam, alpha, *, weighted=False,
                       solver="cholesky", previous=None, cg_steps=3, form="linear", eps=1.0,
                       dtype=np.float64):  # fmt: skip
    """Solve every row from the fixed factor: exactly, or by implicit's CG from `previous`.
    In float64; `dtype=np.float32` shows what float32 arithmetic alone changes."""
    f = fixed.shape[1]
    cols, vals, starts = _rows(np.asarray(rows), np.asarray(cols), vals, n_rows)
    fixed = np.asarray(fixed, dtype)
    G0 = fixed.T @ fixed
    out = np.zeros((n_rows, f), dtype) if previous is None else np.array(previous, dtype)
    for u in range(n_rows):
        lo, hi = starts[u], starts[u + 1]
        if hi == lo:
            out[u] = 0
            continue
        Y = fixed[cols[lo:hi]]
        c = confidence(vals[lo:hi], alpha, form, eps).astype(dtype)
        p = (vals[lo:hi] > 0).astype(dtype)
        reg = lam * (hi - lo) if weighted else lam
        A = G0 + (Y.T * (c - 1)) @ Y + dtype(reg) * np.eye(f, dtype=dtype)
        b = Y.T @ (c * p)
        out[u] = np.linalg.solve(A, b) if solver == "cholesky" else cg(A, b, out[u], cg_steps)
    return out


def cg(A, b, x, steps):
    """implicit's CG: from x, `steps` steps; skip when r.r < 1e-20, stop when it falls below.
    In A's precision."""
    x = np.array(x, A.dtype)
    r = b - A @ x
    d = r.copy()
    rsold = r @ r
    if rsold < 1e-20:
        return x
    for _ in range(steps):
        Ad = A @ d
        a = rsold / (d @ Ad)
        x += a * d
        r -= a * Ad
        rsnew = r @ r
        if rsnew < 1e-20:
            break
        d = r + (rsnew / rsold) * d
        rsold = rsnew
    return x


def cg_half_step(rows, cols, vals, n_rows, fixed, lam, previous, steps):
    """The explicit model's rows by `steps` CG steps from `previous` (weighted lambda)."""
    f = fixed.shape[1]
    cols, vals, starts = _rows(np.asarray(rows), np.asarray(cols), vals, n_rows)
    fixed = np.asarray(fixed, np.float64)
    out = np.zeros((n_rows, f))
    for u in range(n_rows):
        lo, hi = starts[u], starts[u + 1]
        if hi > lo:
            G = fixed[cols[lo:hi]]
            A = G.T @ G + lam * (hi - lo) * np.eye(f)
            out[u] = cg(A, G.T @ vals[lo:hi], previous[u], steps)
    return out


def implicit_objective(rows, cols, vals, X, Y, lam, alpha, *, weighted=False, form="linear",
                       eps=1.0):
    """sum over all pairs of c_uv (p_uv - x_u.y_v)^2, plus sum_u reg_u |x_u|^2 and items' same."""
    X, Y = np.asarray(X, np.float64), np.asarray(Y, np.float64)
    rows, cols = np.asarray(rows), np.asarray(cols)
    c = confidence(vals, alpha, form, eps)
    p = (np.asarray(vals) > 0).astype(np.float64)
    s = np.einsum("ij,ij->i", X[rows], Y[cols])
    total = np.sum((X.T @ X) * (Y.T @ Y)) + np.sum(c * (p - s) ** 2 - s**2)
    nu = np.bincount(rows, minlength=len(X)) if weighted else np.ones(len(X))
    nv = np.bincount(cols, minlength=len(Y)) if weighted else np.ones(len(Y))
    return float(total + lam * (nu @ (X * X).sum(1) + nv @ (Y * Y).sum(1)))


def reference_implicit_als(rows, cols, vals, shape, x0, theta0, lam, alpha, iterations,
                           **options):
    """Implicit ALS from (X0, Theta0); returns (X, Theta, objective after each iteration)."""
    m, n = shape
    dtype = options.get("dtype", np.float64)
    x, theta = np.array(x0, dtype), np.array(theta0, dtype)
    history = []
    for _ in range(iterations):
        x = implicit_half_step(rows, cols, vals, m, theta, lam, alpha, previous=x, **options)
        theta = implicit_half_step(cols, rows, vals, n, x, lam, alpha, previous=theta, **options)
        keep = {k: v for k, v in options.items() if k in ("weighted", "form", "eps")}
        history.append(implicit_objective(rows, cols, vals, x, theta, lam, alpha, **keep))
    return x, theta, history
