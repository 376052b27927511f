"""Optional imports in one place: the CPU path never imports cupy at module level."""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from typing import Any


def has_module(name: str) -> bool:
    """Whether `name` can be imported, without importing it."""
    return importlib.util.find_spec(name) is not None


@lru_cache(maxsize=1)
def cuda_device_count() -> int:
    """Number of CUDA GPUs visible to this process, without creating a CUDA context.

    Uses NVML (nvidia-ml-py) when present, else ``nvidia-smi``-free heuristics:
    ``CUDA_VISIBLE_DEVICES`` and the presence of cupy. Creating a context in the client
    process before dask-cuda starts its workers is a known pitfall, so cupy is not asked.
    """
    if not has_module("cupy"):
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return 0
    if visible is not None:
        count = min(count, len([v for v in visible.split(",") if v.strip()]))
    return count


def has_cuda() -> bool:
    """True when cupy is installed and at least one GPU is visible."""
    return cuda_device_count() > 0


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
