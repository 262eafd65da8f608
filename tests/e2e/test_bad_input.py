"""Bad input of every kind gets a clear 4xx naming the problem, and the server stays healthy."""
from __future__ import annotations

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from singularity_sdk import AuthError, Client, InvalidRequest, JobNotFound, JobState, ServerUnreachable
from singularity_sdk.errors import Conflict


@pytest.fixture()
def http(cluster):
    with httpx.Client(base_url=cluster.url + "/api/v1", headers={"Authorization": f"Bearer {cluster.token}"}) as h:
        yield h


def test_missing_and_wrong_token_are_401(cluster):
    r = httpx.get(cluster.url + "/api/v1/jobs")
    assert r.status_code == 401 and "missing token" in r.json()["error"]
    r = httpx.get(cluster.url + "/api/v1/jobs", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and "not recognised" in r.json()["error"]
    with pytest.raises(AuthError, match="not recognised"):
        Client(cluster.url, "wrong").jobs()
    with pytest.raises(InvalidStatus) as info:
        connect(cluster.url.replace("http", "ws") + "/api/v1/events/ws")
    assert info.value.response.status_code == 401


def test_user_token_cannot_open_the_agent_channel(cluster):
    with pytest.raises(InvalidStatus) as info:
        connect(cluster.url.replace("http", "ws") + "/api/v1/agents/ws",
                additional_headers={"Authorization": f"Bearer {cluster.token}"})
    assert info.value.response.status_code == 403


def test_malformed_json_unknown_fields_and_wrong_types(http):
    r = http.post("/jobs", content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    r = http.post("/jobs", content=b"[1, 2]")
    assert r.status_code == 400 and "JSON object" in r.json()["error"]
    r = http.post("/jobs", json={"source": "1", "gpu": 2})
    assert r.status_code == 422 and r.json() == {"error": "unknown field 'gpu'", "field": "gpu"}
    r = http.post("/jobs", json={"source": "1", "gpus": "two"})
    assert r.status_code == 422 and r.json()["field"] == "gpus"
    r = http.post("/jobs", json={"source": "1", "sla": "gold"})
    assert r.status_code == 422 and "premium" in r.json()["error"]
    r = http.post("/jobs", json={})
    assert r.status_code == 422 and "source" in r.json()["error"]
    r = http.post("/jobs", json={"source": "def f(:\n"})
    assert r.status_code == 422 and "does not compile" in r.json()["error"]


def test_oversize_code_is_413_with_advice(http):
    r = http.post("/jobs", json={"source": "x = '" + "a" * (10 * 1024 * 1024) + "'"})
    assert r.status_code == 413
    assert "limit" in r.json()["error"] and "file" in r.json()["error"]


def test_device_counts_out_of_range(client):
    with pytest.raises(InvalidRequest) as info:
        client.submit("1", gpus=0)
    assert info.value.field == "gpus"
    with pytest.raises(InvalidRequest, match="whole cluster has 4") as info:
        client.submit("1", gpus=5)
    assert info.value.field == "gpus"
    with pytest.raises(InvalidRequest, match="must divide"):
        client.submit("1", gpus=4, ranks=3)


def test_unknown_job_and_endpoint(client, http):
    with pytest.raises(JobNotFound, match="no job 'j-000000'"):
        client.get("j-000000")
    assert http.post("/jobs/j-000000/cancel", json={}).status_code == 404
    assert http.get("/jobs/j-000000/events").status_code == 404
    r = http.get("/jobz")
    assert r.status_code == 404 and "/api/v1" in r.json()["error"]
    assert http.get("/jobs/j-000000/events", params={"since": "x"}).status_code in (404, 422)


def test_cancel_of_finished_job_is_a_conflict(client):
    job = client.submit("1")
    job.wait(60)
    with pytest.raises(Conflict, match="already succeeded"):
        job.cancel()


def test_the_server_stays_healthy_under_a_burst_of_bad_input(client, http):
    """Self-contained (it must not rely on the tests above having run first)."""
    bad = [("POST", "/jobs", b"{not json"), ("POST", "/jobs", b'{"source": 1}'), ("POST", "/jobs", b"[" * 5000),
           ("GET", "/jobs/j-ffffff", None), ("POST", "/jobs/j-ffffff/preempt", b"{}"),
           ("GET", "/jobs/x/events?since=" + "9" * 40, None), ("POST", "/jobs", b'{"source": "1", "gpus": -1}')]
    for method, path, body in bad * 5:
        r = http.request(method, path, content=body, headers={"Content-Type": "application/json"})
        assert 400 <= r.status_code < 500, (method, path, r.status_code, r.text)
        assert "internal" not in r.text.lower(), r.text
    assert client.health()["ok"] is True
    assert client.submit("2 + 2").result(timeout=60) == 4


def test_users_see_and_control_only_their_own_jobs(cluster, client):
    mine = client.submit("import time; time.sleep(30)")
    bob = Client(cluster.url, client.create_user("bob"))
    with pytest.raises(Conflict):
        client.create_user("bob")
    with pytest.raises(AuthError):  # only the admin creates users
        bob.create_user("eve")
    assert bob.jobs() == []
    with pytest.raises(JobNotFound):
        bob.get(mine.id)
    assert httpx.post(f"{cluster.url}/api/v1/jobs/{mine.id}/cancel", headers=bob.headers, json={}).status_code == 404
    theirs = bob.submit("'bob'")
    assert theirs.result(timeout=60) == "bob"
    assert mine.id not in [j.id for j in bob.jobs()]
    assert theirs.id not in [j.id for j in client.jobs()]
    with pytest.raises(InvalidStatus):
        connect(cluster.url.replace("http", "ws") + f"/api/v1/jobs/{mine.id}/events/ws",
                additional_headers=bob.headers)
    mine.cancel()
    assert mine.wait(10) == JobState.CANCELLED


def test_unreachable_server_says_how_to_start_one():
    with pytest.raises(ServerUnreachable, match="singularityctl serve"):
        Client("http://127.0.0.1:9", "t").jobs()
