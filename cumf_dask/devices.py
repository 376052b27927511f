"""What this process can see of the machine's devices, without creating a CUDA context.

Creating a context in the client process before dask-cuda starts its workers is a known
pitfall, so GPU questions go to NVML (nvidia-ml-py), never to cupy. Inside a worker (where a
context is fine) :func:`gpu_total_memory` reads the current CUDA device's memory from NVML
too (the same figure a plan made without a cluster uses), or from CUDA if NVML cannot.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

from .compat import has_module
from .errors import ConfigError


@lru_cache(maxsize=1)
def cuda_device_count() -> int:
    """GPUs visible to this process: NVML's count, limited by ``CUDA_VISIBLE_DEVICES``; 0
    without cupy (the GPU backend could not use them) or without NVML."""
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


def visible_gpus() -> list[str] | None:
    """This process's ``CUDA_VISIBLE_DEVICES`` entries (indices or UUIDs), in CUDA's order;
    None when it is not set (every GPU is visible, in NVML's order)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if visible is None else [v.strip() for v in visible.split(",") if v.strip()]


def child_visible_devices(positions: list[int]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for worker processes that are to use the GPUs at `positions`
    among this process's visible ones (cluster.devices, as :func:`gpu_memories` counts
    them): their entries of this process's ``CUDA_VISIBLE_DEVICES``. Passed on as they are,
    the positions would name other GPUs where that variable hides some (2,3: [0] is GPU 2)."""
    visible = visible_gpus()
    return ",".join(visible[p] if visible is not None else str(p) for p in positions)


def gpu_memories() -> list[int]:
    """Total bytes of each visible GPU, in CUDA's order (``CUDA_VISIBLE_DEVICES`` entries:
    indices or UUIDs), from NVML, so without a CUDA context; [] where cupy or NVML is absent."""
    count = cuda_device_count()
    if count == 0:
        return []
    import pynvml

    visible = visible_gpus() or []
    pynvml.nvmlInit()
    try:
        sizes = []
        for k in range(count):
            entry = visible[k] if k < len(visible) else ""
            if entry.isdigit():
                handle = pynvml.nvmlDeviceGetHandleByIndex(int(entry))
            elif entry.startswith(("GPU-", "MIG-")):
                handle = _handle_by_uuid(pynvml, entry)
            else:
                handle = pynvml.nvmlDeviceGetHandleByIndex(k)
            sizes.append(int(pynvml.nvmlDeviceGetMemoryInfo(handle).total))
    finally:
        pynvml.nvmlShutdown()
    return sizes


def _handle_by_uuid(pynvml: Any, entry: str) -> Any:
    """NVML's handle of the device a ``CUDA_VISIBLE_DEVICES`` UUID entry names: the whole
    UUID, or (as CUDA accepts) its first characters, matched against every device's UUID
    (NVML itself wants the whole one). ConfigError naming the entry when no device, or
    several, match."""
    try:
        return pynvml.nvmlDeviceGetHandleByUUID(entry)
    except pynvml.NVMLError:
        pass
    found = [handle for uuid, handle in _nvml_uuids(pynvml) if uuid.startswith(entry)]
    if len(found) != 1:
        what = "no GPU's UUID starts" if not found else f"{len(found)} GPUs' UUIDs start"
        raise ConfigError(
            f"CUDA_VISIBLE_DEVICES entry {entry!r}: {what} with it (nvidia-smi -L lists "
            "them); name each GPU by its index or a longer part of its UUID"
        )
    return found[0]


def _nvml_uuids(pynvml: Any) -> list[tuple[str, Any]]:
    """(UUID, handle) of every GPU NVML sees and of their MIG devices, if any."""
    out = []
    for i in range(int(pynvml.nvmlDeviceGetCount())):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        out.append((_text(pynvml.nvmlDeviceGetUUID(handle)), handle))
        out.extend(_mig_uuids(pynvml, handle))
    return out


def _mig_uuids(pynvml: Any, gpu: Any) -> list[tuple[str, Any]]:
    """(UUID, handle) of a GPU's MIG devices ([] when MIG is off or NVML lacks it)."""
    out = []
    try:
        slots = int(pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu))
    except Exception:
        return out
    for j in range(slots):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, j)
        except Exception:  # an empty slot
            continue
        out.append((_text(pynvml.nvmlDeviceGetUUID(mig)), mig))
    return out


def _text(value: str | bytes) -> str:
    """NVML's strings are bytes in older pynvml releases."""
    return value.decode() if isinstance(value, bytes) else value


def has_cuda() -> bool:
    """True when cupy is installed and at least one GPU is visible."""
    return cuda_device_count() > 0


def nvml_groups(n_workers: int) -> list[list[int]] | None:
    """Groups of GPUs that share a NUMA node, from NVML; None when NVML is absent or flat.

    The two-phase reduction sums partials inside a group first (paper Fig. "parallel
    reduction" (b)).
    """
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        count = min(n_workers, pynvml.nvmlDeviceGetCount())
        by_node: dict[int, list[int]] = {}
        for i in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            try:
                node = int(pynvml.nvmlDeviceGetNumaNodeId(handle))
            except Exception:
                node = 0
            by_node.setdefault(node, []).append(i)
    finally:
        pynvml.nvmlShutdown()
    groups = list(by_node.values())
    return groups if len(groups) > 1 and count == n_workers else None


def gpu_total_memory() -> int:
    """Bytes of memory of the current CUDA device (run inside a GPU worker), as NVML counts
    them: the figure a plan made without a CUDA context reads (CUDA's own total leaves out
    the driver's reserve, about 0.5 GB on an H100)."""
    import cupy

    try:
        return gpu_memories()[cupy.cuda.Device().id]
    except Exception:  # NVML unavailable or the device not found by it: CUDA's own count
        return int(cupy.cuda.runtime.memGetInfo()[1])
