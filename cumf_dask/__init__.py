"""cumf-dask: ALS matrix factorization (cuMF's MO-ALS and SU-ALS) on Dask, on CPUs and GPUs."""

from __future__ import annotations

from .config import Config, load_config
from .data.store import RatingsStore
from .engine.plan import Plan, make_plan
from .errors import (
    ConfigError,
    CumfError,
    DeviceMemoryError,
    IngestError,
    NotFittedError,
    PlanError,
    StoreError,
)
from .implicit.model import ImplicitALS
from .model import ALS

__version__ = "0.1.0"

__all__ = [
    "ALS",
    "Config",
    "ConfigError",
    "CumfError",
    "DeviceMemoryError",
    "ImplicitALS",
    "IngestError",
    "NotFittedError",
    "Plan",
    "PlanError",
    "RatingsStore",
    "StoreError",
    "load_config",
    "make_plan",
]
