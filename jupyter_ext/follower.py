"""A background thread that follows one job's events over the server's WebSocket.

One follower per job feeds everything that shows the job: the widget (updated from this thread,
which ipywidgets allows) and, while a cell waits in the foreground, a queue the cell's main
thread drains to print the job's output (so Ctrl-C lands in the main thread, where it belongs).
Events arrive in small batches so a chatty job causes one redraw per batch, not per line.
The SDK's ``Job.follow`` reconnects after a dropped connection (server restart) from the last
event seen; the thread ends when the job ends, when ``stop()`` is called, or when the server
says the job is gone.
"""
from __future__ import annotations

import logging
import queue
import threading
from contextlib import closing
from typing import Callable, Optional

from singularity_sdk import Client, Job
from singularity_sdk.errors import APIError, ServerUnreachable
from singularity_sdk.protocol import Event

from .view import TERMINAL

log = logging.getLogger("jupyter_ext")

Sink = Callable[[list[Event]], None]


class End:
    """Put on subscriber queues when the follower stops; ``error`` says why if it was not the
    job's end (e.g. the job is unknown to the server)."""

    def __init__(self, error: Optional[str] = None):
        self.error = error


class EventFollower:
    def __init__(self, client: Client, job_id: str, since: int = 0, batch_s: float = 0.05, tick_s: float = 1.0):
        self.client = client
        self.job_id = job_id
        self.last_seq = since
        self.batch_s = batch_s
        self.tick_s = tick_s
        self.error: Optional[str] = None
        self.finished = False  # the job's terminal event was seen
        self._sinks: list[Sink] = []
        self._tickers: list[Callable[[], None]] = []
        self._done: list[Callable[[Optional[str]], None]] = []
        self._queues: list[queue.Queue] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"singularity-follow-{job_id}", daemon=True)

    # ------------------------------------------------------------------ wiring
    def add_sink(self, fn: Sink) -> None:
        """Call ``fn(batch)`` on the follower thread for every batch of new events."""
        with self._lock:
            self._sinks.append(fn)

    def add_ticker(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` about every ``tick_s`` while no events arrive (clocks, elapsed time)."""
        with self._lock:
            self._tickers.append(fn)

    def add_done(self, fn: Callable[[Optional[str]], None]) -> None:
        """Call ``fn(error)`` on the follower thread when it stops (error None: the job ended)."""
        with self._lock:
            self._done.append(fn)

    def subscribe(self) -> "queue.Queue[list[Event] | End]":
        """A queue that receives every batch, then an ``End``."""
        q: queue.Queue = queue.Queue()
        with self._lock:
            if not self._thread.is_alive() and self._thread.ident is not None:
                q.put(End(self.error))
            self._queues.append(q)
        return q

    def unsubscribe(self, q: queue.Queue) -> None:
        with self._lock:
            if q in self._queues:
                self._queues.remove(q)

    def start(self) -> "EventFollower":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop within ``tick_s`` (the thread looks between batches)."""
        self._stop.set()

    def join(self, timeout: Optional[float] = None) -> None:
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        try:
            job = self._job()
            if job is None:
                return
            with closing(job.follow(self.last_seq, tick_s=self.tick_s, batch_s=self.batch_s)) as batches:
                for batch in batches:
                    if self._stop.is_set():
                        return
                    if not batch:
                        for fn in list(self._tickers):
                            _safely(fn)
                        continue
                    self.last_seq = batch[-1].seq
                    self._deliver(batch)
                    if any(ev.type in TERMINAL for ev in batch):
                        self.finished = True
        except APIError as exc:  # the server refused the job (unknown, or not this user's)
            self.error = exc.message
        except Exception as exc:  # never die silently: the widget shows this
            log.exception("follower %s crashed", self.job_id)
            self.error = f"stopped following: {type(exc).__name__}: {exc}"
        finally:
            with self._lock:
                queues, done = list(self._queues), list(self._done)
            for q in queues:
                q.put(End(self.error))
            for fn in done:
                _safely(fn, self.error)

    def _job(self) -> Optional[Job]:
        """The job's handle; while the server is unreachable (restarting), keep asking (None:
        stopped meanwhile)."""
        backoff = 0.2
        while True:
            try:
                return self.client.get(self.job_id)
            except ServerUnreachable:
                if self._stop.wait(backoff):
                    return None
                backoff = min(backoff * 2, 5.0)

    def _deliver(self, batch: list[Event]) -> None:
        with self._lock:
            sinks, queues = list(self._sinks), list(self._queues)
        for q in queues:
            q.put(batch)
        for fn in sinks:
            _safely(fn, batch)


def _safely(fn: Callable, *args) -> None:
    try:
        fn(*args)
    except Exception:
        log.exception("a singularity display update failed")
