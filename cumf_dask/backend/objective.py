"""What a row update solves (explicit or implicit feedback) and how (Cholesky or CG).

For every row u of the solved factor, from the rows y_v of the fixed factor Y that u rated,
both models solve one system per row::

    (G0 + sum_v s_v^2 y_v y_v^T + reg_u I) x_u = sum_v s_v t_v y_v                  (1)

* explicit (cuMF, weighted lambda): ``G0 = 0``, ``s_v = 1``, ``t_v = r_uv``;
* implicit (Hu, Koren, Volinsky): preference ``p_uv = 1`` where ``r_uv > 0``, confidence
  ``c_uv = 1 + alpha r_uv`` ("linear") or ``1 + alpha log(1 + r_uv / eps)`` ("log"), weight
  ``w_uv = c_uv - 1``, and ``G0 = Y^T Y`` (the whole fixed factor's Gram, one GEMM per
  half-step), ``s_v = sqrt(w_uv)``, ``t_v = c_uv p_uv / s_v``; then (1) reads
  ``(Y^T Y + Y_u^T (C_u - I) Y_u + reg_u I) x_u = Y_u^T C_u p_u``. Stored entries with
  ``r_uv <= 0`` have p = 0 and c = 1: they add nothing (s = t = 0).
* ``reg_u = lam * n_u`` ("weighted", cuMF's ALS-WR; n_u = u's stored entries) or ``lam``
  ("plain", what implicit does).

Why a row scale s and an appended value t: the Gram kernels append t_v to each gathered row
s_v y_v, so one register-tiled Gram of the extended rows [s_v y_v, t_v] holds
``sum s^2 y y^T`` in its leading block and ``sum s t y = sum c p y`` in its row f (see
kernels/mo_als.cu). Explicit data is the case s = 1, t = r, so both models share one Gram
code path with nothing added to its inner loop: the scale is applied once per gathered row
as it is staged, and the explicit kernels skip it (``scale`` is None). A weight of exactly
0 on a positive (alpha = 0: every confidence 1) has no square root to split; it is floored at
``W_MIN`` (the 1e-12 it adds to A is far below float32 resolution). Confidences below 1
(which implicit allows) cannot be written this way: the confidence forms above are >= 1
for alpha >= 0 and ratings >= 0, and the estimator checks both.

``G0`` is added once per row, after any reduction of partial Hermitians (like reg_u), so the
partials of a data-parallel half-step (p > 1) never include it.

Solvers: "cholesky" solves (1) exactly; "cg" runs ``cg_steps`` steps of conjugate gradient
warm-started from the row's previous factor, exactly implicit's recurrence (absolute 1e-20
stopping thresholds; rows without ratings get 0; a row whose system is not finite gets NaN,
reported by the finite checks). :func:`batched_cg` is that recurrence on a stack of formed
matrices, for any array module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ..checks import check_choice, check_number
from ..errors import ConfigError

CG_SMALL = 1e-20  # implicit's absolute threshold on r.r (skip a row / stop early)
W_MIN = 1e-12  # floor of an implicit weight c - 1 on a positive entry (see module doc)
SOLVERS = ("cholesky", "cg")
CONFIDENCES = ("linear", "log")
F32_MAX = float(np.finfo(np.float32).max)  # the backends compute the weights in float32
Solver = Literal["cholesky", "cg"]
ConfidenceForm = Literal["linear", "log"]


@dataclass(frozen=True)
class UpdateSpec:
    """The objective and solver of a row update (see the module doc).

    ``implicit`` False: explicit ratings (alpha, confidence, eps unused).
    ``weighted``: reg_u = lam * n_u, else lam.
    """

    lam: float
    weighted: bool = True
    implicit: bool = False
    alpha: float = 1.0
    confidence: ConfidenceForm = "linear"
    eps: float = 1.0
    solver: Solver = "cholesky"
    cg_steps: int = 3

    def __post_init__(self) -> None:
        check_number("regularization", self.lam, 0, low_inclusive=False)
        check_choice("solver", self.solver, SOLVERS)
        check_choice("confidence", self.confidence, CONFIDENCES)
        check_number("cg_steps", self.cg_steps, 1, integer=True)
        check_number("alpha", self.alpha, 0)
        check_number("eps", self.eps, 0, low_inclusive=False)

    @property
    def cg(self) -> bool:
        return self.solver == "cg"


def as_spec(lam: float | UpdateSpec) -> UpdateSpec:
    """A bare lambda means the explicit model, weighted lambda, Cholesky (cuMF's)."""
    return lam if isinstance(lam, UpdateSpec) else UpdateSpec(float(lam))


def confidence_of(xp: Any, values: Any, spec: UpdateSpec) -> Any:
    """c = 1 + alpha g(r) of stored values (float64 on the host, float32 on a device)."""
    r = xp.maximum(values, 0)
    g = r if spec.confidence == "linear" else xp.log1p(r / spec.eps)
    return 1 + spec.alpha * g


def gram_weights(xp: Any, values: Any, spec: UpdateSpec | None) -> tuple[Any, Any]:
    """(s, t) of each stored value for the Gram of (1): (None, values) when explicit."""
    if spec is None or not spec.implicit:
        return None, values
    c = confidence_of(xp, values, spec)
    positive = values > 0
    w = xp.maximum(c - 1, W_MIN)
    s = xp.sqrt(w)
    t = c / s
    zero = xp.zeros((), s.dtype)
    return (
        xp.where(positive, s, zero).astype(xp.float32),
        xp.where(positive, t, zero).astype(xp.float32),
    )


def check_confidence(spec: UpdateSpec, top: float | None) -> None:
    """ConfigError when the confidence of the largest value `top` (a store's stats) is not
    finite in float32, as the backends compute it: its weights (s inf, t NaN) would make
    every system with it non-finite; said before anything runs, with the alpha that fits."""
    if not spec.implicit or top is None or not top > 0:
        return
    with np.errstate(all="ignore"):
        s, t = gram_weights(np, np.array([top], np.float32), spec)
        ratio = np.float32(top) / np.float32(spec.eps)  # the log form's r / eps, in float32
    if np.isfinite(s).all() and np.isfinite(t).all():
        return
    linear = spec.confidence == "linear"
    if not linear and not np.isfinite(ratio):
        raise ConfigError(
            f"eps {spec.eps:g} (model.eps): the log confidence's largest rating over eps, "
            f"{top:g} / {spec.eps:g}, overflows float32 (above {F32_MAX:.3g}); use a larger eps"
        )
    g = top if linear else math.log1p(float(ratio))
    form = "r" if linear else "log(1 + r / eps)"
    raise ConfigError(
        f"alpha {spec.alpha:g} (model.alpha): the confidence 1 + alpha {form} of the largest "
        f"rating ({top:g}) overflows float32 (above {F32_MAX:.3g}): its weights would not be "
        f"finite; use alpha below {F32_MAX / max(g, 1.0) / 2:.3g}, or rescale the ratings"
    )


def regularization(xp: Any, counts: Any, spec: UpdateSpec) -> Any:
    """reg_u of each row: lam * n_u (weighted) or lam."""
    counts = xp.asarray(counts)
    if spec.weighted:
        return spec.lam * counts.astype(xp.float64)
    return xp.full(counts.shape, spec.lam, xp.float64)


def symmetric(xp: Any, M: Any) -> Any:
    """Full symmetric matrices from the lower triangles of a stack (upper ones ignored)."""
    lower = xp.tril(M)
    return lower + xp.swapaxes(xp.tril(M, -1), -1, -2)


def batched_cg(xp: Any, M: Any, b: Any, x0: Any, steps: int) -> Any:
    """``steps`` CG steps on M x = b for a stack of systems, from x0 (implicit's recurrence,
    per row: skip when r.r < CG_SMALL at the start, stop when it falls below). `M` is a stack
    of full SPD matrices, or a function giving the stack of products M p (matrix-free).

    A row whose system is not finite (its starting r.r is NaN or inf: M, b or x0 holds one)
    gets NaN, so that the finite checks stop the fit; a NaN that arises later gives 0, as
    implicit's. The GPU's ``cg_solve`` (kernels/cg.cuh) does the same."""
    matvec = M if callable(M) else (lambda v: xp.einsum("rij,rj->ri", M, v))
    x = x0.astype(b.dtype, copy=True)
    r = b - matvec(x)
    p = r.copy()
    rsold = (r * r).sum(axis=1)
    broken = ~xp.isfinite(rsold)
    active = (rsold >= CG_SMALL) & ~broken
    for _ in range(steps):
        if not bool(active.any()):
            break
        Ap = matvec(p)
        pAp = (p * Ap).sum(axis=1)
        a = xp.where(active, rsold / xp.where(active, pAp, 1), 0)[:, None]
        x += a * p
        r -= a * Ap
        rsnew = (r * r).sum(axis=1)
        active &= rsnew >= CG_SMALL
        beta = xp.where(active, rsnew / xp.where(active, rsold, 1), 0)[:, None]
        p = r + beta * p
        rsold = xp.where(active, rsnew, rsold)
    x[~xp.isfinite(x).all(axis=1)] = 0  # as implicit: a NaN that arises in CG never propagates
    x[broken] = xp.nan  # a system that was not finite is reported (NumericalError)
    return x
