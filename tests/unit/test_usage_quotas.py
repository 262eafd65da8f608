"""Tier quotas and usage in the server: the admin sets quotas, every user sees their usage, and
the scheduler's snapshot carries the quotas."""
from __future__ import annotations

import json

import pytest

from backend.server import store as store_module
from backend.server.core import Core, ServiceConfig, ServiceError
from backend.server.store import Store
from backend.server.usage import Usage


class _Host(Usage):
    """Usage on a core of its own, counting the scheduling rounds it asks for."""

    def __init__(self, store: Store):
        super().__init__(Core(store, ServiceConfig()))
        self.rounds = 0
        self.core.schedule = self._round

    def _round(self) -> None:
        self.rounds += 1


def _job(st: Store, job_id: str, user: str, sla: str, now: float) -> None:
    st.insert_job(dict(id=job_id, user=user, name=job_id, state="queued", sla=sla, gpus=2, ranks=2, filename="x",
                       created_at=now, updated_at=now))


def test_usage_adds_device_hours_per_user_and_tier(tmp_path, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(store_module.time, "time", lambda: clock[0])
    st = Store(tmp_path / "s.db")
    for user in ("alice", "bob"):
        st.issue_token(user, "user")
    _job(st, "a1", "alice", "premium", 0.0)
    _job(st, "a2", "alice", "basic", 0.0)
    _job(st, "b1", "bob", "premium", 0.0)
    two = json.dumps([{"node": "n", "devices": [0, 1], "ranks": []}])
    st.update_job("a1", state="running", placement_json=two)
    st.update_job("b1", state="running", placement_json=json.dumps([{"node": "n", "devices": [2], "ranks": []}]))
    clock[0] = 3600.0
    st.update_job("a1", state="succeeded", placement_json="[]")  # 2 device-hours, finished
    clock[0] = 7200.0
    host = _Host(st)
    monkeypatch.setattr("backend.server.usage.time.time", lambda: clock[0])
    rows = {(r["user"], r["tier"]): r for r in host.usage(None)}
    assert rows[("alice", "premium")]["device_hours"] == pytest.approx(2.0)
    assert rows[("alice", "premium")]["holding"] == 0
    assert rows[("bob", "premium")]["device_hours"] == pytest.approx(2.0)  # 1 device for 2 h, still running
    assert rows[("bob", "premium")]["holding"] == 1
    assert rows[("alice", "basic")]["device_hours"] == 0.0 and rows[("alice", "basic")]["jobs"] == 1
    # a user sees only their own rows
    assert {r["user"] for r in host.usage("bob")} == {"bob"}


def test_quotas_are_set_by_the_admin_only_and_reach_the_snapshot(tmp_path):
    st = Store(tmp_path / "s.db")
    st.issue_token("alice", "user")
    host = _Host(st)
    with pytest.raises(ServiceError) as e:
        host.set_quota("user", "alice", "premium", 4)
    assert e.value.status == 403
    with pytest.raises(ServiceError) as e:
        host.set_quota("admin", "alice", "gold", 4)
    assert e.value.status == 422
    with pytest.raises(ServiceError) as e:
        host.set_quota("admin", "mallory", "premium", 4)
    assert e.value.status == 404
    assert host.set_quota("admin", "alice", "premium", 4) == {"user": "alice", "tier": "premium", "devices": 4}
    assert host.quotas() == {("alice", "premium"): 4} and host.rounds == 1
    assert [(r["tier"], r["quota"]) for r in host.usage("alice")] == [("premium", 4)]
    host.set_quota("admin", "alice", "premium", None)
    assert host.quotas() == {}
