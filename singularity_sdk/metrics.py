"""A job's training curve, rebuilt from its event log.

Two sources feed it, both carried by events every consumer already follows:

- ``singularity_sdk.log(loss=..., step=...)`` in the job: a ``telemetry`` event with
  ``{"metrics": {...}, "step": n}`` (see ``report.py``);
- unless turned off, metrics the job *prints*, parsed from its ``log`` events by ``parse_line``.

The grammar of a printed line (docs/jupyter.md says the same):

- a pair is ``NAME=VALUE`` or ``NAME: VALUE`` (spaces allowed around ``=``/``:``, pairs separated
  by anything: ``step 3 | loss=0.25, val_acc: 0.91``);
- ``NAME`` is a Python-ish identifier, optionally with ``/`` ``.`` ``-`` inside (``train/loss``);
- ``VALUE`` is a decimal or scientific float literal (``0.25``, ``-3``, ``1e-3``, ``nan``, ``inf``);
- only *metric-like* names count: ones containing a word of ``METRIC_WORDS`` (loss, acc,
  accuracy, error, perplexity, reward, f1, auc, mse, ...). So constants and settings such as
  ``lr=1e-3``, ``batch_size=32`` or ``seed: 0`` never become curves;
- the step is the line's ``step``/``global_step``/``iter``/``iteration``/``epoch`` pair when it has
  one (in that order), else the point's index in its series (0, 1, 2...).

Exactly-once: after a node loss the next attempt re-runs the steps after its checkpoint and
prints (and logs) their values again; the server's ``superseded`` event names the events of
the dead attempt that this makes redundant, and they are dropped here as they are from logs.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from .protocol import Event, EventType

METRIC_WORDS = ("loss", "acc", "accuracy", "err", "error", "perplexity", "ppl", "reward", "return", "score",
                "f1", "auc", "mse", "mae", "rmse", "bleu", "rouge", "top1", "top5", "dice", "iou", "nll",
                "grad_norm", "metric")
STEP_KEYS = ("step", "global_step", "iter", "iteration", "epoch")
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf)"
_PAIR = re.compile(rf"(?<![\w./-])([A-Za-z_][\w./-]*)\s*[=:]\s*({_NUMBER})(?![\w.])")
_WORD = re.compile("|".join(rf"(?:^|[^a-z]){re.escape(w)}(?:$|[^a-z])" for w in METRIC_WORDS))
#: Events that get a marker on the chart, and the device count they leave.
MARKED = {EventType.CHECKPOINTED, EventType.PREEMPTED, EventType.MIGRATED, EventType.RESIZED,
          EventType.RESUMED, EventType.NODE_LOST}
PLACED = {EventType.SCHEDULED, EventType.RESUMED, EventType.MIGRATED, EventType.RESIZED}


def is_metric_name(name: str) -> bool:
    """True for loss-like names (``loss``, ``val_acc``, ``train/loss``), not ``lr`` or ``seed``."""
    return bool(_WORD.search(name.lower()))


def parse_line(line: str) -> tuple[dict[str, float], Optional[float]]:
    """The metrics a printed line reports and its step (None: the line names no step)."""
    values: dict[str, float] = {}
    steps: dict[str, float] = {}
    for name, raw in _PAIR.findall(line):
        low = name.lower()
        if low in STEP_KEYS:
            steps.setdefault(low, float(raw))
        elif is_metric_name(name):
            values[name] = float(raw)
    step = next((steps[k] for k in STEP_KEYS if k in steps), None)
    return values, step


@dataclass
class Marker:
    """An event drawn on the chart at the x (step) the curve had reached when it happened."""

    step: Optional[float]
    type: EventType
    time: float


@dataclass
class Series:
    """Points of one job, folded from its events (any batch size; duplicates ignored)."""

    rank: Optional[int] = 0  # None: every rank
    printed: bool = True  # parse metrics from printed lines
    points: list[dict[str, Any]] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    #: (step, devices) each time the job's device count changed
    devices: list[tuple[Optional[float], int]] = field(default_factory=list)
    last_seq: int = 0
    _count: dict[tuple[str, int], int] = field(default_factory=dict)

    def apply(self, events: Iterable[Event]) -> bool:
        """Fold events in; returns whether the chart changed."""
        changed = False
        for ev in events:
            if ev.seq <= self.last_seq:
                continue
            self.last_seq = ev.seq
            changed |= self._one(ev)
        return changed

    @property
    def x(self) -> Optional[float]:
        return self.points[-1]["step"] if self.points else None

    def names(self) -> list[str]:
        seen: dict[str, None] = {}
        for p in self.points:
            for k in p:
                if k not in ("step", "time", "rank", "seq", "source"):
                    seen.setdefault(k, None)
        return list(seen)

    def rows(self) -> list[dict[str, Any]]:
        """The public series: one dict per report, ``step``, ``time``, ``rank`` and the values."""
        return [{k: v for k, v in p.items() if k != "seq"} for p in self.points]

    def _one(self, ev: Event) -> bool:
        d, t = ev.data, ev.type
        if t == EventType.TELEMETRY and isinstance(d.get("metrics"), dict):
            values = {str(k): float(v) for k, v in d["metrics"].items() if _number(v)}
            return self._add(ev, int(d.get("rank", 0)), values, d.get("step"), "log")
        if t == EventType.LOG and self.printed and d.get("stream", "stdout") == "stdout":
            added = False
            for line in ev.lines:
                values, step = parse_line(line)
                if values:
                    added = self._add(ev, int(d.get("rank", 0)), values, step, "print") or added
            return added
        if t == EventType.SUPERSEDED:
            return self._supersede(d)
        if t in PLACED and d.get("placement"):
            self.devices.append((self.x, sum(len(p.get("devices") or ()) for p in d["placement"])))
        elif t in (EventType.PREEMPTED, EventType.RETRYING) or t in (EventType.SUCCEEDED, EventType.FAILED,
                                                                      EventType.CANCELLED):
            self.devices.append((self.x, 0))
        if t in MARKED and (t != EventType.CHECKPOINTED or int(d.get("rank", 0)) == 0):
            self.markers.append(Marker(self.x, t, ev.time))
            return True
        return t in PLACED or t == EventType.PREEMPTED

    def _add(self, ev: Event, rank: int, values: dict[str, float], step: Any, source: str) -> bool:
        if not values or (self.rank is not None and rank != self.rank):
            return False
        key = (source, rank)
        index = self._count.get(key, 0)
        self._count[key] = index + 1
        x = float(step) if _number(step) else float(index)
        self.points.append({"step": int(x) if x.is_integer() else x, "time": ev.time, "rank": rank,
                            "source": source, "seq": ev.seq, **values})
        return True

    def _supersede(self, d: dict[str, Any]) -> bool:
        lo, hi, ranks = d.get("after_seq", 0), d.get("before_seq", 0), d.get("ranks")
        keep = [p for p in self.points if not (lo < p["seq"] < hi and (ranks is None or p["rank"] in ranks))]
        if len(keep) == len(self.points):
            return False
        self.points = keep
        self._count = {}
        for p in keep:
            key = (p["source"], p["rank"])
            self._count[key] = self._count.get(key, 0) + 1
        return True


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not (isinstance(v, float) and math.isinf(v))


def series_of(events: Iterable[Event], *, rank: Optional[int] = 0, printed: bool = True) -> Series:
    s = Series(rank=rank, printed=printed)
    s.apply(events)
    return s


def result(events: Iterable[Event], *, rank: Optional[int], printed: bool, frame: bool) -> Any:
    """What ``job.metrics()`` returns (sync and async share it)."""
    rows = series_of(events, rank=rank, printed=printed).rows()
    return as_frame(rows) if frame else rows


def as_frame(rows: list[dict[str, Any]]) -> Any:
    """A pandas DataFrame of ``rows``; a clear error where pandas is not installed."""
    try:
        import pandas as pd
    except ImportError:
        raise ImportError("job.metrics(as_frame=True) needs pandas (pip install pandas); "
                          "without it, job.metrics() returns the same series as a list of dicts") from None
    return pd.DataFrame(rows)
