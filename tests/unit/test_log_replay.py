"""Exactly-once logs (backend/server/log_replay.py): what a resumed rank supersedes."""
from __future__ import annotations

import json
import sqlite3

from backend.server import log_replay
from singularity_sdk.payloads import Resumed


def _db(events: list[tuple[str, dict]]) -> sqlite3.Connection:
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE events (job_id TEXT, seq INTEGER, type TEXT, time REAL, data_json TEXT)")
    for seq, (type, data) in enumerate(events, start=1):
        db.execute("INSERT INTO events VALUES ('j', ?, ?, 0, ?)", (seq, type, json.dumps(data)))
    return db


def _line(i: int) -> tuple[str, dict]:
    return ("log", {"rank": 0, "stream": "stdout", "line": f"step {i}\n"})


def test_lines_after_a_reported_checkpoint_are_superseded():
    db = _db([("scheduled", {"attempt": 1}), _line(0), ("checkpoint_started", {"rank": 0, "step": 1}),
              _line(1), ("checkpointed", {"rank": 0, "step": 1, "path": "/c/ckpt-1"}), _line(2),
              ("scheduled", {"attempt": 2})])
    got = log_replay.after_restore(db, "j", 2, Resumed.model_validate({"rank": 0, "step": 1, "checkpoint": "/c/ckpt-1"}))
    assert got == {"attempt": 2, "ranks": [0], "after_seq": 3, "before_seq": 7, "lines": 2}


def test_a_checkpoint_committed_but_never_reported_still_supersedes_from_its_start():
    """The node died after the checkpoint was on disk and before its ``checkpointed`` reached
    the server: the successor restores it all the same, and the dead attempt's lines printed
    after it was taken are superseded (found by its ``checkpoint_started``)."""
    db = _db([("scheduled", {"attempt": 1}), _line(0), ("checkpoint_started", {"rank": 0, "step": 1}),
              _line(1), ("checkpointed", {"rank": 0, "step": 1, "path": "/c/ckpt-1"}), _line(2),
              ("checkpoint_started", {"rank": 0, "step": 3}), _line(3), ("scheduled", {"attempt": 2})])
    got = log_replay.after_restore(db, "j", 2, Resumed.model_validate({"rank": 0, "step": 3, "checkpoint": "/c/ckpt-3"}))
    assert got == {"attempt": 2, "ranks": [0], "after_seq": 7, "before_seq": 9, "lines": 1}


def test_a_restore_of_a_checkpoint_never_begun_here_supersedes_nothing():
    db = _db([("scheduled", {"attempt": 1}), _line(0), ("scheduled", {"attempt": 2})])
    assert log_replay.after_restore(db, "j", 2, Resumed.model_validate({"rank": 0, "step": 5, "checkpoint": "/c/ckpt-5"})) is None


def test_another_rank_of_a_data_parallel_job_supersedes_its_own_lines_by_the_agreed_number():
    """Rank 1 reports no commits (rank 0 does, for the job) and its own safe-point count differs
    from the number the ranks agreed on: its ``checkpoint_started`` of that number marks where
    its superseded lines begin, and rank 0's lines are not counted."""
    def line(rank: int, i: int) -> tuple[str, dict]:
        return ("log", {"rank": rank, "stream": "stdout", "line": f"step {i}\n"})

    db = _db([("scheduled", {"attempt": 1}), line(1, 0), ("checkpoint_started", {"rank": 0, "step": 9}),
              ("checkpoint_started", {"rank": 1, "step": 9}), line(0, 1), line(1, 1),
              ("checkpointed", {"rank": 0, "step": 9, "path": "/c/ckpt-9"}), line(1, 2), line(0, 2),
              ("scheduled", {"attempt": 2})])
    resumed = Resumed.model_validate({"rank": 1, "step": 6, "checkpoint": "/c/ckpt-9", "checkpoint_step": 9})
    got = log_replay.after_restore(db, "j", 2, resumed)
    assert got == {"attempt": 2, "ranks": [1], "after_seq": 4, "before_seq": 10, "lines": 2}


def test_an_event_of_several_lines_counts_and_shows_each_line():
    burst = ("log", {"rank": 0, "stream": "stdout", "line": "step 2\nstep 3\nstep 4\n"})
    db = _db([("scheduled", {"attempt": 1}), _line(0), ("checkpoint_started", {"rank": 0, "step": 1}),
              burst, ("checkpointed", {"rank": 0, "step": 1, "path": "/c/ckpt-1"}), ("scheduled", {"attempt": 2})])
    got = log_replay.after_restore(db, "j", 2, Resumed.model_validate({"rank": 0, "step": 1, "checkpoint": "/c/ckpt-1"}))
    assert got is not None and got["lines"] == 3
    rows = [(seq, t, json.loads(d)) for seq, t, d in db.execute("SELECT seq, type, data_json FROM events ORDER BY seq")]
    assert [line for _rank, _stream, line in log_replay.visible(rows)] == ["step 0\n", "step 2\n", "step 3\n", "step 4\n"]
