"""The exceptions cumf-dask raises for bad input; each message names the problem and the fix."""

from __future__ import annotations


class CumfError(Exception):
    """Base class: a user-facing error with a message that says what to do."""


class ConfigError(CumfError, ValueError):
    """A config file or value is missing, unknown, or of the wrong type."""


class StoreError(CumfError, ValueError):
    """A rating store is missing, damaged, partial, of another format, or misused."""


class IngestError(CumfError, ValueError):
    """An input file or array cannot be turned into a rating store."""


class PlanError(CumfError, ValueError):
    """No partition of the problem fits the memory that is available."""


class DeviceMemoryError(CumfError, MemoryError):
    """A worker (GPU or CPU) ran out of memory; the message says how to plan smaller."""
