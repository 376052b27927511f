"""Backends: NumPy (CPU) and CuPy (GPU) implementations of one interface."""

from __future__ import annotations

from functools import cache

from ..compat import has_cuda
from .base import Backend

__all__ = ["Backend", "get_backend", "resolve_backend_name"]


def resolve_backend_name(name: str = "auto") -> str:
    """'auto' -> 'cupy' when cupy and a GPU are present, else 'numpy'."""
    if name == "auto":
        return "cupy" if has_cuda() else "numpy"
    if name not in ("numpy", "cupy"):
        raise ValueError(f"unknown backend {name!r}; use 'auto', 'numpy' or 'cupy'")
    return name


@cache
def get_backend(name: str = "auto") -> Backend:
    """The backend object for a name (one per process)."""
    resolved = resolve_backend_name(name)
    if resolved == "cupy":
        from .cupy_backend import CupyBackend

        return CupyBackend()
    from .numpy_backend import NumpyBackend

    return NumpyBackend()
