"""Backends: NumPy (CPU) and CuPy (GPU) implementations of one interface."""

from __future__ import annotations

from functools import cache

from ..checks import check_choice
from ..devices import has_cuda
from .base import PRECISIONS, Backend

__all__ = ["PRECISIONS", "Backend", "backend_spec", "get_backend", "resolve_backend_name"]


def resolve_backend_name(name: str = "auto") -> str:
    """'auto' -> 'cupy' when cupy and a GPU are present, else 'numpy'."""
    if name == "auto":
        return "cupy" if has_cuda() else "numpy"
    if name not in ("numpy", "cupy"):
        raise ValueError(f"unknown backend {name!r}; use 'auto', 'numpy' or 'cupy'")
    return name


def backend_spec(name: str, precision: str = "float32") -> str:
    """The string tasks carry to name a backend: 'cupy', or 'cupy+bfloat16' for a precision."""
    check_choice("precision", precision, PRECISIONS)
    name = resolve_backend_name(name)
    return name if precision == "float32" else f"{name}+{precision}"


@cache
def get_backend(spec: str = "auto") -> Backend:
    """The backend object for a spec ('numpy', 'cupy+bfloat16', ...), one per process."""
    name, _, precision = spec.partition("+")
    resolved = resolve_backend_name(name)
    precision = precision or "float32"
    if resolved == "cupy":
        from .cupy_backend import CupyBackend

        return CupyBackend(precision=precision)
    from .numpy_backend import NumpyBackend

    return NumpyBackend(precision=precision)
