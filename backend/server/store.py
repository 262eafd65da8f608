"""SQLite persistence: users, jobs, nodes and the append-only event log.

Everything the server knows lives here, so a restart (or a ``kill -9``) loses nothing: the
event log's per-job sequence numbers and each agent's acknowledged sequence number are
committed in the same transaction as the events themselves, which is what makes agent replay
idempotent.
"""
from __future__ import annotations

import json
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from singularity_sdk.protocol import (
    SLA,
    DeviceInfo,
    Event,
    EventType,
    JobInfo,
    JobState,
    NodeInfo,
    NodeState,
    Placement,
)

from . import log_replay
from .credentials import HASH_PREFIX, hash_token, new_token, same_hash

SCHEMA = """
CREATE TABLE IF NOT EXISTS users (
    name TEXT PRIMARY KEY,
    token TEXT UNIQUE NOT NULL,    -- sha256 of the token (credentials.hash_token), never the token
    role TEXT NOT NULL,            -- admin | user | join | node
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    user TEXT NOT NULL,
    name TEXT NOT NULL,
    state TEXT NOT NULL,
    sla TEXT NOT NULL,
    gpus INTEGER NOT NULL,
    ranks INTEGER NOT NULL,
    source TEXT,
    callable_b64 TEXT,
    inputs_b64 TEXT,
    outputs_json TEXT NOT NULL DEFAULT '[]',
    outputs_pickle BLOB,
    outputs_skipped_json TEXT,
    filename TEXT NOT NULL,
    env_json TEXT NOT NULL DEFAULT '{}',
    args_json TEXT NOT NULL DEFAULT '[]',  -- sys.argv[1:] of every rank
    workdir TEXT,                  -- the folder it was submitted from: its working directory
    workdir_b64 TEXT,              -- a copy of that folder, for nodes that do not see it
    checkpoint_every REAL,
    placement_json TEXT NOT NULL DEFAULT '[]',
    attempt INTEGER NOT NULL DEFAULT 0,
    retries INTEGER NOT NULL DEFAULT 0,
    exited_json TEXT NOT NULL DEFAULT '{}',
    stop_reason TEXT,              -- why its workers are being stopped (backend/server/lifecycle.py: Stop)
    stop_detail_json TEXT,         -- who asked and why (for the event that closes the stop)
    last_checkpoint_json TEXT,     -- newest complete checkpoint reported by the workers
    moved_at REAL,                 -- last preemption/migration/resize (anti-thrash)
    migration_json TEXT,           -- from, to, when of the migration in progress
    not_before REAL,               -- a retry waits out its backoff until then
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    started_at REAL,
    ended_at REAL,
    error TEXT,
    result_pickle BLOB,
    result_repr TEXT,
    result_error TEXT,
    last_seq INTEGER NOT NULL DEFAULT 0,
    held_s REAL NOT NULL DEFAULT 0,      -- seconds it held devices, over finished stretches
    attained_s REAL NOT NULL DEFAULT 0,  -- device-seconds of those stretches (attained service)
    held_since REAL                      -- start of the current stretch on devices, if any
);
CREATE INDEX IF NOT EXISTS jobs_user ON jobs(user, created_at);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state);
CREATE TABLE IF NOT EXISTS events (
    job_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    type TEXT NOT NULL,
    time REAL NOT NULL,
    data_json TEXT NOT NULL,
    PRIMARY KEY (job_id, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS nodes (
    name TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    devices_json TEXT NOT NULL,
    instance TEXT NOT NULL,
    acked_seq INTEGER NOT NULL DEFAULT 0,
    heartbeat_at REAL,
    address TEXT                     -- how other nodes reach it (rank 0's MASTER_ADDR)
);
"""

#: the layout of state.db that this code writes; each change adds a step to ``Store._upgrade``
SCHEMA_VERSION = 1


class StoreTooNew(RuntimeError):
    """state.db was written by a newer version; the message says what to do."""


JOB_COLUMNS_FOR_INFO = (
    "id, user, name, state, sla, gpus, ranks, placement_json, attempt, created_at, updated_at, "
    "started_at, ended_at, error, result_pickle IS NOT NULL OR result_error IS NOT NULL, last_seq, "
    "checkpoint_every, filename"
)


class Store:
    """A thin, synchronous layer over one SQLite file (WAL mode).

    The server calls it from its single event-loop thread; each call is a short local
    transaction, which keeps the code simple and the latency low.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self._refuse_newer()
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # durable against process crashes
        self.db.execute("PRAGMA foreign_keys=ON")
        self._upgrade()

    def _refuse_newer(self) -> None:
        """A home written by a newer version is refused before anything in it changes."""
        found = self.db.execute("PRAGMA user_version").fetchone()[0]
        if found > SCHEMA_VERSION:
            self.db.close()
            raise StoreTooNew(
                f"{self.path} was written by a newer version of Singularity (schema {found}; this one "
                f"knows {SCHEMA_VERSION}): upgrade this installation, or serve from another --home")

    def _upgrade(self) -> None:
        """Bring a home written by an older version up to ``SCHEMA_VERSION`` (``PRAGMA
        user_version`` records it), in one transaction."""
        found = self.db.execute("PRAGMA user_version").fetchone()[0]
        self.db.executescript(SCHEMA)
        if found < SCHEMA_VERSION:
            with self.tx():
                self._add_missing_columns()  # schema 0: homes from before versions were recorded
                self._hash_clear_tokens()
                self.db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def _hash_clear_tokens(self) -> None:
        """A home made by an older version kept tokens in clear: keep only their hashes."""
        rows = self.db.execute("SELECT name, token FROM users WHERE token NOT LIKE ?", (HASH_PREFIX + "%",))
        for name, token in rows.fetchall():
            self.db.execute("UPDATE users SET token=? WHERE name=?", (hash_token(token), name))

    def _add_missing_columns(self) -> None:
        """A home made by an older version lacks newer columns: add them (all have defaults)."""
        for table, name, decl in (("jobs", "held_s", "REAL NOT NULL DEFAULT 0"),
                                  ("jobs", "attained_s", "REAL NOT NULL DEFAULT 0"), ("jobs", "held_since", "REAL"),
                                  ("nodes", "address", "TEXT"), ("jobs", "args_json", "TEXT NOT NULL DEFAULT '[]'"),
                                  ("jobs", "workdir", "TEXT"), ("jobs", "workdir_b64", "TEXT")):
            if name not in {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}:
                self.db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        else:
            self.db.execute("COMMIT")

    # ------------------------------------------------------------------ users / tokens

    def issue_token(self, name: str, role: str) -> str:
        """Create ``name`` (or give it a new token, the old one stops working); returns the token,
        which is not kept: only its hash is."""
        token = new_token()
        self.db.execute(
            "INSERT INTO users(name, token, role, created_at) VALUES (?,?,?,?) "
            "ON CONFLICT(name) DO UPDATE SET token=excluded.token, role=excluded.role",
            (name, hash_token(token), role, time.time()),
        )
        return token

    def token_is(self, name: str, token: str) -> bool:
        """Whether ``token`` is ``name``'s current token."""
        row = self.db.execute("SELECT token FROM users WHERE name=?", (name,)).fetchone()
        return row is not None and same_hash(row[0], token)

    def user_for_token(self, token: str) -> Optional[tuple[str, str]]:
        """(user, role) of ``token``, found by its hash and compared in constant time."""
        row = self.db.execute("SELECT name, role, token FROM users WHERE token=?", (hash_token(token),)).fetchone()
        return (row[0], row[1]) if row and same_hash(row[2], token) else None

    def user_exists(self, name: str) -> bool:
        return self.db.execute("SELECT 1 FROM users WHERE name=?", (name,)).fetchone() is not None

    # ------------------------------------------------------------------ jobs

    def insert_job(self, row: dict[str, Any]) -> None:
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        self.db.execute(f"INSERT INTO jobs({cols}) VALUES ({marks})", tuple(row.values()))

    def update_job(self, job_id: str, **fields: Any) -> None:
        fields["updated_at"] = now = time.time()
        if "state" in fields or "placement_json" in fields:
            fields.update(self._service_account(job_id, fields, now))
        sets = ", ".join(f"{k}=?" for k in fields)
        self.db.execute(f"UPDATE jobs SET {sets} WHERE id=?", (*fields.values(), job_id))

    def _service_account(self, job_id: str, fields: dict[str, Any], now: float) -> dict[str, Any]:
        """Close the job's current stretch on devices when it leaves them or its placement
        changes, and open one when it takes devices: what the scheduler's least-attained-
        service ordering reads (`attained`)."""
        old = self.db.execute("SELECT state, placement_json, held_since, held_s, attained_s FROM jobs WHERE id=?",
                              (job_id,)).fetchone()
        if old is None:
            return {}
        state, placement, since, held_s, attained_s = old
        new_state = fields.get("state", state)
        new_placement = fields.get("placement_json", placement)
        holding = JobState(new_state).holds_devices
        if since is not None and holding and new_placement == placement:
            return {}  # the same stretch goes on (e.g. running -> preempting)
        out: dict[str, Any] = {"held_since": now if holding else None}
        if since is not None:
            out["held_s"] = held_s + (now - since)
            out["attained_s"] = attained_s + (now - since) * _devices(placement)
        return out

    def job_row(self, job_id: str) -> Optional[sqlite3.Row]:
        cur = self.db.execute("SELECT * FROM jobs WHERE id=?", (job_id,))
        cur.row_factory = sqlite3.Row
        return cur.fetchone()

    def job_info(self, job_id: str) -> Optional[JobInfo]:
        row = self.db.execute(f"SELECT {JOB_COLUMNS_FOR_INFO} FROM jobs WHERE id=?", (job_id,)).fetchone()
        return _job_info(row) if row else None

    def list_jobs(self, user: Optional[str] = None, states: Optional[list[str]] = None, limit: int = 1000) -> list[JobInfo]:
        where, args = [], []
        if user is not None:
            where.append("user=?")
            args.append(user)
        if states:
            where.append(f"state IN ({','.join('?' for _ in states)})")
            args.extend(states)
        clause = ("WHERE " + " AND ".join(where)) if where else ""
        rows = self.db.execute(
            f"SELECT {JOB_COLUMNS_FOR_INFO} FROM jobs {clause} ORDER BY created_at, id LIMIT ?",
            (*args, limit),
        ).fetchall()
        return [_job_info(r) for r in rows]

    def active_job_rows(self) -> list[sqlite3.Row]:
        """Jobs that are not terminal (queued, running, or on their way somewhere)."""
        cur = self.db.execute(
            "SELECT * FROM jobs WHERE state NOT IN ('succeeded','failed','cancelled') ORDER BY created_at, id"
        )
        cur.row_factory = sqlite3.Row
        return cur.fetchall()

    # ------------------------------------------------------------------ events

    def append_event(self, job_id: str, type: EventType, data: dict[str, Any], when: Optional[float] = None) -> Event:
        """Append one event; caller holds a transaction (``tx``) when atomicity matters."""
        return self.append_events(job_id, [(type, data, time.time() if when is None else when)])[0]

    def append_events(self, job_id: str, items: list[tuple[EventType, dict[str, Any], float]]) -> list[Event]:
        """Append ``(type, data, time)`` events in order, with three statements however many
        there are (a chatty job's lines arrive by the hundred); caller holds the transaction."""
        first = self.db.execute("SELECT last_seq FROM jobs WHERE id=?", (job_id,)).fetchone()[0] + 1
        self.db.executemany(
            "INSERT INTO events(job_id, seq, type, time, data_json) VALUES (?,?,?,?,?)",
            [(job_id, first + i, t.value, when, json.dumps(data, default=str)) for i, (t, data, when) in enumerate(items)],
        )
        self.db.execute("UPDATE jobs SET last_seq=? WHERE id=?", (first + len(items) - 1, job_id))
        return [Event.model_construct(job_id=job_id, seq=first + i, type=t, time=when, data=data)
                for i, (t, data, when) in enumerate(items)]

    def events(self, job_id: str, since: int = 0, limit: int = 100_000) -> list[Event]:
        rows = self.db.execute(
            "SELECT seq, type, time, data_json FROM events WHERE job_id=? AND seq>? ORDER BY seq LIMIT ?",
            (job_id, since, limit),
        ).fetchall()
        return [Event(job_id=job_id, seq=s, type=EventType(t), time=tm, data=json.loads(d)) for s, t, tm, d in rows]

    def log_lines(self, job_id: str) -> list[tuple[int, str, str]]:
        """(rank, stream, line) of the job's output, without superseded lines (log_replay.py)."""
        rows = self.db.execute(
            "SELECT seq, type, data_json FROM events WHERE job_id=? AND type IN ('log', 'superseded') ORDER BY seq",
            (job_id,),
        ).fetchall()
        return log_replay.visible([(seq, t, json.loads(d)) for seq, t, d in rows])

    # ------------------------------------------------------------------ nodes

    def upsert_node(self, name: str, devices: list[DeviceInfo], instance: str, address: Optional[str] = None) -> int:
        """Register an agent; returns the sequence number already applied for this instance."""
        row = self.db.execute("SELECT instance, acked_seq FROM nodes WHERE name=?", (name,)).fetchone()
        devices_json = json.dumps([d.model_dump() for d in devices])
        now = time.time()
        if row is None:
            self.db.execute(
                "INSERT INTO nodes(name, state, devices_json, instance, acked_seq, heartbeat_at, address) "
                "VALUES (?,?,?,?,0,?,?)",
                (name, NodeState.READY.value, devices_json, instance, now, address),
            )
            return 0
        acked = row[1] if row[0] == instance else 0
        state = self.node_state(name)
        new_state = NodeState.DRAINING if state == NodeState.DRAINING else NodeState.READY
        self.db.execute(
            "UPDATE nodes SET state=?, devices_json=?, instance=?, acked_seq=?, heartbeat_at=?, address=? WHERE name=?",
            (new_state.value, devices_json, instance, acked, now, address, name),
        )
        return acked

    def node_state(self, name: str) -> Optional[NodeState]:
        row = self.db.execute("SELECT state FROM nodes WHERE name=?", (name,)).fetchone()
        return NodeState(row[0]) if row else None

    def set_node(self, name: str, **fields: Any) -> None:
        sets = ", ".join(f"{k}=?" for k in fields)
        self.db.execute(f"UPDATE nodes SET {sets} WHERE name=?", (*fields.values(), name))

    def node_acked(self, name: str) -> int:
        row = self.db.execute("SELECT acked_seq FROM nodes WHERE name=?", (name,)).fetchone()
        return row[0] if row else 0

    def nodes(self) -> list[NodeInfo]:
        rows = self.db.execute("SELECT name, state, devices_json, heartbeat_at, address FROM nodes ORDER BY name")
        return [
            NodeInfo(
                name=n,
                state=NodeState(s),
                devices=[DeviceInfo(**d) for d in json.loads(dj)],
                heartbeat_at=hb,
                address=addr,
            )
            for n, s, dj, hb, addr in rows.fetchall()
        ]


def _job_info(row: tuple) -> JobInfo:
    (id_, user, name, state, sla, gpus, ranks, placement_json, attempt, created, updated, started, ended,
     error, has_result, last_seq, ckpt_every, filename) = row
    return JobInfo(
        id=id_,
        name=name,
        user=user,
        state=JobState(state),
        sla=SLA(sla),
        gpus=gpus,
        ranks=ranks,
        placement=[Placement(**p) for p in json.loads(placement_json)],
        attempt=attempt,
        created_at=created,
        updated_at=updated,
        started_at=started,
        ended_at=ended,
        error=error,
        has_result=bool(has_result),
        last_seq=last_seq,
        checkpoint_every=ckpt_every,
        filename=filename,
    )


def _devices(placement_json: str) -> int:
    return sum(len(p["devices"]) for p in json.loads(placement_json or "[]"))


def attained(row: sqlite3.Row, now: float) -> tuple[float, Optional[float]]:
    """(device-seconds, seconds) the job has held devices up to ``now``, the current stretch
    included; seconds are None where the history is unknown (a job started before this
    accounting existed, in an older home)."""
    if row["held_since"] is None:
        unknown = row["started_at"] is not None and row["held_s"] == 0
        return row["attained_s"], None if unknown else row["held_s"]
    running = max(0.0, now - row["held_since"])
    return row["attained_s"] + running * _devices(row["placement_json"]), row["held_s"] + running
