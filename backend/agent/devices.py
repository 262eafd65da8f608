"""Find the devices a node offers: GPUs through NVML, else a number of CPU slots.

Without a GPU (or without the NVML library) the fallback is quiet: a machine with no GPU is
normal for development and CI, not an error.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Iterator, Optional

from singularity_sdk.protocol import DeviceInfo


@contextlib.contextmanager
def _nvml() -> Iterator[Any]:
    """pynvml, initialised for the block; None when NVML is unavailable (no GPU, no driver)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded: "no GPU here"
        yield None
        return
    try:
        yield pynvml
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def discover_gpus() -> list[DeviceInfo]:
    """GPUs visible through NVML, in NVML index order; empty when NVML is unavailable."""
    with _nvml() as nvml:
        if nvml is None:
            return []
        out = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            out.append(DeviceInfo(index=i, kind="cuda", name=_text(nvml.nvmlDeviceGetName(h)),
                                  uuid=_text(nvml.nvmlDeviceGetUUID(h)),
                                  memory_bytes=int(nvml.nvmlDeviceGetMemoryInfo(h).total)))
        return out


@functools.lru_cache(maxsize=1)
def gpu_minor_numbers() -> Optional[dict[str, int]]:
    """GPU uuid -> its minor number (the N of ``/dev/nvidiaN``), for the sandbox's device files;
    None when NVML cannot say (no GPU, no driver)."""
    with _nvml() as nvml:
        if nvml is None:
            return None
        try:
            return {_text(nvml.nvmlDeviceGetUUID(h)): int(nvml.nvmlDeviceGetMinorNumber(h))
                    for h in (nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount()))}
        except Exception:
            return None


def cpu_slots(count: int) -> list[DeviceInfo]:
    return [DeviceInfo(index=i, kind="cpu", name=f"cpu-slot-{i}") for i in range(count)]


def discover(devices: Optional[int] = None) -> list[DeviceInfo]:
    """GPUs if any (limited to ``devices`` when given), otherwise ``devices`` CPU slots.

    ``SINGULARITY_FORCE_CPU=1`` ignores GPUs, so a GPU machine can run the CPU-slot path.
    """
    gpus = [] if os.environ.get("SINGULARITY_FORCE_CPU") == "1" else discover_gpus()
    if gpus:
        return gpus[:devices] if devices else gpus
    return cpu_slots(devices if devices else max(1, (os.cpu_count() or 1)))


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def slot_cores(slot: int, slots: int, cores: Optional[list[int]] = None) -> list[int]:
    """The cores a CPU slot stands for: an equal share of this machine's, or one core shared
    round-robin when there are more slots than cores. A CPU "device" then bounds what its ranks
    compute, as a GPU would (ranks that share a slot take turns on the same cores)."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if slots <= len(cores):
        per = len(cores) // slots
        return cores[slot * per:(slot + 1) * per]
    return [cores[slot % len(cores)]]
