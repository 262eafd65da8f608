"""Device storages copied to host memory for a checkpoint, through a reused page-locked buffer.

A checkpoint needs every CUDA storage's bytes in host memory (to hash and write them, or to hold
them while a periodic checkpoint is written behind the loop).  ``storage.cpu()`` copies into
pageable memory, which the driver stages through its own small pinned buffers one piece at a
time; allocating a page-locked destination per storage instead costs ``cudaHostAlloc`` (pinning
every page) on each checkpoint, and keeping such buffers would hold the whole model's size of
locked RAM for the life of the job.  So the copy goes through one pair of reused page-locked
chunks (`CHUNK_BYTES` each): the device fills one chunk while the other is copied out into the
ordinary host buffer that the checkpoint keeps.  Locked memory held: two chunks per process,
allocated at the first checkpoint.  bench/gpu_copy.py measures the ways side by side.
"""
from __future__ import annotations

import pickle
import threading
from typing import Any, Optional

import numpy as np
import torch

__all__ = ["CHUNK_BYTES", "HostCopy", "is_host_copy", "staging_chunks", "to_host"]

#: bytes per staging chunk; two are kept per process
CHUNK_BYTES = 64 << 20

_lock = threading.Lock()  # the periodic writer and a preemption may copy at once
_staging: Optional[tuple[torch.Tensor, torch.Tensor]] = None
_events: dict[int, tuple["torch.cuda.Event", "torch.cuda.Event"]] = {}  # device index -> the chunks' events


class HostCopy(np.ndarray):
    """The array `to_host` returns: bytes copied for one checkpoint, which nothing else refers to
    or changes. A snapshot may keep it as it is rather than copy it again (`is_host_copy`); an
    array of the program's own, which may change after the safe point, is never one."""


def is_host_copy(data: Any) -> bool:
    """Whether ``data`` (a memoryview or a ``PickleBuffer``, as a pickler writes it) is a view of a
    `HostCopy`."""
    obj = data.raw() if isinstance(data, pickle.PickleBuffer) else data
    while isinstance(obj, memoryview):
        obj = obj.obj
    return isinstance(obj, HostCopy)


def staging_chunks() -> tuple[torch.Tensor, torch.Tensor]:
    """The process's two page-locked chunks, allocated on first use."""
    global _staging
    if _staging is None:
        _staging = (torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True),
                    torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True))
    return _staging


def to_host(storage: torch.UntypedStorage, chunk_bytes: int = CHUNK_BYTES) -> np.ndarray:
    """A fresh host array (uint8) holding ``storage``'s bytes; ``storage`` may live on any device.

    A CUDA storage is copied on the current stream, after the work queued on it, chunk by chunk
    through the page-locked pair; a CPU storage in one copy.
    """
    n = storage.nbytes()
    out = np.empty(n, dtype=np.uint8).view(HostCopy)
    if n == 0:
        return out
    src = torch.empty(0, dtype=torch.uint8, device=storage.device)
    src.set_(storage, 0, (n,), (1,))
    dst = torch.from_numpy(out)
    if src.device.type != "cuda":
        dst.copy_(src)
        return out
    with _lock:
        return _through_pinned(src, dst, out, min(chunk_bytes, CHUNK_BYTES))


def _through_pinned(src: torch.Tensor, dst: torch.Tensor, out: np.ndarray, chunk: int) -> np.ndarray:
    """Double-buffered: chunk i+1 comes off the device while chunk i is copied out on the host."""
    staging = staging_chunks()
    device = src.device.index if src.device.index is not None else torch.cuda.current_device()
    events = _events.get(device)
    if events is None:
        with torch.cuda.device(device):  # an event belongs to the device it was made on
            events = _events[device] = (torch.cuda.Event(), torch.cuda.Event())
    stream = torch.cuda.current_stream(src.device)
    n = src.numel()
    starts = list(range(0, n, chunk))

    def launch(i: int) -> None:
        lo = starts[i]
        hi = min(lo + chunk, n)
        with torch.cuda.stream(stream):
            staging[i % 2][: hi - lo].copy_(src[lo:hi], non_blocking=True)
            events[i % 2].record(stream)

    launch(0)
    for i, lo in enumerate(starts):
        hi = min(lo + chunk, n)
        events[i % 2].synchronize()
        if i + 1 < len(starts):
            launch(i + 1)  # the other chunk is free: it was copied out in the previous round
        dst[lo:hi].copy_(staging[i % 2][: hi - lo])
    return out
