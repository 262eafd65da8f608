"""Periodic checkpoints that do not stop training: snapshot at the safe point, write behind it.

A checkpoint the job keeps running after (``then='continue'``: periodic, or an explicit
``checkpoint``) needs from the training loop only a consistent copy of its state.  At the safe
point the graph is pickled into memory (`Snapshot`: the non-tensor objects, and every tensor's
bytes copied once, which for a CUDA tensor is the device-to-host copy); the hash, the write,
the fsync and the commit then run in a thread of their own at a lower CPU priority while the
loop goes on (the pattern of CheckFreq and PyTorch's asynchronous checkpointing).  At most one
write is in flight: the next checkpoint, a preemption's included, first waits for it, so a
preemption that arrives mid-write waits only for that write (a periodic one due meanwhile is
skipped: controller.py).  The ``checkpointed`` event is sent
when the write has committed, never before; a kill -9 during it leaves the previous checkpoint.

The ranks of a data-parallel job write behind too: they agree, as for a write in line, that
every rank took its snapshot (and that their parts will meet in one folder) before any goes on;
each then writes its part in its own background thread, and the last part in commits the set.
A rank whose background write fails says so at once (``checkpoint_failed``) and leaves a
``rank-R.failed`` note in the staging folder, so rank 0, which reports the commit, stops waiting
for a set that will never be complete (`CheckpointStore.failed_parts`).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from ..checkpoint.store import RankFile, lower_this_thread

class Snapshot:
    """A checkpoint's bytes held in memory: what `state.save_graph` wrote, in the pieces it wrote."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.bytes = 0

    def write(self, data: Any) -> int:
        piece = bytes(data)  # the copy that lets the program change its tensors right after
        self.parts.append(piece)
        self.bytes += len(piece)
        return len(piece)

    def write_to(self, f: RankFile) -> None:
        for piece in self.parts:
            f.write(piece)


class Writer:
    """Runs at most one checkpoint write at a time, in a daemon thread."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None

    def wait(self) -> None:
        """Until the write in flight (if any) has committed or failed."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._thread = None

    def submit(self, job: Callable[[], None]) -> None:
        self.wait()
        self._thread = threading.Thread(target=_lowered(job), name="proxy-checkpoint-writer", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


def _lowered(job: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        lower_this_thread()
        job()
    return run
