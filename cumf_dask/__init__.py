"""cumf-dask: ALS matrix factorization (cuMF's MO-ALS and SU-ALS) on Dask, on CPUs and GPUs."""

from __future__ import annotations

from .config import Config, load_config
from .data.store import RatingsStore
from .engine.plan import Plan, make_plan
from .errors import (
    ConfigError,
    CumfError,
    CumfWarning,
    DeviceMemoryError,
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

__all__ = [
    "ALS",
    "Config",
    "ConfigError",
    "CumfError",
    "CumfWarning",
    "DeviceMemoryError",
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
