"""Optional imports in one place: the CPU path never imports cupy at module level."""

from __future__ import annotations

import importlib.util
from typing import Any


def has_module(name: str) -> bool:
    """Whether `name` can be imported, without importing it."""
    return importlib.util.find_spec(name) is not None


def import_cupy() -> Any:
    """Import cupy, or raise ImportError with the install hint."""
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError(
            "the GPU backend needs cupy: pip install 'cumf-dask[gpu]' "
            "(cupy-cuda13x; use cupy-cuda12x on a CUDA 12 system)"
        ) from exc
    return cupy
