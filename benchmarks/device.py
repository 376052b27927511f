"""What the benchmarks ran on, in one line: the CPU's model and cores, and the GPUs."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one) and its core count."""
    name = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]  # fmt: skip
        name = names[0] if names else name
    return f"{name}, {os.cpu_count()} cores"


def describe(gpu: bool) -> str:
    """The CPU, and with `gpu` the number and name of the GPUs (from NVML, which opens no
    CUDA context in the benchmark's own process)."""
    text = cpu_name()
    if gpu:
        import pynvml

        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        finally:
            pynvml.nvmlShutdown()
        text += f"; {count} x {name.decode() if isinstance(name, bytes) else name}"
    return text
