"""cumf-dask: ALS matrix factorization (cuMF's MO-ALS and SU-ALS) on Dask, on CPUs and GPUs.

The names below are imported on first use (PEP 562), so ``import cumf_dask.errors`` and the
``cumf-dask`` command's start do not pay for Dask, Zarr and the engine until they need them
(a Ctrl-C during those imports is then the command's own "interrupted", exit 130).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import Config, load_config
    from .data.store import RatingsStore
    from .engine.plan import Plan, make_plan
    from .errors import (
        ConfigError,
        CumfError,
        CumfWarning,
        DeviceMemoryError,
        HostMemoryError,
        IngestError,
        NotFittedError,
        NumericalError,
        PlanError,
        StoreError,
        WorkerLostError,
    )
    from .implicit.model import ImplicitALS
    from .model import ALS

__version__ = "0.1.0"

#: each public name and the module that defines it
_HOMES = {
    "ALS": ".model",
    "Config": ".config",
    "ImplicitALS": ".implicit.model",
    "Plan": ".engine.plan",
    "RatingsStore": ".data.store",
    "load_config": ".config",
    "make_plan": ".engine.plan",
    **dict.fromkeys(
        ["ConfigError", "CumfError", "CumfWarning", "DeviceMemoryError", "HostMemoryError",
         "IngestError", "NotFittedError", "NumericalError", "PlanError", "StoreError",
         "WorkerLostError"],
        ".errors",
    ),
}  # fmt: skip

__all__ = [
    "ALS",
    "Config",
    "ConfigError",
    "CumfError",
    "CumfWarning",
    "DeviceMemoryError",
    "HostMemoryError",
    "ImplicitALS",
    "IngestError",
    "NotFittedError",
    "NumericalError",
    "Plan",
    "PlanError",
    "RatingsStore",
    "StoreError",
    "WorkerLostError",
    "load_config",
    "make_plan",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value  # found once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
