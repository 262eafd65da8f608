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

import pickle
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from ..checkpoint.errors import CheckpointError
from ..checkpoint.store import RankFile, lower_this_thread


def is_host_copy(data: Any) -> bool:
    """`host_copy.is_host_copy`, without importing torch for a job that has none (no device
    storage was copied to the host unless that module is loaded)."""
    host_copy = sys.modules.get("backend.proxy.checkpoint.host_copy")
    return host_copy is not None and host_copy.is_host_copy(data)


def _kept(data: Any) -> Union[bytes, memoryview]:
    """What a snapshot holds of ``data`` until it is written: a copy, which lets the program change
    its tensors right after the safe point; but a device storage's bytes, already copied to the
    host for this checkpoint alone, as they are (a second copy of a GPU's state would double
    the snapshot's time and memory)."""
    if is_host_copy(data):
        return data.raw() if isinstance(data, pickle.PickleBuffer) else data
    return bytes(data)


class SnapshotBlobs:
    """The blobs a snapshot's pickle refers to, written with the rank file behind the loop: a
    one-rank job's frozen parameters (`dedup.frozen_parameter`), every large storage of a rank of
    several (written once for all ranks, as in line).

    At the safe point each is hashed where it lies; one the newest committed checkpoint has is only
    named (no copy: `write_to` links it), any other is copied, like the inline bytes (a device
    storage's host copy is kept as it is: `is_host_copy`).
    """

    def __init__(self, reuse_from: Sequence[Path]) -> None:
        self.reuse_from = tuple(reuse_from)
        #: digest -> (bytes, the copy to write, or None: link it)
        self.pending: dict[str, tuple[int, Optional[Union[bytes, memoryview]]]] = {}
        self.copied_bytes = 0
        self.linked_bytes = 0

    def put(self, digest: str, data: memoryview) -> int:
        from ..checkpoint.dedup import reusable

        if digest not in self.pending:
            n = len(data)
            if reusable(self.reuse_from, digest, n) is not None:
                self.pending[digest] = (n, None)
            else:
                self.pending[digest] = (n, _kept(data))
                self.copied_bytes += n
        return 0

    def write_to(self, f: RankFile) -> int:
        """Put every blob in ``f``'s blob folder (before the rank file: a rank file never points
        at a missing blob); the bytes written."""
        if not self.pending:  # nothing to import torch for (this runs in the writer's thread)
            return 0
        from ..checkpoint.dedup import BLOB_WRITERS, BlobStore

        store = BlobStore(f.blob_dir, self.reuse_from, writers=BLOB_WRITERS)
        written = 0
        claimed: dict[str, memoryview] = {}
        try:
            for digest, (n, data) in self.pending.items():
                if data is None:
                    if not store.path(digest).exists() and not store.link(digest, n):
                        raise CheckpointError(f"blob {digest} of the checkpoint before this one is gone (removed "
                                              f"by hand?); the next checkpoint writes it in full")
                    self.linked_bytes += n
                else:
                    view = memoryview(data)
                    got = store.put(digest, view)
                    if got is None:
                        claimed[digest] = view
                    else:
                        written += got
                f.blobs[digest] = n
        finally:
            store.wait()
        for digest, view in claimed.items():
            written += store.settle(digest, lambda v=view: v)
        return written


class Snapshot:
    """A checkpoint's bytes held in memory: what `state.save_graph` wrote, in the pieces it wrote,
    and the blobs it refers to (`SnapshotBlobs`; ``reuse_from``: blob folders to link from)."""

    def __init__(self, reuse_from: Sequence[Path] = ()) -> None:
        self.parts: list[Union[bytes, memoryview]] = []
        self.bytes = 0
        self.blobs = SnapshotBlobs(reuse_from)

    def write(self, data: Any) -> int:
        piece = _kept(data)
        self.parts.append(piece)
        self.bytes += len(piece)
        return len(piece)

    def write_to(self, f: RankFile) -> None:
        self.blobs.write_to(f)
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
