"""Utilisation and memory of the GPUs the cluster widget shows, where NVML can see them.

The widget asks NVML in the kernel's own process, matching devices by the UUID their agent
registered. That covers the usual notebook set-up (the Jupyter server's embedded backend runs
its node agents on this machine); a device on another machine is not visible here and is shown
without numbers. Without a GPU or without the NVML library, ``sample`` returns nothing and the
widget draws exactly as before.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable, Optional

_lock = threading.Lock()
_ready: Optional[bool] = None  # None: not tried yet


@dataclass(frozen=True)
class Load:
    util: int  # percent of the last sample period the GPU was busy
    mem_used: int  # bytes
    mem_total: int

    def text(self) -> str:
        gib = 2 ** 30
        return f"{self.util}% - {self.mem_used / gib:.1f}/{self.mem_total / gib:.0f} GiB"


def _init() -> bool:
    global _ready
    if _ready is None:
        try:
            import pynvml

            pynvml.nvmlInit()  # kept open for the kernel's life: init costs ~100 ms
            _ready = True
        except Exception:  # no library, no driver, no GPU: all mean "no numbers here"
            _ready = False
    return _ready


def sample(uuids: Iterable[Optional[str]]) -> dict[str, Load]:
    """UUID -> current load, for those of ``uuids`` this machine's NVML knows."""
    wanted = [u for u in uuids if u]
    if not wanted:
        return {}
    with _lock:
        if not _init():
            return {}
        import pynvml

        out: dict[str, Load] = {}
        for uuid in wanted:
            try:
                h = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                util = pynvml.nvmlDeviceGetUtilizationRates(h)
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            except Exception:  # not on this machine, or the device does not report it
                continue
            out[uuid] = Load(int(util.gpu), int(mem.used), int(mem.total))
        return out
