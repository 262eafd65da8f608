"""state.db across versions: a home written by an earlier version opens and is upgraded in place,
one written by a newer version is refused before anything is changed."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from backend.server.credentials import hash_token
from backend.server.store import SCHEMA_VERSION, Store, StoreTooNew
from singularity_sdk.protocol import JobState

DUMP = Path(__file__).resolve().parents[1] / "data" / "state-schema-1.sql"
#: columns that schema 0 (homes from before versions were recorded) did not have
ADDED_IN_1 = {"jobs": ["held_s", "attained_s", "held_since", "args_json", "workdir", "workdir_b64"],
              "nodes": ["address"]}


def _load(path: Path, script: str) -> None:
    db = sqlite3.connect(path)
    db.executescript(script)
    db.close()


def _version(path: Path) -> int:
    db = sqlite3.connect(path)
    try:
        return db.execute("PRAGMA user_version").fetchone()[0]
    finally:
        db.close()


def test_a_home_written_by_schema_1_keeps_its_jobs_and_users(tmp_path):
    path = tmp_path / "state.db"
    _load(path, DUMP.read_text())
    store = Store(path)
    try:
        (job_id,) = store.db.execute("SELECT id FROM jobs WHERE name='made-by-schema-1'").fetchone()
        info = store.job_info(job_id)
        assert info.state == JobState.SUCCEEDED and info.name == "made-by-schema-1"
        assert "kept across upgrades" in "".join(
            d for (d,) in store.db.execute("SELECT data_json FROM events WHERE job_id=? AND type='log'", (job_id,)))
        assert {r[0] for r in store.db.execute("SELECT name FROM users")} >= {"alice", "agents"}
    finally:
        store.close()
    assert _version(path) == SCHEMA_VERSION


def test_a_home_from_before_schema_versions_is_upgraded_in_place(tmp_path):
    path = tmp_path / "state.db"
    _load(path, DUMP.read_text())
    db = sqlite3.connect(path)
    for table, columns in ADDED_IN_1.items():
        for column in columns:
            db.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    db.execute("UPDATE users SET token='clear-token-of-alice' WHERE name='alice'")  # schema 0 kept them in clear
    db.execute("PRAGMA user_version=0")
    db.commit()
    db.close()
    store = Store(path)
    try:
        for table, columns in ADDED_IN_1.items():
            have = {row[1] for row in store.db.execute(f"PRAGMA table_info({table})")}
            assert set(columns) <= have, (table, have)
        assert store.user_for_token("clear-token-of-alice")[0] == "alice"
        stored = store.db.execute("SELECT token FROM users WHERE name='alice'").fetchone()[0]
        assert stored == hash_token("clear-token-of-alice")
    finally:
        store.close()
    assert _version(path) == SCHEMA_VERSION


def test_a_home_from_a_newer_version_is_refused_untouched(tmp_path):
    path = tmp_path / "state.db"
    _load(path, DUMP.read_text() + f"\nPRAGMA user_version={SCHEMA_VERSION + 1};\n")
    before = path.read_bytes()
    with pytest.raises(StoreTooNew, match="newer version.*upgrade this installation, or serve from another --home"):
        Store(path)
    assert path.read_bytes() == before and _version(path) == SCHEMA_VERSION + 1
