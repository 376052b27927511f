"""The cuMF paper's data set shapes (presets) and how a generator's shape is resolved.

Kept apart from the planted model because planning needs only the shape: ``cumf-dask plan``
sizes a billion-rating config from :func:`resolve_shape` without building anything.

A scaled preset keeps the data set's character: ``scale`` multiplies the rating count, and
m and n by ``sqrt(scale)`` each, so the density nnz / (m n) and the aspect m / n stay those
of the full data set (Netflix at any scale is about 1.2% dense and 27 times as tall as wide).
The mean degrees nnz / m and nnz / n shrink by ``sqrt(scale)``: a 1/100 Netflix has a
tenth of the ratings per user and per movie. With ``nonempty`` every row needs at least one
rating, so a preset has a smallest scale, ``(max(m, n) / nnz)^2`` (the error names it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..checks import check_number, check_positive_int
from ..errors import ConfigError


@dataclass(frozen=True)
class Preset:
    """A data set's shape and the cuMF paper's ALS settings for it (f factors, lambda)."""

    name: str
    m: int
    n: int
    nnz: int
    f: int
    lam: float


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("netflix", 480_189, 17_770, 99_000_000, 100, 0.05),
        Preset("yahoomusic", 1_000_990, 624_961, 252_800_000, 100, 1.4),
        Preset("hugewiki", 50_082_603, 39_780, 3_100_000_000, 100, 0.05),
        Preset("sparkals", 660_000_000, 2_400_000, 3_500_000_000, 10, 0.05),
        Preset("factorbird", 229_000_000, 195_000_000, 38_500_000_000, 5, 0.05),
        Preset("facebook", 1_000_000_000, 48_000_000, 112_000_000_000, 16, 0.05),
    )
}


def resolve_shape(
    *,
    preset: str | None = None,
    scale: float = 1.0,
    m: int | None = None,
    n: int | None = None,
    nnz: int | None = None,
    nonempty: bool = True,
) -> tuple[int, int, int]:
    """(m, n, nnz): the preset's shape at `scale`, overridden by explicit m, n, nnz.

    `scale` multiplies the preset's nnz, and its m and n by sqrt(scale) each (density and
    aspect kept, see the module docstring). Raises ConfigError for an unknown preset,
    missing or non-positive sizes, more ratings than cells, or (with nonempty) fewer ratings
    than max(m, n).
    """
    base: dict[str, int | None] = {"m": None, "n": None, "nnz": None}
    found = None
    if preset is not None:
        found = PRESETS.get(preset.lower())
        if found is None:
            raise ConfigError(
                f"generate.preset {preset!r} is unknown; choose one of {', '.join(PRESETS)} "
                "or give m, n and nnz"
            )
        check_number("scale", scale, 0, low_inclusive=False)
        side = math.sqrt(scale)
        base = {"m": max(1, round(found.m * side)), "n": max(1, round(found.n * side)),
                "nnz": max(1, round(found.nnz * scale))}  # fmt: skip
    elif scale != 1.0:
        raise ConfigError(
            f"generate.scale={scale} multiplies a preset's sizes, but no preset is set; "
            "choose a preset or give m, n and nnz at the size you want"
        )
    given = {"m": m, "n": n, "nnz": nnz}
    base.update({k: v for k, v in given.items() if v is not None})
    missing = [k for k, v in base.items() if v is None]
    if missing:
        raise ConfigError(
            f"generate needs {', '.join(missing)}: give a preset ({', '.join(PRESETS)}) "
            "or m, n and nnz"
        )
    m, n, nnz = (int(base[k]) for k in ("m", "n", "nnz"))  # type: ignore[arg-type]
    for key, value in (("m", m), ("n", n), ("nnz", nnz)):
        check_positive_int(key, value)
    if nnz > m * n:
        hint = "lower nnz or enlarge m, n"
        raise ConfigError(
            f"generate: nnz={nnz} ratings do not fit in a {m} x {n} matrix ({m * n} cells); " + hint
        )
    if nonempty and nnz < max(m, n):
        hint = "raise nnz or set nonempty: false"
        if found is not None and all(v is None for v in given.values()):
            least = smallest_scale(found)
            hint = (f"scale shrinks the ratings per row by sqrt(scale); use scale >= "
                    f"{least:.3g} for {found.name}, or nonempty: false")  # fmt: skip
        raise ConfigError(
            f"generate: nonempty needs at least max(m, n) = {max(m, n)} ratings, nnz is {nnz}; "
            + hint
        )
    return m, n, nnz


def smallest_scale(preset: Preset) -> float:
    """The smallest scale at which every row and column of `preset` can have a rating
    (nnz scale >= max(m, n) sqrt(scale)), rounded up a little against rounding."""
    return (max(preset.m, preset.n) / preset.nnz) ** 2 * 1.01
