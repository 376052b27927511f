"""The exceptions cumf-dask raises; each message names the problem and the fix.

Every class is exported from the package (``from cumf_dask import StoreError``). The CLI
maps them to exit codes: ConfigError and NotFittedError 2, StoreError, IngestError and
NumericalError 3, PlanError and DeviceMemoryError 4, WorkerLostError 1.
:class:`CumfWarning` is what did not stop a run but must be seen (a damaged checkpoint
skipped, leftovers removed, a lost worker replaced); the CLI prints it on stderr.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager


class CumfError(Exception):
    """Base class: a user-facing error with a message that says what to do."""

    def __reduce__(self) -> tuple:
        # Rebuilt from the message: Dask ships a task's error to the client pickled, and
        # the default reduction cannot rebuild the classes that also derive from a
        # built-in error (DeviceMemoryError's MemoryError, for tblib's unpickler).
        return type(self), self.args


class ConfigError(CumfError, ValueError):
    """A config key or an argument is missing, unknown, of the wrong type or out of range."""


class NotFittedError(CumfError, ValueError, AttributeError):
    """The model is used before ``fit`` or ``ALS.load`` gave it factors (as scikit-learn's,
    also an AttributeError: ``hasattr(model, "user_factors")`` is False until then)."""


class StoreError(CumfError, ValueError):
    """A rating store, model or checkpoint is missing, damaged, partial, foreign or misused."""


class StoreUnreachable(StoreError):
    """A store at a URL cannot be reached (a lost connection, credentials): not damage, and
    not a sign that it was replaced."""


class IngestError(CumfError, ValueError):
    """An input file or array cannot be turned into a rating store."""


class PlanError(CumfError, ValueError):
    """No partition of the problem fits the memory that is available."""


class DeviceMemoryError(CumfError, MemoryError):
    """A worker (GPU or CPU) ran out of memory; the message says how to plan smaller."""


class HostMemoryError(DeviceMemoryError):
    """A GPU worker could not lock (pin) host memory; the message says how to keep R and the
    factors off host memory."""


class NumericalError(CumfError, ArithmeticError):
    """Training produced non-finite factors (NaN or inf); the message names the iteration."""


class WorkerLostError(CumfError, RuntimeError):
    """Workers were lost more often than a fit recovers from; the message says how to resume."""


class ClusterClosing(CumfError, RuntimeError):
    """A task stopped midway because its local cluster is being closed (a Ctrl-C or an
    error in the fit): never a result anyone sees, the fit's own exception is raised."""


class CumfWarning(UserWarning):
    """A problem cumf-dask handled on its own and that the user should still know of."""


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn(message: str) -> None:
    """A CumfWarning attributed to the first caller outside cumf-dask: the user's line, so
    the warning points at their call, and Python's once-per-location rule tells their calls
    apart (a library line would show each warning once for all of them)."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, CumfWarning, stacklevel=level)


CUDA_OUT_OF_MEMORY = 2  # cudaErrorMemoryAllocation (runtime), CUDA_ERROR_OUT_OF_MEMORY (driver)
_CUDA_ERRORS = ("CUDARuntimeError", "CUDADriverError")  # CuPy's, by name


def is_out_of_memory(exc: BaseException) -> bool:
    """MemoryError, CuPy's (or any framework's) OutOfMemoryError, or CUDA's allocation
    failure (a CUDARuntimeError/CUDADriverError of status 2: page-locked host memory that
    cudaHostAlloc could not lock), all without importing CuPy."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return type(exc).__name__ in _CUDA_ERRORS and _cuda_status(exc) == CUDA_OUT_OF_MEMORY


def _cuda_status(exc: BaseException) -> int | None:
    """A CUDA error's status code (None if it has none that is an int)."""
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


@contextmanager
def out_of_memory_as(
    what: str, fix: str, kind: type[DeviceMemoryError] = DeviceMemoryError
) -> Iterator[None]:
    """Turn running out of memory while doing `what` into one error of `kind` naming `fix`.

    The error carries no chain: Dask pickles a task's error with its __context__, and an
    allocator's error need not unpickle (the client would get a bare Exception instead)."""
    try:
        yield
    except DeviceMemoryError:
        raise
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        error = kind(f"a worker ran out of memory {what} ({exc}); {fix}")
        try:
            raise error from None
        finally:
            error.__context__ = None
