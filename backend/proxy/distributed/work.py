"""How the proxy's process group runs collectives: one ordered worker thread, safe futures.

Collectives run one at a time, in issue order, on one worker thread per group.  Multi-phase
algorithms must issue their inner collectives in the same order on every rank, and completion
callbacks of different collectives run in arbitrary order, so a single ordered queue is the
simple way to keep every rank's transport sequence identical.
"""
from __future__ import annotations

import json
import os
import queue
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.futures import Future

from backend.contract import EXIT_COLLECTIVE_FAILED


@dataclass
class QueuedCollective:
    """One queued collective: ``run(bits_in) -> (future value, bits_out)`` on the worker thread."""

    run: Callable[[int], tuple[Any, int]]  # flag bits in -> (future value, flag bits out)
    work: "FutureWork"
    outputs: list  # the future's value if the collective fails (never None: see FutureWork)
    flagged: bool
    bits: int = 0
    fence: Any = None


def _fatal(err: BaseException) -> None:
    """End the rank: a collective whose future C++ already holds cannot fail softly."""
    print(f"[proxy] collective_failed {json.dumps({'error': f'{type(err).__name__}: {err}'})}", file=sys.stderr,
          flush=True)
    sys.stdout.flush()
    os._exit(EXIT_COLLECTIVE_FAILED)


class FutureWork(dist.Work):
    """A ``Work`` backed by our future, which only ever completes with the output tensors.

    Two torch pitfalls meet here.  ``_create_work_from_future``'s ``wait()`` returns True even
    when its future holds an exception, so a failed ``dist.all_reduce(t)`` would pass silently;
    and a future that DDP's reducer holds (it calls ``get_future()``) must not complete with an
    exception or None: the reducer's callbacks crash the process (SIGSEGV, seen with a peer
    killed mid-step).  So errors are kept beside the future: ``wait()`` raises them, and a rank
    whose failed collective's future was handed to C++ leaves at once with exit code
    `EXIT_COLLECTIVE_FAILED`, like a crash, so the job restarts from its last consistent
    checkpoint instead of stepping with unreduced gradients.
    """

    def __init__(self, fut: Future) -> None:
        super().__init__()
        self._fut = fut
        self._lock = threading.Lock()
        self._exposed = False
        self.error: Optional[BaseException] = None

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        self._fut.wait()
        if self.error is not None:
            raise self.error
        return True

    def get_future(self) -> Future:
        with self._lock:
            self._exposed = True
            err = self.error
        if err is not None:
            _fatal(err)
        return self._fut

    def _complete(self, value: Any, err: Optional[BaseException]) -> None:
        if err is not None:
            with self._lock:
                self.error = err
                exposed = self._exposed
            if exposed:
                _fatal(err)
        self._fut.set_result(value)

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        return self._fut.done() and self.error is None

    def exception(self) -> Any:
        return self.error

    def result(self) -> Any:
        self.wait()
        return self._fut.value()

    def synchronize(self) -> None:
        self.wait()


class CudaFence:  # CUDA only; not yet run on a GPU
    """Orders the worker's CUDA work after what the issuing thread had queued on its stream."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self._events = []
        for d in devices:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(d))
            self._events.append((d, ev))

    def wait(self) -> None:
        for d, ev in self._events:
            torch.cuda.current_stream(d).wait_event(ev)


class CollectiveThread:
    """Runs a group's collectives one at a time, in issue order, and completes their futures."""

    def __init__(self, name: str, on_flag: Optional[Callable[[int], None]]) -> None:
        self._queue: "queue.SimpleQueue[Optional[QueuedCollective]]" = queue.SimpleQueue()
        self._on_flag = on_flag
        self._cond = threading.Condition()
        self._submitted = 0
        self._done = 0
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: QueuedCollective) -> None:
        with self._cond:
            self._submitted += 1
        self._queue.put(job)

    def drain(self) -> None:
        with self._cond:
            target = self._submitted
            while self._done < target:
                self._cond.wait()

    def stop(self) -> None:
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            value: Any = None
            bits = 0
            err: Optional[BaseException] = self.error
            if err is None:
                try:
                    if job.fence is not None:
                        job.fence.wait()
                    value, bits = job.run(job.bits)
                except BaseException as e:  # surfaces through the future, on the caller's wait()
                    err = e
                    self.error = RuntimeError(f"an earlier collective of this group failed: {e!r}")
            job.work._complete(value if err is None else job.outputs, err)
            if job.flagged and self._on_flag is not None:
                # after the future: a confirmation (cut.py) may wait for the rank's next move,
                # which can be a wait on this very collective
                self._on_flag(bits if err is None else 0)
            with self._cond:
                self._done += 1
                self._cond.notify_all()
