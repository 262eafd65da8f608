"""The Controller: how the worker (another thread) asks a running program for checkpoints.

The program only ever reads ``controller.flag`` on its hot path.  Everything that needs the slow
path (a checkpoint request, a step-armed stop, a periodic checkpoint coming due, a progress event
once a second, a trace) raises the flag; the next safe point then calls `poll` under the lock.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Optional

from backend.contract import ENV_WRITE_IN_LINE
from . import background, interruptible
from .checkpoint_request import CheckpointRequest, Then, merge
from .ports import RuntimeView
from ..checkpoint.store import CheckpointStore

log = logging.getLogger(__name__)
PROGRESS_INTERVAL_S = 1.0


class Controller:
    """Thread-safe checkpoint control for one rank of a running `ResumableProgram`."""

    def __init__(self, store: CheckpointStore, rank: int = 0, world_size: int = 1,
                 checkpoint_every: Optional[float] = None,
                 on_event: Callable[[str, dict], None] = lambda type, data: None) -> None:
        if checkpoint_every is not None and checkpoint_every <= 0:
            raise ValueError("checkpoint_every must be positive seconds")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.checkpoint_every = checkpoint_every
        self.on_event = on_event
        #: read by every safe point; True means "take the slow path at the next one"
        self.flag = False
        #: a checkpoint the job runs on after is written behind the loop (background.py)
        self.write_behind = os.environ.get(ENV_WRITE_IN_LINE) != "1"
        self.writer = background.Writer()
        self._lock = threading.Lock()
        self._pending: Optional[CheckpointRequest] = None
        self._deferred_why: Optional[str] = None  # why the last safe point took no checkpoint (`defer`)
        self._at_step: Optional[tuple[int, str]] = None
        self._progress_due = False
        self._periodic_due = False
        self._next_periodic = 0.0
        self._periodic_due_at = 0.0
        self.tracer: Optional[Callable[[int, dict], None]] = None
        self._runtime: Optional[RuntimeView] = None
        #: the thread that runs the program (sampled to say where it is when a request times out)
        self._thread_id: Optional[int] = None
        #: the deterministic settings last reported in an ``exactness`` event (None: not yet)
        self._exactness_reported: Optional[dict] = None
        #: step of the last safe point passed by the most recent run
        self.last_step = 0
        #: after a restore completed: {"step", "seconds" (load to resumed), "rebuilt": [names]}
        self.last_restore: Optional[dict[str, Any]] = None
        self._ticker: Optional[threading.Thread] = None
        self._stop_ticker = threading.Event()

    # ------------------------------------------------------------------ public
    def request_checkpoint(self, then: Then = "continue", reason: str = "",
                           timeout_s: Optional[float] = None) -> None:
        """Checkpoint at the next safe point; ``then='stop'`` makes `run` raise `Preempted` after it.

        With ``timeout_s``, a request no safe point has taken by then is dropped and answered
        with ``checkpoint_failed`` saying where the program is: a caller never waits on a job
        stuck in a long library call (the program runs on untouched)."""
        if then not in ("continue", "stop"):
            raise ValueError("then must be 'continue' or 'stop'")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError("timeout_s must be positive seconds")
        rt = self._runtime
        if rt is not None and not rt.program.has_safe_points:
            self._answer_no_safe_points()
            return
        now = time.monotonic()
        with self._lock:
            self._pending = merge(self._pending, CheckpointRequest(
                then, reason, now, deadline=None if timeout_s is None else now + timeout_s))
            self.flag = True
        if timeout_s is not None:
            self._arm_expiry(timeout_s)

    def _answer_no_safe_points(self) -> None:
        self.emit("checkpoint_failed", {
            "error": "this program has no safe points (no loops and a single statement, or a callable "
                     "whose source is unavailable): it cannot be checkpointed while it runs",
            "variables": []})

    def _arm_expiry(self, delay: float) -> None:
        timer = threading.Timer(delay, self._expire)
        timer.daemon = True
        timer.start()

    def _expire(self) -> None:
        """The bound of a pending request passed: drop it and say where the program is."""
        now = time.monotonic()
        with self._lock:
            request = self._pending
            if request is None or request.deadline is None:
                return  # a safe point took it in time
            if request.deadline > now:  # merged with an earlier-armed request: wait for the rest
                later = request.deadline - now
            else:
                self._pending, later = None, None
                self.flag = self._wants_slow_path()
        if later is not None:
            self._arm_expiry(later)
            return
        self._report_timeout(request, now)

    def _report_timeout(self, request: CheckpointRequest, now: float, stage: str = "safe point") -> None:
        """``stage``: what did not happen in time, "safe point" (none reached) or "agreement" (the
        ranks of a job reached no common safe point)."""
        from . import where

        rt = self._runtime
        spot = where.locate(self._thread_id, rt.program.filename) if rt is not None and self._thread_id else {}
        waited = now - request.requested_at
        what = "no safe point reached" if stage == "safe point" else "the ranks reached no common safe point"
        deferred, self._deferred_why = self._deferred_why, None
        if deferred:
            what = f"no safe point fit for a checkpoint reached ({deferred})"
        hint = ""
        library = str(spot.get("library") or "")
        if library.startswith("__main__.") and str(spot.get("library_at", "")).startswith("<dynamic-code>"):
            # a function that came with the job's variables: a notebook's earlier cell, pickled
            hint = (f" {library[len('__main__.'):]}() came with the job's variables (a function of an earlier "
                    f"notebook cell): its loops have no safe points; define it in the cell that runs it, or "
                    f"write its loop in that cell.")
        self.emit("checkpoint_failed", {
            "error": f"{what} within {waited:.0f} s: the job is at {where.describe(spot)}.{hint} "
                     f"Safe points are at the top of the loops the engine instruments (see the job's "
                     f"'interruptible' event); the job runs on untouched",
            "variables": [], "timeout": True, "waited_s": round(waited, 3), "where": spot,
            "bound_s": None if request.deadline is None else round(request.deadline - request.requested_at, 3),
            "then": request.then, "reason": request.reason, "stage": stage})

    def defer(self, request: CheckpointRequest, why: str, counts: bool = True) -> None:
        """``request`` reached a safe point that is no place for a checkpoint (`why`): it stays
        pending for the next one; if its bound passes first, the timeout answer says why.
        ``counts``: whether this safe point counts against its patience (autograd_graphs.py)."""
        request.deferred += counts
        with self._lock:
            self._pending = merge(request, self._pending) if self._pending is not None else request
            self._deferred_why = why
            self.flag = True

    def unusable(self, why: str) -> None:
        """A pending request passed a safe point it could not use (`frames.user_chain`: a library
        function between two frames of the program, recursion): if its bound passes, the answer
        says why, not only where the job was."""
        if self._pending is not None:
            self._deferred_why = why

    def checkpoint_at_step(self, step: int, then: Then = "stop") -> None:
        """Checkpoint at the first safe point whose step is >= ``step`` (used by the CLI and tests)."""
        with self._lock:
            self._at_step = (step, then)
            self.flag = True

    def trace_safe_points(self, callback: Optional[Callable[[int, dict], None]]) -> None:
        """Call ``callback(step, position)`` at every safe point (slow: a debugging aid)."""
        with self._lock:
            self.tracer = callback
            self.flag = self._wants_slow_path()

    # ------------------------------------------------------------------ used by the runtime
    def _wants_slow_path(self) -> bool:
        return (self._pending is not None or self._at_step is not None or self.tracer is not None
                or self._progress_due or self._periodic_due)

    def poll(self, rt: RuntimeView) -> tuple[Optional[CheckpointRequest], bool]:
        now = time.monotonic()
        expired: Optional[CheckpointRequest] = None
        with self._lock:
            request, self._pending = self._pending, None
            if request is not None and request.deadline is not None and now > request.deadline:
                expired, request = request, None  # answered already (or about to be) as timed out
            if self._at_step is not None and rt.step >= self._at_step[0]:
                request = merge(request, CheckpointRequest(self._at_step[1], f"step {self._at_step[0]}", now))
                self._at_step = None
            if self._periodic_due:
                self._periodic_due = False
                # a periodic checkpoint due while the previous one is still being written behind
                # the loop is skipped (the next comes a period later), not waited for
                if request is None and not self.writer.busy:
                    request = CheckpointRequest("continue", "periodic", self._periodic_due_at)
            progress, self._progress_due = self._progress_due, False
            self.flag = self._wants_slow_path()
        if expired is not None:
            self._report_timeout(expired, now)
        if progress and self.rank == 0:
            self._report_exactness()
        return request, progress

    def poll_progress(self) -> bool:
        """At a safe point that cannot be used (see `frames`): take only the progress tick; a
        checkpoint request stays pending (and the flag raised) for the next usable safe point."""
        with self._lock:
            progress, self._progress_due = self._progress_due, False
            self.flag = self._wants_slow_path()
        return progress

    def _report_exactness(self) -> None:
        """What an exact resume depends on: reported at the first progress tick, and again
        whenever the program changes a deterministic setting (a few attribute reads per second)."""
        from ..checkpoint import fingerprint

        now = fingerprint.settings()
        if now != self._exactness_reported:
            self._exactness_reported = now
            self.emit("exactness", fingerprint.report())

    def all_written(self, mine: bool) -> bool:
        """Whether every rank of the job wrote its part of this checkpoint (one rank: ``mine``)."""
        return mine

    def checkpoint_written(self) -> None:
        self._deferred_why = None
        if self.checkpoint_every is not None:
            with self._lock:
                self._next_periodic = time.monotonic() + self.checkpoint_every
                self._periodic_due = False

    def emit(self, type_: str, data: dict[str, Any]) -> None:
        try:
            self.on_event(type_, data)
        except Exception:  # a broken listener must not break the user's program
            log.exception("on_event(%r) raised", type_)

    def attach(self, rt: RuntimeView) -> None:
        self._runtime = rt
        self._thread_id = threading.get_ident()
        if not rt.program.has_safe_points:
            with self._lock:  # a request that came while the program was being loaded
                request, self._pending = self._pending, None
            if request is not None:
                self._answer_no_safe_points()
        now = time.monotonic()
        if self.checkpoint_every is not None:
            self._next_periodic = now + self.checkpoint_every
        self._stop_ticker.clear()
        self._ticker = threading.Thread(target=self._tick_loop, name="proxy-ticker", daemon=True)
        self._ticker.start()

    def detach(self) -> None:
        self.writer.wait()  # a checkpoint being written behind the loop commits before the run ends
        with self._lock:
            request, deferred = self._pending, self._deferred_why
        if request is not None and (deferred or request.reason != "periodic"):  # say why it ended untaken
            why = deferred or self._why_none_came()
            self.emit("checkpoint_failed", {
                "error": f"the program ended before a safe point fit for a checkpoint ({why})",
                "variables": [], "then": request.then, "reason": request.reason, "stage": "safe point"})
        self._stop_ticker.set()
        if self._ticker is not None:
            self._ticker.join(timeout=5)
        self._ticker = None
        if self._runtime is not None:
            self.last_step = self._runtime.step
        self._runtime = None

    def _why_none_came(self) -> str:
        """Where the loops that ran without a safe point are, and why (``async def``)."""
        why = ("none came: safe points are at the top of the loops the engine instruments (see the job's "
               "'interruptible' event), not in recursive calls")
        rt = self._runtime
        try:
            missed = interruptible.report(rt.program)["not_safe_points"] if rt is not None else []
        except Exception:  # the answer is a courtesy: never fail the program's end over it
            missed = []
        if missed:
            why += f"; the loops at line(s) {interruptible.describe_missed(missed)} have none"
        return why

    def _tick_loop(self) -> None:
        """Raise the flag once a second for progress and when a periodic checkpoint is due."""
        next_progress = time.monotonic() + PROGRESS_INTERVAL_S
        while True:
            now = time.monotonic()
            wake = next_progress
            if self.checkpoint_every is not None:
                wake = min(wake, self._next_periodic)
            if self._stop_ticker.wait(max(0.0, wake - now)):
                return
            now = time.monotonic()
            with self._lock:
                if now >= next_progress:
                    self._progress_due = True
                    next_progress = now + PROGRESS_INTERVAL_S
                if self.checkpoint_every is not None and now >= self._next_periodic:
                    if not self._periodic_due:
                        self._periodic_due = True
                        self._periodic_due_at = now
                    self._next_periodic = now + self.checkpoint_every
                self.flag = self._wants_slow_path()
