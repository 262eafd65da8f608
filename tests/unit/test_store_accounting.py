"""Attained service in the store: device-seconds a job has held, across every stretch on
devices (runs, moves, resizes), which the scheduler orders jobs of one tier by."""
from __future__ import annotations

import json

import pytest

from backend.server import store as store_module
from backend.server.store import Store, attained


def _placement(*devices: int) -> str:
    return json.dumps([{"node": "node-1", "devices": list(devices), "ranks": []}])


def test_stretches_on_devices_add_up(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(store_module.time, "time", lambda: clock[0])
    st = Store(tmp_path / "s.db")
    st.insert_job(dict(id="j", user="u", name="j", state="queued", sla="basic", gpus=4, ranks=4, filename="x",
                       created_at=clock[0], updated_at=clock[0]))
    row = lambda: st.job_row("j")  # noqa: E731
    assert attained(row(), clock[0]) == (0.0, 0.0)
    st.update_job("j", state="running", placement_json=_placement(0, 1, 2, 3))  # 4 devices from t=1000
    clock[0] = 1010.0
    st.update_job("j", state="resizing")  # the same stretch goes on
    assert attained(row(), clock[0]) == (40.0, 10.0)
    st.update_job("j", state="resizing", placement_json=_placement(0, 1))  # 2 devices from t=1010
    clock[0] = 1015.0
    st.update_job("j", state="queued", placement_json="[]")  # preempted and requeued
    clock[0] = 1100.0  # waiting adds nothing
    assert attained(row(), clock[0]) == (50.0, 15.0)
    st.update_job("j", state="running", placement_json=_placement(3))
    assert attained(row(), 1102.0) == pytest.approx((52.0, 17.0))
