"""Exactly-once logs: a job's log reads as one uninterrupted run, even after a crash.

After a worker or its node dies, the next attempt restores the newest checkpoint and runs the
steps after it again, printing their lines again. The lines the dead attempt printed after that
checkpoint are therefore *superseded*: a ``superseded`` event names them (ranks, and the event
sequence numbers they lie between), ``logs`` leaves them out, and followers that already showed
them know which to drop. A job that restarts from the beginning (it had no checkpoint)
supersedes every line of its earlier attempts.

Why this is exact: when a rank takes a checkpoint's state it writes an output mark on its
stdout and stderr and sends the mark's number with ``checkpoint_started``; its agent passes on
the lines before the mark, then that event, then the lines after it
(backend/worker/output_marks.py), so in the event log a rank's ``checkpoint_started`` lies
exactly between the lines printed before and after that checkpoint, whichever pipe the agent
happened to read first. Every rank of a data-parallel job reports its own
``checkpoint_started`` and ``resumed`` (only rank 0 reports commits), so each rank supersedes its
own lines.
"""
from __future__ import annotations

import json
import sqlite3
from typing import Any, Optional

from singularity_sdk.payloads import Resumed
from singularity_sdk.protocol import EventType, log_lines


def _scheduled_seq(db: sqlite3.Connection, job_id: str, attempt: int) -> Optional[int]:
    """Where ``attempt`` was placed: every event before it comes from an earlier attempt."""
    rows = db.execute("SELECT seq, data_json FROM events WHERE job_id=? AND type=? ORDER BY seq DESC",
                            (job_id, EventType.SCHEDULED.value)).fetchall()
    return next((seq for seq, data in rows if json.loads(data).get("attempt") == attempt), None)


def _count(db: sqlite3.Connection, job_id: str, ranks: Optional[list[int]], after: int, before: int) -> int:
    rows = db.execute("SELECT data_json FROM events WHERE job_id=? AND type='log' AND seq>? AND seq<?",
                            (job_id, after, before)).fetchall()
    datas = [json.loads(d) for (d,) in rows]
    return sum(len(log_lines(d.get("line", ""))) for d in datas if ranks is None or int(d.get("rank", 0)) in ranks)


def after_restore(db: sqlite3.Connection, job_id: str, attempt: int, resumed: Resumed) -> Optional[dict[str, Any]]:
    """What the rank that just resumed supersedes: its lines after the checkpoint it restored
    (found by path, else by step) up to this attempt's placement; None when nothing is."""
    rank, path, step = resumed.rank, resumed.checkpoint, resumed.step
    label = resumed.checkpoint_step if resumed.checkpoint_step is not None else step
    before = _scheduled_seq(db, job_id, attempt)
    if before is None:
        return None
    rows = db.execute("SELECT seq, data_json FROM events WHERE job_id=? AND type=? AND seq<? ORDER BY seq DESC",
                            (job_id, EventType.CHECKPOINTED.value, before)).fetchall()
    mine = [(seq, json.loads(d)) for seq, d in rows]
    mine = [(seq, d) for seq, d in mine if d.get("rank", 0) == rank]
    found = next(((seq, d) for seq, d in mine if path and d.get("path") == path), None) \
        or next(((seq, d) for seq, d in mine if label is not None and d.get("step") == label), None)
    if found is not None:
        match = _started(db, job_id, rank, found[1].get("step"), found[0]) or found[0]
    elif label is not None and (started := _started(db, job_id, rank, label, before)) is not None:
        # The checkpoint was committed but its report never came (the node died in between):
        # the rank took the state it restored where it reported starting that checkpoint.
        match = started
    else:
        return None
    lines = _count(db, job_id, [rank], match, before)
    if not lines:
        return None
    return {"attempt": attempt, "ranks": [rank], "after_seq": match, "before_seq": before, "lines": lines}


def _started(db: sqlite3.Connection, job_id: str, rank: int, step: Any, before: int) -> Optional[int]:
    """The ``checkpoint_started`` of the checkpoint reported at ``before``: the state was taken
    there (a checkpoint written in the background is reported later, after more output)."""
    rows = db.execute("SELECT seq, data_json FROM events WHERE job_id=? AND type=? AND seq<? ORDER BY seq DESC",
                            (job_id, EventType.CHECKPOINT_STARTED.value, before)).fetchall()
    for seq, d in rows:
        data = json.loads(d)
        if data.get("rank", 0) == rank and data.get("step") == step:
            return seq
    return None


def before_fresh_start(db: sqlite3.Connection, job_id: str, attempt: int) -> Optional[dict[str, Any]]:
    """An attempt that starts from the beginning supersedes every earlier line (once)."""
    before = _scheduled_seq(db, job_id, attempt)
    if before is None or attempt <= 1:
        return None
    done = db.execute("SELECT data_json FROM events WHERE job_id=? AND type=?",
                            (job_id, EventType.SUPERSEDED.value)).fetchall()
    if any(json.loads(d).get("attempt") == attempt for (d,) in done):
        return None
    lines = _count(db, job_id, None, 0, before)
    if not lines:
        return None
    return {"attempt": attempt, "ranks": None, "after_seq": 0, "before_seq": before, "lines": lines}


def visible(rows: list[tuple[int, str, dict[str, Any]]]) -> list[tuple[int, str, str]]:
    """(rank, stream, line) of the log events in ``rows`` ((seq, type, data), in order) that no
    ``superseded`` event among them covers."""
    spans = [(d.get("ranks"), d["after_seq"], d["before_seq"]) for _s, t, d in rows if t == EventType.SUPERSEDED.value]
    out = []
    for seq, t, d in rows:
        if t != EventType.LOG.value:
            continue
        rank = int(d.get("rank", 0))
        if any(lo < seq < hi and (ranks is None or rank in ranks) for ranks, lo, hi in spans):
            continue
        stream = d.get("stream", "stdout")
        out += [(rank, stream, line) for line in log_lines(d.get("line", ""))]
    return out
