"""Reading a rank file's large storages with several threads at once.

A restore puts every byte of the checkpoint into fresh process memory, and the kernel faults in
(and zeroes) each page as the copy first touches it. One thread does that at 1-2 GB/s on a small
VM, no faster than a cold read of its disk, so for a 1 GB state the copy into memory, not the
disk, set the restore's time. The unpickler asks for each inline storage with one
``readinto`` of its whole size; `ParallelReads` splits such a read into pieces read by a few
threads with ``os.preadv`` (which releases the GIL, and page faults of one process proceed in
parallel), then moves the file position past them, so the unpickler sees an ordinary file.
A warm 1 GB rank file loads in 0.48-0.62 s instead of 0.70-1.59 s (docs/benchmarks.md).
"""
from __future__ import annotations

import concurrent.futures
import os
from typing import Any, BinaryIO, Optional

#: reads smaller than this go to the file as they are (a thread hand-off costs ~50 us)
PARALLEL_MIN = 8 << 20
#: no piece is smaller than this
PIECE_MIN = 4 << 20
#: at most this many threads read at once (4 did no better than 2 on 2 cores)
MAX_THREADS = 4


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``offset``; fewer bytes only at the end of the file."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


class ParallelReads:
    """A binary file whose large ``readinto`` calls are split across threads (see the module).

    Use as a context manager: the threads exist only while one file is read, so none is left
    behind in a worker that later forks (DataLoader workers)."""

    def __init__(self, f: BinaryIO, threads: Optional[int] = None) -> None:
        self._f = f
        self._threads = min(MAX_THREADS, threads or os.cpu_count() or 1)
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def __enter__(self) -> "ParallelReads":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def read(self, n: int = -1) -> bytes:
        return self._f.read(n)

    def readline(self, limit: int = -1) -> bytes:
        return self._f.readline(limit)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        pieces = min(self._threads, len(view) // PIECE_MIN)
        if len(view) < PARALLEL_MIN or pieces < 2:
            return self._f.readinto(view)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self._threads - 1, thread_name_prefix="sg-restore-read")
        start = self._f.tell()  # counts what the file object has buffered but not handed out
        fd = self._f.fileno()
        bounds = [len(view) * i // pieces for i in range(pieces + 1)]
        spans = list(zip(bounds, bounds[1:]))
        # the pool reads the other pieces while this thread reads the first (so at least two
        # threads read, however the pool hands out its work)
        futures = [self._pool.submit(_pread_into, fd, view[a:b], start + a) for a, b in spans[1:]]
        first = _pread_into(fd, view[:bounds[1]], start)
        done = 0
        for (a, b), got in zip(spans, [first, *(f.result() for f in futures)]):
            if done == a:  # only bytes contiguous from the start count (a short piece is the file's end)
                done = a + got
        self._f.seek(start + done)
        return done
