"""What a job looks like to the notebook, rebuilt from its event log.

Kept free of widgets and threads so that the same model drives the ipywidget, the plain-text
fallback and the tests: feed it events (in any batch size, duplicates ignored), read its fields.
Event texts come from ``singularity_sdk.render.describe`` so the widget and the CLI say the same.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from singularity_sdk.metrics import Series
from singularity_sdk.protocol import Event, EventType, JobInfo, JobState
from singularity_sdk.render import describe

#: Events that only update the progress line, not the timeline.
QUIET = {EventType.LOG, EventType.PROGRESS, EventType.TELEMETRY}
TERMINAL = {EventType.SUCCEEDED, EventType.FAILED, EventType.CANCELLED}

#: The state each event moves a job into (None: the event does not change the state).
STATE_AFTER: dict[EventType, Optional[JobState]] = {
    EventType.SUBMITTED: JobState.QUEUED,
    EventType.SCHEDULED: JobState.RUNNING,
    EventType.STARTED: JobState.RUNNING,
    EventType.RESUMED: JobState.RUNNING,
    EventType.PREEMPTING: JobState.PREEMPTING,
    EventType.PREEMPTED: JobState.PREEMPTED,
    EventType.MIGRATING: JobState.MIGRATING,
    EventType.MIGRATED: JobState.RUNNING,
    EventType.RESIZING: JobState.RESIZING,
    EventType.RESIZED: JobState.RUNNING,
    EventType.RETRYING: JobState.QUEUED,
    EventType.SUCCEEDED: JobState.SUCCEEDED,
    EventType.FAILED: JobState.FAILED,
    EventType.CANCELLED: JobState.CANCELLED,
}


@dataclass(frozen=True)
class TimelineEntry:
    seq: int
    time: float
    type: EventType
    text: str

    @property
    def clock(self) -> str:
        return time.strftime("%H:%M:%S", time.localtime(self.time)) + f".{int(self.time * 1000) % 1000:03d}"


class JobView:
    """State, placement, progress, timeline and recent log lines of one job."""

    def __init__(self, info: JobInfo, max_timeline: int = 300, max_log_lines: int = 400, printed_metrics: bool = True):
        self.id = info.id
        self.name = info.name
        self.sla = info.sla.value
        self.gpus = info.gpus
        self.ranks = info.ranks
        self.state = info.state
        self.placement: list[dict[str, Any]] = [p.model_dump() for p in info.placement]
        self.attempt = info.attempt
        self.started_at = info.started_at
        self.ended_at = info.ended_at
        self.error = info.error
        self.last_seq = 0
        self._info_seq = info.last_seq
        self.step: Optional[int] = None
        self.rate: Optional[float] = None
        self._last_progress: Optional[tuple[float, int]] = None
        self.cancel_requested = False
        self.splicing: Optional[float] = None
        self.checkpoint: Optional[dict[str, Any]] = None
        #: the job's ``interruptible`` report (whether and where it has safe points)
        self.interruptible: Optional[dict[str, Any]] = None
        #: warnings about what could make a resume inexact (``exactness`` event)
        self.exactness_warnings: list[str] = []
        self.timeline: deque[TimelineEntry] = deque(maxlen=max_timeline)
        self.logs: deque[str] = deque(maxlen=max_log_lines)
        #: (seq, rank) of each line in ``logs``: a ``superseded`` event names lines by them
        self._log_keys: deque[tuple[int, int]] = deque(maxlen=max_log_lines)
        self.log_lines = 0
        #: the training curve (rank 0): ``singularity_sdk.log`` reports and printed metrics
        self.metrics = Series(rank=0, printed=printed_metrics)

    # ------------------------------------------------------------------ input
    def apply(self, events: Iterable[Event]) -> bool:
        """Fold events in; returns whether anything changed."""
        events = list(events)
        changed = self.metrics.apply(events)
        for ev in events:
            if ev.seq <= self.last_seq:
                continue
            self.last_seq = ev.seq
            self._apply_one(ev)
            changed = True
        return changed

    def update_info(self, info: JobInfo) -> bool:
        """Take a JobInfo from a REST answer, unless the events seen are newer than it.

        (A resume is answered with state ``queued`` but emits no event of its own.)"""
        if info.last_seq < self.last_seq:
            return False
        self.state = info.state
        self.placement = [p.model_dump() for p in info.placement]
        self.attempt = info.attempt
        self.error = info.error
        self.ended_at = info.ended_at
        return True

    def _apply_one(self, ev: Event) -> None:
        d, t = ev.data, ev.type
        if t == EventType.LOG:
            prefix = f"[rank {d.get('rank', 0)}] " if self.ranks > 1 else ""
            lines = ev.lines
            self.logs += [prefix + line.rstrip("\n") for line in lines]
            self._log_keys += [(ev.seq, int(d.get("rank", 0)))] * len(lines)
            self.log_lines += len(lines)
            return
        if t == EventType.SUPERSEDED:
            self._drop_superseded(d)
        if t == EventType.PROGRESS:
            self._progress(ev)
            return
        if t == EventType.TELEMETRY:
            return
        new_state = STATE_AFTER.get(t)
        if t == EventType.CHECKPOINT_FAILED and self.state in (JobState.PREEMPTING, JobState.MIGRATING,
                                                               JobState.RESIZING):
            new_state = JobState.RUNNING  # the move was refused or timed out; the job runs on
        if new_state is not None:
            self.state = new_state
        if t == EventType.SUBMITTED:
            self.gpus = int(d.get("gpus", self.gpus))
            self.ranks = int(d.get("ranks", self.ranks))
        elif t in (EventType.SCHEDULED, EventType.RESUMED, EventType.MIGRATED, EventType.RESIZED):
            if d.get("placement"):
                self.placement = list(d["placement"])
            if d.get("attempt") is not None:
                self.attempt = int(d["attempt"])
            if t == EventType.RESIZED and d.get("splicing") is not None:
                self.splicing = float(d["splicing"])
        elif t == EventType.STARTED and self.started_at is None:
            self.started_at = ev.time
        elif t in (EventType.PREEMPTED, EventType.RETRYING):
            self.placement = []
        elif t == EventType.CHECKPOINTED:
            self.checkpoint = dict(d, time=ev.time)
        elif t == EventType.CANCEL_REQUESTED:
            self.cancel_requested = True
        elif t == EventType.INTERRUPTIBLE:
            self.interruptible = dict(d)
        elif t == EventType.EXACTNESS:
            self.exactness_warnings = list(d.get("warnings") or [])
        elif t == EventType.FAILED:
            self.error = d.get("error") or self.error
        if t in (EventType.CHECKPOINTED, EventType.PREEMPTED, EventType.RESUMED) and d.get("step") is not None:
            self.step = int(d["step"])  # where the job stands (a resume continues from the checkpoint's step)
        if t in TERMINAL:
            self.ended_at = ev.time
            self.placement = []
            self.rate = None
        self.timeline.append(TimelineEntry(ev.seq, ev.time, t, describe(ev)))

    def _drop_superseded(self, d: dict[str, Any]) -> None:
        """Forget the lines a dead attempt printed that the re-run steps print again."""
        lo, hi, ranks = d.get("after_seq", 0), d.get("before_seq", 0), d.get("ranks")
        kept = [(key, text) for key, text in zip(self._log_keys, self.logs)
                if not (lo < key[0] < hi and (ranks is None or key[1] in ranks))]
        self.log_lines -= len(self.logs) - len(kept)
        self.logs = deque((text for _k, text in kept), maxlen=self.logs.maxlen)
        self._log_keys = deque((k for k, _t in kept), maxlen=self._log_keys.maxlen)

    def _progress(self, ev: Event) -> None:
        step = ev.data.get("step")
        if step is None:
            return
        step = int(step)
        if self._last_progress is not None:
            t0, s0 = self._last_progress
            if ev.time > t0 and step > s0:
                self.rate = (step - s0) / (ev.time - t0)
        self._last_progress = (ev.time, step)
        self.step = step

    # ------------------------------------------------------------------ derived text
    @property
    def finished(self) -> bool:
        return self.state.is_terminal

    def elapsed(self, now: Optional[float] = None) -> Optional[float]:
        if self.started_at is None:
            return None
        end = self.ended_at if self.ended_at is not None else (now or time.time())
        return max(0.0, end - self.started_at)

    def placement_text(self) -> str:
        if not self.placement:
            return "not placed" if not self.finished else "-"
        where = ", ".join(f"{p['node']} {list(p['devices'])}" for p in self.placement)
        devices = sum(len(p["devices"]) for p in self.placement)
        splicing = self.ranks / devices if devices and self.ranks > devices else 1  # S = W / P, now
        share = f", splicing x{splicing:g}" if splicing != 1 else ""
        return f"{where} - {self.ranks} rank(s) on {devices} device(s){share}"

    def progress_text(self, now: Optional[float] = None) -> str:
        parts = []
        if self.step is not None:
            parts.append(f"step {self.step}")
        if self.rate:
            parts.append(f"{self.rate:.1f} it/s")
        el = self.elapsed(now)
        if el is not None:
            parts.append(f"elapsed {_clock(el)}")
        if self.log_lines:
            parts.append(f"{self.log_lines} log line(s)")
        if self.checkpoint:
            parts.append(f"last checkpoint at step {self.checkpoint.get('step')}")
        return " - ".join(parts) if parts else "waiting to start"

    def interruptible_text(self) -> str:
        """What a user should know before the first preemption ("" when nothing was reported)."""
        parts = []
        if self.interruptible is not None:
            parts.append(str(self.interruptible.get("message", "")))
        parts += [f"exactness: {w}" for w in self.exactness_warnings]
        return "; ".join(p for p in parts if p)

    def summary(self) -> str:
        from .chart import sparkline

        extra = [x for x in (sparkline(self.metrics), self.interruptible_text()) if x]
        return (f"{self.name} ({self.id}): {self.state.value}; {self.placement_text()}; {self.progress_text()}"
                + "".join(f"; {x}" for x in extra))


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
