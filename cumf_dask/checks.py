"""Argument checks shared by the config schema and the Python API: one rule, one message.

Each raises :class:`~cumf_dask.errors.ConfigError` naming the argument (a config key such as
``data.test_fraction``, or a parameter such as ``test_fraction``) and what is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from numbers import Integral, Real
from typing import Any

from .errors import ConfigError


def check_number(
    name: str,
    value: Any,
    low: float | None = None,
    *,
    low_inclusive: bool = True,
    high: float | None = None,
    high_inclusive: bool = True,
    integer: bool = False,
) -> None:
    """`value` is a (finite) number, an integer if asked, within [low, high] (or open ends)."""
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, Integral if integer else Real):
        raise ConfigError(f"'{name}' must be {kind}, got {value!r}")
    if not integer and not math.isfinite(value):
        raise ConfigError(f"'{name}' must be a finite number, got {value!r}")
    if low is not None and (value < low or (value == low and not low_inclusive)):
        raise ConfigError(f"'{name}' must be {'>=' if low_inclusive else '>'} {low}, got {value!r}")
    if high is not None and (value > high or (value == high and not high_inclusive)):
        raise ConfigError(
            f"'{name}' must be {'<=' if high_inclusive else '<'} {high}, got {value!r}"
        )


def check_fraction(name: str, value: Any) -> None:
    """A held-out share: a number in [0, 1)."""
    check_number(name, value, 0, high=1, high_inclusive=False)


def check_positive_int(name: str, value: Any, *, optional: bool = False) -> None:
    """An integer >= 1 (or None when `optional`)."""
    if optional and value is None:
        return
    check_number(name, value, 1, integer=True)


def check_choice(name: str, value: Any, allowed: Iterable[Any]) -> None:
    """One of the allowed values."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(
            f"'{name}' must be one of {', '.join(map(repr, allowed))}, got {value!r}"
        )


# The largest rating magnitude accepted without a declared scale. Training works in float32
# (max 3.4e38): a rating r enters squares (r^2 in the error, x.theta ~ r in A and B, summed
# over up to ~1e12 ratings), so |r| <= 1e9 keeps every sum below ~1e30, far from overflow;
# 1e30 would overflow at once. No real rating scale comes near 1e9.
MAX_RATING = 1e9


def check_scale(
    low: Any, high: Any, names: tuple[str, str] = ("rating_min", "rating_max")
) -> None:
    """A declared rating scale: numbers (or None) within +-MAX_RATING, low < high."""
    for name, value in zip(names, (low, high), strict=True):
        if value is not None:
            check_number(name, value, -MAX_RATING, high=MAX_RATING)
    if low is not None and high is not None and not low < high:
        raise ConfigError(f"'{names[0]}' ({low}) must be below '{names[1]}' ({high})")


def check_columns_match(what: str, names: str, *arrays: Any) -> None:
    """Arrays that are columns of one table (rows, items, counts): 1-d and of one length,
    else a ConfigError naming `what` takes them (`names`) and their shapes."""
    if not (all(a.ndim == 1 for a in arrays) and len({a.size for a in arrays}) == 1):
        shapes = ", ".join(str(a.shape) for a in arrays)
        raise ConfigError(f"{what} takes {names} as 1-d arrays of one length, got shapes {shapes}")
